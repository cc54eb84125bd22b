#!/usr/bin/env bash
# The main job on a fresh machine: set up, then run an emulated 4-worker SGLang fleet (no GPU,
# no Redis) behind the kvroute router, send the paper's GSP workload (scaled down) through it
# with three routing policies, print the results table and one /explain sample.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/kvroute cluster --workers 4 --eviction rlt --time-scale 10 \
  --policy lbgr cache_aware round_robin \
  --workload gsp --gsp-groups 32 --gsp-prompts-per-group 8 --rate 10 "$@"
