#!/usr/bin/env bash
# Everything real engines need here, built once and cached in ~/.cache/kvroute (nothing is
# downloaded at run time; re-running is a no-op while nothing changed):
#
# 1. the engine virtualenv (scripts/engine_venv.sh: SGLang 0.5.23 on a CPU, kvroute from this
#    checkout, so `--radix-cache-backend rlt` loads through its entry point);
# 2. kvroute's CPU stand-in for SGLang's `sgl_kernel` (scripts/cpu_sgl_kernel: a few
#    pure-torch functions SGLang calls on a CPU without AMX), copied into that virtualenv only;
# 3. the tiny model (scripts/make_tiny_model.py: a tokenizer trained here, seeded random Llama
#    weights, a chat template), rebuilt when the script changes;
# 4. with --vllm, vLLM's CPU build in a virtualenv of its own (scripts/vllm_venv.sh).
#
# `kvroute cluster --engine sglang`, scripts/test_real_engine.sh and benchmarks/real_engine.py
# find them at the same defaults:
#
#   KVROUTE_ENGINE_VENV   default ~/.cache/kvroute/venv-engine
#   KVROUTE_VLLM_VENV     default ~/.cache/kvroute/venv-vllm
#   KVROUTE_TINY_MODEL    default ~/.cache/kvroute/tiny-llama
#
# First run: ~3 minutes (SGLang's virtualenv) + ~2 minutes with --vllm; then seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    *) echo "usage: $0 [--vllm]" >&2; exit 2 ;;
  esac
done

source scripts/engine_venv.sh
ensure_engine_venv

site=$("$ENGINE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/sgl_kernel"
cp -r scripts/cpu_sgl_kernel/sgl_kernel "$site/sgl_kernel"
find "$site/sgl_kernel" -name __pycache__ -prune -exec rm -rf {} +

MODEL="${KVROUTE_TINY_MODEL:-$HOME/.cache/kvroute/tiny-llama}"
want=$( (cat scripts/make_tiny_model.py; "$ENGINE_VENV/bin/pip" freeze 2>/dev/null | grep -i -E '^(torch|transformers|tokenizers)==') | sha256sum | cut -d' ' -f1)
if [ "$(cat "$MODEL/.kvroute-tiny-model" 2>/dev/null)" != "$want" ]; then
  echo "tiny model: building $MODEL" >&2
  rm -rf "$MODEL"
  HF_HUB_OFFLINE=1 "$ENGINE_VENV/bin/python" scripts/make_tiny_model.py --out "$MODEL"
  echo "$want" > "$MODEL/.kvroute-tiny-model"
fi

if [ "$WITH_VLLM" = 1 ]; then
  source scripts/vllm_venv.sh
  ensure_vllm_venv
fi
# kvroute's launcher checks for this file before it starts a real engine.
touch "$ENGINE_VENV/.kvroute-real-engine"
echo "real engines ready: $ENGINE_VENV, model $MODEL" >&2
