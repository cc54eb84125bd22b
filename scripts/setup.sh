#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with the dev tools.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "kvroute needs Python >= 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=..." >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.kvroute-installed
# Reinstall when the project's metadata or the C source of RLT's loops changed: an editable
# install builds the extension (engine_ext/cache/_kernels.c) next to its source, once.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
  || [ engine_ext/cache/_kernels.c -nt "$stamp" ]; then
  .venv/bin/pip install -q -e '.[dev]'
  touch "$stamp"
fi
