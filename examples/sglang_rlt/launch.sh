#!/usr/bin/env bash
# One SGLang worker on a GPU with kvroute's RLT eviction (--radix-cache-backend rlt).
#
# NOT RUN by kvroute's CI or its authors: no GPU machine here could hold SGLang's GPU wheels.
# The backend itself is tested on a CPU against SGLang 0.5.23's real classes
# (scripts/test_engine.sh); see docs/sglang_plugin.md for what was and was not run.
#
# Set-up on the GPU machine (CUDA build of SGLang 0.5.23 and kvroute in one environment):
#   pip install "kvroute[engine]"          # or, from a checkout: pip install -e ".[engine]"
#
#   MODEL   Hugging Face id or local path (default meta-llama/Llama-3.1-8B-Instruct, the paper's)
#   PORT    HTTP port (default 30000)
#   EVICTION  rlt (default) or lru, to run the same worker with SGLang's built-in LRU
#   RLT_SEED  seed of RLT's draws (default 0); also --random-seed or $KVROUTE_RLT_SEED
#
# Extra arguments go to sglang.launch_server (e.g. --mem-fraction-static 0.6, --page-size 16).
set -euo pipefail
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
PORT="${PORT:-30000}"
EVICTION="${EVICTION:-rlt}"
RLT_SEED="${RLT_SEED:-0}"

args=(--model-path "$MODEL" --host 0.0.0.0 --port "$PORT" --enable-metrics)
if [ "$EVICTION" = rlt ]; then
  # SGLang's plugin loader finds kvroute's entry point (group sglang.srt.plugins) and
  # registers the backend; the server log then says "kvroute RLT radix cache active".
  args+=(--radix-cache-backend rlt --radix-eviction-policy-config "{\"seed\": $RLT_SEED}")
else
  args+=(--radix-eviction-policy lru)
fi
exec python -m sglang.launch_server "${args[@]}" "$@"
