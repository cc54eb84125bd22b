#!/usr/bin/env bash
# The engine tier: kvroute's RLT backend against SGLang's real classes, on a CPU.
#
# SGLang's full dependency set pulls GPU-only wheels, so the tier runs in its own virtualenv,
# built by the recipe in docs/sglang_plugin.md (torch from the local wheel cache, then sglang
# with --no-deps plus a short list). The virtualenv lives outside the clone and is reused
# while the recipe is unchanged: a stamp file holds the recipe's hash, and a changed recipe
# rebuilds from scratch. kvroute itself is installed --no-deps, editable, from this checkout.
#
#   KVROUTE_ENGINE_VENV   where the virtualenv lives (default ~/.cache/kvroute/venv-engine)
#   PYTHON                the interpreter to build it with (default python3, >= 3.11)
#
# Extra arguments go to pytest, e.g. scripts/test_engine.sh -k equality.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVROUTE_ENGINE_VENV:-$HOME/.cache/kvroute/venv-engine}"
PYTHON="${PYTHON:-python3}"

# The recipe, one pip install per line. Changing a line rebuilds the virtualenv.
RECIPE=$(cat <<'EOF'
torch==2.14.1 torchvision==0.29.1
--no-deps sglang==0.5.23
numpy psutil requests packaging pydantic orjson msgspec setproctitle pyzmq pybase64 triton pillow starlette fastapi tqdm IPython aiohttp transformers dill apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors gguf
openai partial_json_parser
pytest pytest-timeout hypothesis
EOF
)
stamp="$VENV/.kvroute-engine-recipe"
want=$(printf '%s\n%s\n' "$("$PYTHON" --version 2>&1)" "$RECIPE" | sha256sum | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "engine tier: building $VENV (about 2-3 minutes, ~6 GB)" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  while IFS= read -r line; do
    # shellcheck disable=SC2086  # one recipe line is a list of pip arguments
    "$VENV/bin/pip" install -q $line
  done <<< "$RECIPE"
  echo "$want" > "$stamp"
fi

"$VENV/bin/pip" install -q --no-deps -e .
# The tier imports SGLang once (~15 s) and must stay well under 3 minutes.
exec "$VENV/bin/python" -m pytest -p no:cacheprovider tests/engine_sglang "$@"
