#!/usr/bin/env bash
# Sourced by scripts/test_engine.sh and scripts/real_engine_setup.sh: builds (once) the engine
# virtualenv that holds SGLang 0.5.23 on a CPU, and installs this checkout into it.
#
# SGLang's full dependency set pulls GPU-only wheels, so the virtualenv is built by a recipe
# (torch from the local wheel cache, then sglang with --no-deps plus the short list it imports
# to serve: tested in docs/sglang_plugin.md). It lives outside the clone and is reused while the
# recipe is unchanged: a stamp file holds the recipe's hash, and a changed recipe rebuilds it
# from scratch. Both the engine tier (SGLang's classes) and the real-engine tier (SGLang
# serving a tiny model) use this one virtualenv.
#
#   KVROUTE_ENGINE_VENV   where the virtualenv lives (default ~/.cache/kvroute/venv-engine)
#   PYTHON                the interpreter to build it with (default python3, >= 3.11)
#
# After `source scripts/engine_venv.sh; ensure_engine_venv`, $ENGINE_VENV is the virtualenv.

ENGINE_VENV="${KVROUTE_ENGINE_VENV:-$HOME/.cache/kvroute/venv-engine}"

# The recipe, one pip install per line. Changing a line rebuilds the virtualenv.
ENGINE_RECIPE=$(cat <<'EOF'
torch==2.14.1 torchvision==0.29.1
--no-deps sglang==0.5.23
numpy psutil requests packaging pydantic orjson msgspec setproctitle pyzmq pybase64 triton pillow starlette fastapi tqdm IPython aiohttp dill apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors gguf transformers==5.19.0 tokenizers==0.23.2 uvicorn uvloop openai==2.8.0 partial_json_parser einops jsonschema xgrammar==0.2.7 soundfile python-multipart prometheus-client
pytest pytest-timeout hypothesis
EOF
)

ensure_engine_venv() {
  local python="${PYTHON:-python3}" stamp want line
  stamp="$ENGINE_VENV/.kvroute-engine-recipe"
  want=$(printf '%s\n%s\n' "$("$python" --version 2>&1)" "$ENGINE_RECIPE" | sha256sum | cut -d' ' -f1)
  if [ ! -x "$ENGINE_VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "engine virtualenv: building $ENGINE_VENV (about 2-3 minutes, ~6 GB)" >&2
    rm -rf "$ENGINE_VENV"
    mkdir -p "$(dirname "$ENGINE_VENV")"
    "$python" -m venv "$ENGINE_VENV"
    while IFS= read -r line; do
      # shellcheck disable=SC2086  # one recipe line is a list of pip arguments
      "$ENGINE_VENV/bin/pip" install -q $line
    done <<< "$ENGINE_RECIPE"
    echo "$want" > "$stamp"
  fi
  "$ENGINE_VENV/bin/pip" install -q --no-deps -e .
}
