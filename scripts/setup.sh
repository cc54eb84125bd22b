#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with the dev tools.
# Idempotent: a second run only checks what is installed. The first run downloads and
# installs kvroute's dependencies and dev tools (pip shows its progress; about a minute and a
# half on a 2-core machine) and, where a C compiler is, builds RLT's C loops
# (engine_ext/cache/_kernels.c; without one RLT runs its reference loop in Python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "kvroute needs Python >= 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=..." >&2
  exit 1
fi
started=$SECONDS
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PYTHON" --version 2>&1)" >&2
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.kvroute-installed
# Reinstall when the project's metadata or the C source of RLT's loops changed: an editable
# install builds the extension (engine_ext/cache/_kernels.c) next to its source, once.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
  || [ engine_ext/cache/_kernels.c -nt "$stamp" ]; then
  echo "setup: installing kvroute and its dev tools into .venv (pip's progress follows; the" \
    "first time takes a minute or two)" >&2
  set +e
  .venv/bin/pip install --progress-bar on -e '.[dev]' 2>&1 \
    | grep --line-buffered -v -e '^Requirement already satisfied' -e '^  Using cached' >&2
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" != 0 ]; then
    echo "setup: pip install -e '.[dev]' failed (exit $status; see above)" >&2
    exit "$status"
  fi
  touch "$stamp"
  echo "setup: .venv ready in $((SECONDS - started)) s" >&2
fi
