"""Eviction cost per evicted token, ``rlt`` vs ``lru``, on ~100k-token trees (target <= 1.5x).

Three tree shapes, each built from one seeded insert sequence so both policies get identical
trees: ``gsp`` (shared prefixes of ~1k tokens, ~8 question leaves of ~256 tokens per group),
``chat`` (conversations of 2-8 turns of 32-64 tokens under a few system prompts, some forked
from an earlier turn: many short leaves under deeper branches) and ``longdoc`` (a dozen ~8k
documents under one short system prompt). The cache capacity is a little above the tree size,
so nothing is evicted while building; then one ``evict(n)`` call is timed with
``time.perf_counter_ns`` on a freshly built tree, for n = 1k, 10k and 50k tokens. The two
policies alternate (the order flips every repetition) and the garbage collector is off inside
the timed call, as ``timeit`` does. Cost per token uses the tokens actually freed: leaf-LRU
drops whole leaves, so it may free more than asked.

Under churn (the second table). A fresh tree is the state a cache starts in, not the one it
serves in: a serving cache is full and evicts for most requests, from the tree its own
evictions left (for RLT, leaves trimmed short, which empty often; leaf-LRU has dropped
whole leaves). Each shape's churn stream (``_tree_shapes.churn_keys``: requests drawn with
replacement from keys worth twice the capacity, five capacities' worth in all) is served
by a cache of ``TREE_TOKENS`` tokens as a scheduler does: match (the prefix is locked
while the request allocates), evict what the new tokens need beyond the free room, insert,
unlock. Every evict call is timed; the figure is the calls' total time per token they
freed (median over repetitions, RLT seeded differently in each), with the calls' p50 and
p99 and the stream's hit rate; the collector is off for the whole stream.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from _common import base_parser, write_json
from _tree_shapes import SHAPES as TREE_SHAPES
from _tree_shapes import (
    churn_columns,
    churn_keys,
    churn_row,
    churn_sample,
    eviction_row,
    prefill_summary,
)

from engine_ext.cache import RadixCache
from sim.report import markdown_table

NAME = "eviction_cost"
POLICIES = ("lru", "rlt")
# Timed on fresh trees next to them: rlt's loop as the paper writes it, page by page in Python
# (what rlt runs where the C extension is not built), the cost the compiled draw removes.
REFERENCE = "rlt_reference"
EVICT_TOKENS = (1_000, 10_000, 50_000)
TREE_TOKENS = 100_000
TARGET_RATIO = 1.5
SEED = 0

SHAPES = TREE_SHAPES  # the seeded insert sequences (benchmarks/_tree_shapes.py)


# -- building and timing ----------------------------------------------------------------------
def build(keys: Sequence[str], policy: str, capacity: int, seed: int) -> RadixCache:
    cache = RadixCache(capacity, policy, rng=random.Random(seed))
    for key in keys:
        cache.insert(key)
    return cache


def tree_stats(keys: Sequence[str]) -> dict[str, int]:
    cache = build(keys, "lru", 10 * TREE_TOKENS, SEED)
    return {
        "tokens": cache.total_tokens,
        "nodes": cache.node_count,
        "leaves": sum(1 for _ in cache.evictable_leaves()),
        "inserts": len(keys),
    }


def timed_evict(cache: RadixCache, tokens: int) -> tuple[int, int]:
    """Nanoseconds of one ``evict(tokens)`` call and the tokens it freed."""
    gc.collect()
    gc.disable()
    try:
        started = time.perf_counter_ns()
        freed = cache.evict(tokens)
        elapsed = time.perf_counter_ns() - started
    finally:
        gc.enable()
    return elapsed, freed


def measure_point(
    keys: Sequence[str], capacity: int, tokens: int, repeats: int
) -> dict[str, dict[str, list[int]]]:
    """Per policy: ns and tokens freed of each repetition, policies interleaved."""
    policies = (*POLICIES, REFERENCE)
    samples: dict[str, dict[str, list[int]]] = {p: {"ns": [], "freed": []} for p in policies}
    for rep in range(repeats):
        order = policies if rep % 2 == 0 else policies[::-1]
        for policy in order:
            cache = build(keys, policy, capacity, seed=rep)
            elapsed, freed = timed_evict(cache, tokens)
            if rep == 0:
                cache.check_invariants()  # outside the timed call: the eviction was sound
            samples[policy]["ns"].append(elapsed)
            samples[policy]["freed"].append(freed)
    return samples


def replay(keys: Sequence[str], policy: str, capacity: int, seed: int) -> dict[str, Any]:
    """Serve the churn stream ``keys`` (module docstring) with a cache of ``capacity``
    tokens: every evict call's ns, the tokens freed, and the stream's hit and prompt
    tokens."""
    cache = RadixCache(capacity, policy, rng=random.Random(seed))
    call_ns: list[int] = []
    freed = hits = 0
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for key in keys:
            match = cache.match_prefix(key)
            cache.lock(match.node)  # the scheduler holds the prefix while it allocates
            short = len(key) - match.length - cache.available_tokens
            if short > 0:
                started = clock()
                freed += cache.evict(short)
                call_ns.append(clock() - started)
            cache.insert(key)
            cache.unlock(match.node)
            hits += match.length
    finally:
        gc.enable()
    cache.check_invariants()
    return churn_sample(keys, call_ns, freed, hits)


def measure_churn(keys: Sequence[str], repeats: int) -> dict[str, list[dict[str, Any]]]:
    """Per policy, one ``replay`` per repetition, policies interleaved."""
    samples: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    for rep in range(repeats):
        for policy in POLICIES if rep % 2 == 0 else POLICIES[::-1]:
            samples[policy].append(replay(keys, policy, TREE_TOKENS, seed=rep))
    return samples


def summarize_point(
    shape: str, tokens: int, samples: dict[str, dict[str, list[int]]]
) -> dict[str, Any]:
    return eviction_row(shape, tokens, samples, TARGET_RATIO)


COLUMNS = (
    ("shape", "shape", "{}"),
    ("evict", "evict_tokens", "{:,}"),
    ("lru freed", "lru_freed_median", "{:,}"),
    ("rlt freed", "rlt_freed_median", "{:,}"),
    ("lru ms", "lru_median_ms", "{:.2f}"),
    ("rlt ms", "rlt_median_ms", "{:.2f}"),
    ("lru ns/token", "lru_ns_per_token", "{:.0f}"),
    ("rlt ns/token", "rlt_ns_per_token", "{:.0f}"),
    ("rlt/lru", "rlt_over_lru_text", "{}"),
    ("paired IQR", "paired_ratio_text", "{}"),
    (f"<= {TARGET_RATIO:g}x", "meets_target", "{}"),
    ("rlt / prefill", "rlt_prefill_share", "{:.3%}"),
    ("reference ns/token", f"{REFERENCE}_ns_per_token", "{:.0f}"),
    ("reference / prefill", f"{REFERENCE}_prefill_share", "{:.3%}"),
)
CHURN_COLUMNS = churn_columns(f"<= {TARGET_RATIO:g}x")
SHAPE_COLUMNS = (
    ("shape", "shape", "{}"),
    ("tokens", "tokens", "{:,}"),
    ("nodes", "nodes", "{:,}"),
    ("leaves", "leaves", "{:,}"),
    ("inserts", "inserts", "{:,}"),
    ("capacity", "capacity_tokens", "{:,}"),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__)
    parser.add_argument("--repeats", type=int, default=None, help="default 41 (7 with --quick)")
    parser.add_argument(
        "--churn-repeats", type=int, default=None, help="default 7 (2 with --quick)"
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (7 if args.quick else 41)
    churn_repeats = args.churn_repeats or (2 if args.quick else 7)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    if churn_repeats < 1:
        parser.error("--churn-repeats must be >= 1")
    started = time.perf_counter()
    shapes: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    churn: list[dict[str, Any]] = []
    for shape, builder in SHAPES.items():
        keys = builder(np.random.default_rng(SEED), TREE_TOKENS)
        stats = tree_stats(keys)
        capacity = stats["tokens"] + stats["tokens"] // 100  # a bit above: no eviction on build
        shapes.append({"shape": shape, **stats, "capacity_tokens": capacity})
        for tokens in EVICT_TOKENS:
            rows.append(
                summarize_point(shape, tokens, measure_point(keys, capacity, tokens, repeats))
            )
        stream = churn_keys(builder, np.random.default_rng(SEED), TREE_TOKENS)
        churn.append(churn_row(shape, measure_churn(stream, churn_repeats), TARGET_RATIO))
    wall_s = time.perf_counter() - started

    print("## Eviction cost per evicted token, rlt vs lru (one evict call on a fresh tree)\n")
    print(markdown_table(shapes, SHAPE_COLUMNS) + "\n")
    print(markdown_table(rows, COLUMNS) + "\n")
    held = sum(1 for r in rows if r["meets_target"] == "yes")
    print(
        f"rlt <= {TARGET_RATIO:g}x lru per token at {held} of {len(rows)} points; "
        f"median of {repeats} repeats per point\n"
    )
    print(
        f"## Under churn: a full {TREE_TOKENS:,}-token cache serving each shape's stream "
        "(every evict call timed)\n"
    )
    print(markdown_table(churn, CHURN_COLUMNS) + "\n")
    held = sum(1 for r in churn if r["meets_target"] == "yes")
    print(
        f"rlt <= {TARGET_RATIO:g}x lru per token freed under churn for {held} of "
        f"{len(churn)} shapes; median of {churn_repeats} streams; {wall_s:.1f} s wall"
    )
    print(prefill_summary([*rows, *churn]) + " (fresh trees and churn)")
    sys.stdout.flush()
    path = write_json(
        args.out,
        NAME,
        {
            "quick": args.quick,
            "repeats": repeats,
            "churn_repeats": churn_repeats,
            "target_ratio": TARGET_RATIO,
            "wall_s": round(wall_s, 3),
            "shapes": shapes,
            "rows": rows,
            "churn": churn,
        },
    )
    print(f"figures written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
