#!/usr/bin/env bash
# The router's tests run a real redis-server (tests/router_service). Install the Debian package
# when it is missing and we are root; otherwise say what to do (those tests then skip).
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "redis-server not found; installing the Debian package redis-server" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends redis-server >/dev/null
  command -v redis-server >/dev/null 2>&1 || {
    echo "apt-get installed redis-server but it is not on PATH" >&2
    exit 1
  }
else
  echo "redis-server is not installed and we cannot install it (not root, or no apt-get):" >&2
  echo "  install it (e.g. 'sudo apt-get install redis-server') to run the Redis tests;" >&2
  echo "  until then tests/router_service skips them." >&2
fi
