#!/usr/bin/env bash
# The engine tier: kvroute's RLT backend against SGLang's real classes, on a CPU.
#
# SGLang's full dependency set pulls GPU-only wheels, so the tier runs in its own virtualenv,
# built (once, cached outside the clone) by scripts/engine_venv.sh; kvroute itself is installed
# --no-deps, editable, from this checkout.
#
#   KVROUTE_ENGINE_VENV   where the virtualenv lives (default ~/.cache/kvroute/venv-engine)
#   PYTHON                the interpreter to build it with (default python3, >= 3.11)
#
# Extra arguments go to pytest, e.g. scripts/test_engine.sh -k equality.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/engine_venv.sh
ensure_engine_venv
VENV="$ENGINE_VENV"
# The tier imports SGLang once (~15 s) and must stay well under 3 minutes.
exec "$VENV/bin/python" -m pytest -p no:cacheprovider tests/engine_sglang "$@"
