"""Routing decision time in process (no HTTP): lbgr and cache_aware, 16 workers.

The target: ``lbgr`` (its default: ``ratio``, the index discounted by what survives) with 16
workers and 8k-character prompts with shared prefixes, p50 <= 200 us and p99 <= 1 ms per
decision. A decision here is what the service does per request between reading the load
store and sending: ``Router.decide`` (prefix-index match for all workers + policy) and
``Router.commit`` (index insert, in-flight and backlog counts), plus ``complete`` at the end
(residual model learning, and what survives: each answer reports the cached tokens the
router predicted) timed separately. The index is warmed
with the workload first so matches walk a populated tree (trimmed to the default size).
"""

from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import base_parser, write_json

from router_service.routing import Outcome, Router, RouteRequest, WorkerStatus, make_policy

WORKERS = 16
PROMPT_CHARS = 8192


def prompts(rng: random.Random, groups: int, per_group: int) -> list[str]:
    """Chat-like prompts: a shared system prefix per group (half the prompt) + a unique tail."""
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    out = []
    for _ in range(groups):
        prefix = "".join(rng.choices(alphabet, k=PROMPT_CHARS // 2))
        for _ in range(per_group):
            out.append(prefix + "".join(rng.choices(alphabet, k=PROMPT_CHARS // 2)))
    rng.shuffle(out)
    return out


def measure(policy: str, texts: list[str], warm: int, params: dict[str, Any]) -> dict[str, float]:
    router = Router(make_policy(policy, random.Random(1), **params))
    statuses = [WorkerStatus(f"http://10.0.0.{i}:30000", queue_ms=float(i)) for i in range(WORKERS)]
    decide_us, complete_us = [], []
    gc.disable()
    try:
        for i, text in enumerate(texts):
            req = RouteRequest(f"r{i}", text)
            t0 = time.perf_counter_ns()
            decision = router.decide(req, statuses)
            router.commit(req, decision, now_ms=float(i))
            t1 = time.perf_counter_ns()
            found = int((decision.candidate(decision.chosen).cached or 0) * req.tokens_per_unit)
            outcome = Outcome(True, latency_ms=500.0 + (i % 7) * 10, cached_tokens=found)
            router.complete(decision, outcome)
            t2 = time.perf_counter_ns()
            if i >= warm:
                decide_us.append((t1 - t0) / 1000.0)
                complete_us.append((t2 - t1) / 1000.0)
    finally:
        gc.enable()
    decide_us.sort()
    complete_us.sort()

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q / 100.0 * len(values)))]

    return {
        "decisions": len(decide_us),
        "p50_us": round(pct(decide_us, 50), 1),
        "p99_us": round(pct(decide_us, 99), 1),
        "max_us": round(decide_us[-1], 1),
        "complete_p50_us": round(pct(complete_us, 50), 1),
        "complete_p99_us": round(pct(complete_us, 99), 1),
    }


def main() -> int:
    parser = base_parser("decision_time", __doc__)
    args = parser.parse_args()
    groups, per_group, warm = (20, 20, 100) if args.quick else (100, 40, 1000)
    texts = prompts(random.Random(0), groups, per_group)
    rows = []
    for policy, params in (
        ("lbgr", {}),
        ("lbgr", {"learn_cache": False}),
        ("lbgr", {"model": "ewmean"}),
        ("lbgr", {"model": "linear"}),
        ("cache_aware", {}),
        ("round_robin", {}),
    ):
        figures = measure(policy, texts, warm, params)
        if "model" in params:
            label = f"{policy} ({params['model']})"
        elif policy == "lbgr":
            label = f"{policy} ({'index as it is' if params else 'default'})"
        else:
            label = policy
        rows.append({"policy": label, **figures})
    print(
        f"## Decision time in process: {WORKERS} workers, {PROMPT_CHARS}-char prompts, "
        f"{groups} groups x {per_group} (half shared)\n"
    )
    print(
        "| policy | decisions | p50 (us) | p99 (us) | max (us) | complete p50 (us) | "
        "complete p99 (us) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['decisions']} | {r['p50_us']} | {r['p99_us']} | "
            f"{r['max_us']} | {r['complete_p50_us']} | {r['complete_p99_us']} |"
        )
    lbgr = rows[0]
    ok = lbgr["p50_us"] <= 200 and lbgr["p99_us"] <= 1000
    print(f"\ntarget lbgr (default) p50 <= 200 us and p99 <= 1000 us: {'met' if ok else 'NOT met'}")
    write_json(args.out, "decision_time", {"rows": rows, "target_met": ok})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
