#!/usr/bin/env bash
# The real-engine tier: SGLang 0.5.23 (and vLLM's CPU build) serving a tiny model on a CPU,
# behind `kvroute serve` (tests/engine_real).
#
# First builds, or finds cached, what real engines need (scripts/real_engine_setup.sh --vllm:
# the engines' virtualenvs, kvroute's CPU stand-in for sgl_kernel, the tiny model; ~7 minutes
# the first time on 2 cores, seconds after). The tests run in the main virtualenv (router and
# clients, as a user has them) and start the engines from theirs. ~6 minutes on 2 cores.
#
# Extra arguments go to pytest, e.g. scripts/test_real_engine.sh -k vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/real_engine_setup.sh --vllm
exec .venv/bin/python -m pytest -p no:cacheprovider --timeout 900 -v -s tests/engine_real "$@"
