#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, then run an emulated 4-worker SGLang fleet
# (no GPU, no Redis) behind the kvroute router, send the paper's GSP workload (scaled down)
# through it with three routing policies, print the results table and one /explain decision.
# The first run installs .venv (a minute or two); later runs take about 30 s.
# Extra arguments go to `kvroute cluster` (./scripts/demo.sh --help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
if [ ! -f .venv/.kvroute-installed ]; then
  echo "demo: [1/2] first run: setting up .venv (a minute or two)" >&2
fi
scripts/setup.sh
case " $* " in
  *" -h "* | *" --help "*) exec .venv/bin/kvroute cluster --help ;;
esac
echo "demo: [2/2] starting 4 emulated workers and the router; 3 policies x 256 requests" >&2
status=0
.venv/bin/kvroute cluster --workers 4 --eviction rlt --time-scale 10 \
  --policy lbgr cache_aware round_robin \
  --workload gsp --gsp-groups 32 --gsp-prompts-per-group 8 --rate 10 "$@" || status=$?
if [ "$status" = 0 ]; then
  echo "demo: done in $((SECONDS - started)) s" >&2
else
  echo "demo: failed after $((SECONDS - started)) s (exit $status; see above)" >&2
fi
exit "$status"
