# syntax=docker/dockerfile:1
# An SGLang GPU worker with kvroute's RLT eviction: the official SGLang image plus kvroute
# installed from this repository's source, so its `sglang.srt.plugins` entry point
# (engine_ext.sglang_plugin:register) adds `--radix-cache-backend rlt` to SGLang.
#
#   docker build -f docker/worker.Dockerfile -t kvroute-sglang-worker .   # from the repo root
#   docker run --gpus '"device=0"' --ipc=host -p 30000:30000 \
#       -v ~/.cache/huggingface:/root/.cache/huggingface -e HF_TOKEN=... \
#       -e MODEL_PATH=meta-llama/Llama-3.1-8B-Instruct kvroute-sglang-worker
#
# The SGLang version is pinned twice on purpose: here (the image) and in pyproject.toml's
# `engine` extra (sglang==0.5.23). Upgrade both together (docs/operations.md).
ARG SGLANG_IMAGE=lmsysorg/sglang
ARG SGLANG_TAG=v0.5.23
FROM ${SGLANG_IMAGE}:${SGLANG_TAG}

# The image already has SGLang, torch and numpy: install kvroute without its dependencies
# (the router's FastAPI/River stack is not needed on a worker), then fail the build if the
# plugin entry point is not visible to SGLang's loader.
WORKDIR /opt/kvroute/src
COPY pyproject.toml setup.py README.md ./
COPY kvroute ./kvroute
COPY router_service ./router_service
COPY models ./models
COPY engine_ext ./engine_ext
COPY sim ./sim
RUN python3 -m pip install --no-cache-dir --no-deps . \
    && python3 -c "import sys; from importlib.metadata import entry_points; sys.exit(0 if any(ep.value == 'engine_ext.sglang_plugin:register' for ep in entry_points(group='sglang.srt.plugins')) else 'kvroute plugin entry point missing')" \
    && rm -rf /opt/kvroute/src

WORKDIR /workspace

# MODEL_PATH: a Hugging Face id or a path under a mounted volume. HF_HOME is where the
# compose file mounts the host's Hugging Face cache. SGLANG_EXTRA_ARGS is appended as is
# (e.g. "--tp 2 --mem-fraction-static 0.85"). KVROUTE_RLT_SEED seeds RLT's draws.
ENV MODEL_PATH=meta-llama/Llama-3.1-8B-Instruct \
    HF_HOME=/root/.cache/huggingface \
    SGLANG_EXTRA_ARGS="" \
    KVROUTE_RLT_SEED=0

EXPOSE 30000

# Loading weights (and downloading them the first time) takes minutes: a long start period.
HEALTHCHECK --interval=15s --timeout=10s --start-period=900s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=8)"]

# A shell so that MODEL_PATH and SGLANG_EXTRA_ARGS expand; exec so SGLang gets the signals.
# SGLANG_EXTRA_ARGS is split on spaces on purpose (several flags in one variable).
CMD ["sh", "-c", "exec python3 -m sglang.launch_server --model-path \"$MODEL_PATH\" --host 0.0.0.0 --port 30000 --radix-cache-backend rlt --enable-metrics $SGLANG_EXTRA_ARGS"]
