#!/usr/bin/env bash
# The /ui browser test (tests/router_service/test_ui_browser.py) drives a real headless
# Chromium through chromedriver (Selenium). Install Debian's chromium and chromium-driver when
# they are missing and we are root (about 300 MB with their libraries); otherwise say what to
# do (the browser test then skips and names what is missing). KVROUTE_NO_SYSTEM_INSTALL=1
# installs nothing.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if [ "${KVROUTE_NO_SYSTEM_INSTALL:-0}" = "1" ]; then
  echo "chromium/chromedriver missing; KVROUTE_NO_SYSTEM_INSTALL=1: not installing them" \
    "(the /ui browser test skips)" >&2
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's chromium and chromium-driver (apt-get, ~300 MB) for the /ui" \
    "browser test" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
  command -v chromedriver >/dev/null 2>&1 || {
    echo "apt-get installed chromium-driver but chromedriver is not on PATH" >&2
    exit 1
  }
else
  echo "chromium and chromedriver are not installed and we cannot install them (not root, or" \
    "no apt-get):" >&2
  echo "  'sudo apt-get install chromium chromium-driver' lets the /ui browser test run;" >&2
  echo "  until then it skips." >&2
fi
