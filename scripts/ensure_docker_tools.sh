#!/usr/bin/env bash
# The deployment tests (tests/docker) check docker/ without a Docker engine: Debian's
# docker-compose renders and validates the compose file, and Prometheus' promtool and server
# check the scrape config and run the Grafana dashboard's queries. Install what is missing
# when we can (docker-compose: the Debian package, as root; Prometheus: the two binaries of
# Debian's package, unpacked into a cache directory, no service). A failed install is not
# fatal: the tests that need the tool skip and name it.
set -uo pipefail
tools="${KVROUTE_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvroute/tools}"
updated=0

apt_update() {
  if [ "$updated" = 0 ] && [ "$(id -u)" = "0" ]; then
    apt-get update -qq >/dev/null && updated=1
  fi
}

install_compose() {
  if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "docker-compose is missing and we cannot install it (not root, or no apt-get):" >&2
    echo "  'sudo apt-get install docker-compose' lets tests/docker validate the compose file." >&2
    return 1
  fi
  echo "docker-compose not found; installing the Debian package docker-compose" >&2
  apt_update
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    docker-compose >/dev/null
}

install_prometheus() {
  if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
    echo "promtool is missing and there is no apt-get here to fetch it." >&2
    return 1
  fi
  echo "promtool not found; unpacking Debian's prometheus package into $tools" >&2
  apt_update
  local tmp
  tmp="$(mktemp -d)"
  (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1) \
    && dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root" \
    && mkdir -p "$tools/bin" \
    && cp "$tmp/root/usr/bin/prometheus" "$tmp/root/usr/bin/promtool" "$tools/bin/"
  local status=$?
  rm -rf "$tmp"
  return $status
}

if ! command -v docker-compose >/dev/null 2>&1; then
  install_compose || echo "docker-compose not installed: tests/docker will skip its checks" >&2
fi
if ! command -v promtool >/dev/null 2>&1 && [ ! -x "$tools/bin/promtool" ]; then
  install_prometheus || echo "promtool not installed: tests/docker will skip its checks" >&2
fi
exit 0
