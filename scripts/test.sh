#!/usr/bin/env bash
# Every check on a fresh machine: set up .venv (scripts/setup.sh), lint (ruff), type-check
# (mypy), then the test suite (pytest; extra arguments go to it).
#
# Some tests use real system tools. Run as root on Debian/Ubuntu, this script installs the
# missing ones, and says so as it does:
#   redis-server             Debian package; the router's Redis tests run a real server
#   docker-compose           Debian package (with about 20 python3-* packages it depends on);
#                            validates docker/'s compose file without a Docker engine
#   prometheus, promtool     the two binaries of Debian's prometheus package, unpacked into
#                            ~/.cache/kvroute/tools (no service); check the Prometheus config
#                            and run the Grafana dashboard's queries against a live router
#   chromium, chromedriver   Debian packages (about 300 MB); the /ui browser test
# KVROUTE_NO_SYSTEM_INSTALL=1 installs none of them; a test whose tool is missing then skips
# and names it. Not root: nothing is installed, and the scripts say what to install.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
scripts/setup.sh
if [ "${KVROUTE_NO_SYSTEM_INSTALL:-0}" = "1" ]; then
  echo "test.sh: KVROUTE_NO_SYSTEM_INSTALL=1: no system package is installed; tests whose" \
    "tool is missing skip" >&2
else
  scripts/ensure_redis.sh
  scripts/ensure_docker_tools.sh
  scripts/ensure_chromium.sh
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
status=0
.venv/bin/python -m pytest "$@" || status=$?
echo "test.sh: done in $((SECONDS - started)) s" >&2
exit "$status"
