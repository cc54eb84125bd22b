#!/usr/bin/env bash
# Every check on a fresh machine: set up, lint (ruff), type-check (mypy), then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
