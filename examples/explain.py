"""Why did my request go there? ``POST /explain`` before sending, ``GET /explain/{id}`` after.

Starts 4 emulated workers and a router (or uses ``--url``), sends one request carrying a
long system prompt so that one worker caches it, then asks the router what it would do with
a second prompt sharing that system prompt, and prints the per-worker breakdown: cached and
uncached units, the request's own time, what the worker's load adds, the learned residual,
the prediction, the delay it would add to the worker's other requests and the cost compared.
Then it sends that prompt for real and prints the recorded decision with its outcome
(latency, TTFT, the residual model's error). The JSON schema is in ``docs/explain.md``.

    python examples/explain.py                         # own emulated cluster, ~15 s
    python examples/explain.py --url http://localhost:8000 --prompt "..."
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from example_cluster import Router, add_cluster_arguments, open_router

from kvroute.explain_table import format_decision, format_outcome

SYSTEM_PROMPT = (
    "You are a support assistant for a cloud GPU provider. Answer in two sentences, cite the "
    "relevant section of the handbook, and never invent prices. " * 12
)


def body(prompt: str, max_new_tokens: int) -> dict[str, Any]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}}


def recorded(router: Router, decision_id: str, wait_s: float = 10.0) -> dict[str, Any]:
    """The recorded decision, once its outcome is in (it lands as the response ends)."""
    deadline = time.monotonic() + wait_s
    while True:
        answer: dict[str, Any] = router.json("GET", f"/explain/{decision_id}")
        if answer.get("outcome") is not None or time.monotonic() > deadline:
            return answer
        time.sleep(0.05)


def run(router: Router, args: argparse.Namespace) -> dict[str, Any]:
    system = args.system_prompt
    # Our own emulated workers run --time-scale times faster: their times are emulated.
    clock = "emulated" if args.url is None and args.time_scale != 1 else ""
    print(f"1. warm-up: one request with the {len(system)}-character system prompt")
    status, headers, _ = router.call("POST", "/generate", body(system + "\nHello.", 8))
    if status != 200:
        raise SystemExit(f"the warm-up request failed with HTTP {status}")
    print(f"   went to {headers.get('x-kvroute-worker')}\n")

    prompt = system + "\n" + args.prompt
    print("2. POST /explain: what the router would do now (nothing is sent or reserved)")
    dry_run = router.json("POST", "/explain", body(prompt, args.max_new_tokens))
    print(format_decision(dry_run, clock=clock) + "\n")

    print("3. the same prompt for real, then GET /explain/{decision id}")
    status, headers, _ = router.call("POST", "/generate", body(prompt, args.max_new_tokens))
    decision_id = headers.get("x-kvroute-decision-id")
    print(f"   HTTP {status}, X-KVRoute-Worker: {headers.get('x-kvroute-worker')}")
    if decision_id is None:
        raise SystemExit("the response carried no X-KVRoute-Decision-Id: is --url a kvroute?")
    after = recorded(router, decision_id)
    print(format_decision(after, clock=clock))
    print(format_outcome(after.get("outcome")))
    return {"dry_run": dry_run, "recorded": after, "status": status}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="How do I resize a running instance's disk?")
    parser.add_argument("--system-prompt", default=SYSTEM_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print both decisions as JSON last")
    add_cluster_arguments(parser)
    args = parser.parse_args()
    with open_router(args) as router:
        result = run(router, args)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    outcome = result["recorded"].get("outcome") or {}
    return 0 if result["status"] == 200 and outcome.get("status") == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
