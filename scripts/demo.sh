#!/usr/bin/env bash
# The main job on a fresh machine: set up, then compare routing policies and eviction
# policies on the paper's GSP workload in the simulator (4 workers, 12 req/s, no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/kvroute sim --workload gsp --order random --workers 4 --rate 12 \
  --policy random round_robin cache_aware lbgr --eviction lru rlt --jobs 2 "$@"
