#!/usr/bin/env bash
# Every check on a fresh machine: set up (venv, redis-server for the router's tests,
# docker-compose and promtool for the deployment files' tests), lint (ruff), type-check (mypy),
# then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/ensure_redis.sh
scripts/ensure_docker_tools.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
