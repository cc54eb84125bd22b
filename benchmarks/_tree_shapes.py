"""Seeded tree shapes for the eviction-cost benchmarks (reference cache and SGLang), and the
summary rows both benchmarks print, with each policy's cost per token as a share of the
prefill it makes room for (``prefill_share``).

Each builder returns the insert sequence of a ~``target``-token radix tree, as token keys
(``sim.tokens``: one character per token id); ``engine_ext.cache.keys.key_to_ids`` turns a key
into token ids for SGLang. Only numpy and the key helpers are imported, so the SGLang engine
virtualenv (no River) can use it too.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence, Sized
from typing import Any

import numpy as np
from _common import format_ratio, ratio

from sim.profiles import get_profile
from sim.tokens import random_tokens

__all__ = [
    "CHURN_FACTOR",
    "CHURN_POOL",
    "SHAPES",
    "KeyBuilder",
    "chat_keys",
    "churn_columns",
    "churn_keys",
    "churn_row",
    "churn_sample",
    "eviction_row",
    "gsp_keys",
    "longdoc_keys",
    "prefill_share",
    "prefill_summary",
]

KeyBuilder = Callable[[np.random.Generator, int], list[str]]


def gsp_keys(gen: np.random.Generator, target: int) -> list[str]:
    """Groups of ~1k-token shared prefixes with 8 questions of ~256 tokens, shuffled."""
    keys: list[str] = []
    tokens = 0
    while tokens < target:
        prefix = random_tokens(gen, int(gen.integers(896, 1153)))
        tokens += len(prefix)
        for _ in range(8):
            question = random_tokens(gen, int(gen.integers(192, 321)))
            keys.append(prefix + question)
            tokens += len(question)
    return [keys[i] for i in gen.permutation(len(keys))]


def chat_keys(gen: np.random.Generator, target: int) -> list[str]:
    """Multi-turn conversations, interleaved as concurrent clients would send them.

    Every turn adds 32-64 tokens (user message plus answer) and inserts the whole history, so
    a conversation is a chain of short nodes; 30% of conversations fork from a random turn
    of an earlier one (a regenerated or edited answer), which makes branches.
    """
    systems = [random_tokens(gen, 256) for _ in range(4)]
    tokens = sum(len(s) for s in systems)
    conversations: list[list[str]] = []
    while tokens < target:
        if conversations and gen.random() < 0.3:
            base = conversations[int(gen.integers(len(conversations)))]
            history = base[int(gen.integers(len(base)))]
        else:
            history = systems[int(gen.integers(len(systems)))]
        turns: list[str] = []
        for _ in range(int(gen.integers(2, 9))):
            turn = random_tokens(gen, int(gen.integers(32, 65)))
            history += turn
            tokens += len(turn)
            turns.append(history)
        conversations.append(turns)
    owners = [i for i, turns in enumerate(conversations) for _ in turns]
    cursor = [0] * len(conversations)
    keys: list[str] = []
    for i in (owners[j] for j in gen.permutation(len(owners))):
        keys.append(conversations[i][cursor[i]])
        cursor[i] += 1
    return keys


def longdoc_keys(gen: np.random.Generator, target: int) -> list[str]:
    """A few ~8k-token documents behind one 512-token system prompt."""
    system = random_tokens(gen, 512)
    keys: list[str] = []
    tokens = len(system)
    while tokens < target:
        doc = random_tokens(gen, int(gen.integers(7680, 8705)))
        keys.append(system + doc)
        tokens += len(doc)
    return keys


SHAPES: dict[str, KeyBuilder] = {"gsp": gsp_keys, "chat": chat_keys, "longdoc": longdoc_keys}

# The yardstick of an eviction's cost: a scheduler evicts n tokens to make room for about n
# tokens it then prefills, at the reference profile's rate (sim/profiles.py). RLT's cost per
# token freed should stay within PREFILL_SHARE_TARGET of that.
PREFILL_PROFILE = "llama3.1-8b-l40"
PREFILL_SHARE_TARGET = 0.01


def prefill_share(ns_per_token: float) -> float:
    """``ns_per_token`` as a share of the reference profile's prefill time per token."""
    return ns_per_token / (get_profile(PREFILL_PROFILE).prefill_ms_per_token * 1e6)


def prefill_summary(rows: Sequence[dict[str, Any]]) -> str:
    """A line on RLT's cost per token as a share of prefill, over ``rows``."""
    held = sum(1 for r in rows if r["rlt_within_prefill_target"] == "yes")
    worst = max(r["rlt_prefill_share"] for r in rows)
    rate = get_profile(PREFILL_PROFILE).prefill_ms_per_token
    return (
        f"rlt per token freed within {PREFILL_SHARE_TARGET:.0%} of prefill ({rate} ms a token, "
        f"{PREFILL_PROFILE}) at {held} of {len(rows)}; at most {worst:.3%}"
    )


def _prefill_columns(row: dict[str, Any], policies: Iterable[str]) -> None:
    """Each policy's ns per token as a share of prefill, and whether RLT's is within the
    target."""
    for policy in policies:
        row[f"{policy}_prefill_share"] = round(prefill_share(row[f"{policy}_ns_per_token"]), 6)
    row["rlt_within_prefill_target"] = (
        "yes" if row["rlt_prefill_share"] <= PREFILL_SHARE_TARGET else "no"
    )


# The churn stream: requests drawn from a pool of keys this many times the cache's capacity,
# until they add up to CHURN_FACTOR times it.
CHURN_POOL = 2
CHURN_FACTOR = 5


def churn_keys(builder: KeyBuilder, gen: np.random.Generator, capacity: int) -> list[str]:
    """A request stream that keeps a cache of ``capacity`` tokens full and evicting: keys of
    one shape (a pool of ``CHURN_POOL`` times the capacity), drawn uniformly with
    replacement until they hold ``CHURN_FACTOR`` times the capacity. A cache that serves it
    evicts for most requests, in the state its own evictions left it in: for RLT, leaves
    trimmed short, which empty often (a fresh tree has none)."""
    pool = builder(gen, CHURN_POOL * capacity)
    keys: list[str] = []
    tokens = 0
    while tokens < CHURN_FACTOR * capacity:
        key = pool[int(gen.integers(len(pool)))]
        keys.append(key)
        tokens += len(key)
    return keys


def churn_sample(
    keys: Sequence[Sized], call_ns: list[int], freed: int, hit_tokens: int
) -> dict[str, Any]:
    """What ``churn_row`` reads of one stream served: its requests and prompt tokens (from
    ``keys``), every evict call's ns, the tokens they freed and the prompt tokens that hit."""
    return {
        "requests": len(keys),
        "call_ns": call_ns,
        "freed": freed,
        "hit_tokens": hit_tokens,
        "prompt_tokens": sum(map(len, keys)),
    }


def churn_row(
    shape: str, samples: dict[str, list[dict[str, Any]]], target_ratio: float
) -> dict[str, Any]:
    """One shape's churn row: per policy, medians over repetitions of the evict calls'
    total time per token freed, the calls and tokens freed, the stream's hit rate, and the
    calls' p50 / p99 (pooled over repetitions); ``rlt`` over ``lru`` per token freed, the
    paired ratios' quartiles, and whether it meets ``target_ratio``.

    ``samples[policy]`` has one dict per repetition: ``call_ns`` (each evict call),
    ``freed`` (tokens), ``hit_tokens`` and ``prompt_tokens`` (of the whole stream)."""
    row: dict[str, Any] = {"shape": shape, "requests": samples["lru"][0]["requests"]}
    # per repetition, the evict calls' time per token freed (None: nothing freed)
    per_token = {
        policy: [sum(r["call_ns"]) / r["freed"] if r["freed"] else None for r in runs]
        for policy, runs in samples.items()
    }
    for policy, runs in samples.items():
        calls = sorted(ns for r in runs for ns in r["call_ns"])
        row[f"{policy}_ns_per_token"] = round(
            statistics.median(x for x in per_token[policy] if x is not None), 1
        )
        row[f"{policy}_calls"] = int(statistics.median(len(r["call_ns"]) for r in runs))
        row[f"{policy}_freed"] = int(statistics.median(r["freed"] for r in runs))
        row[f"{policy}_total_ms"] = round(
            statistics.median(sum(r["call_ns"]) for r in runs) / 1e6, 2
        )
        p50, p99 = _quantile(calls, 0.5) / 1e3, _quantile(calls, 0.99) / 1e3
        row[f"{policy}_call_p50_us"] = round(p50, 1)
        row[f"{policy}_call_p99_us"] = round(p99, 1)
        row[f"{policy}_calls_text"] = f"{p50:.0f} / {p99:.0f}"
        row[f"{policy}_hit_rate"] = round(
            statistics.median(r["hit_tokens"] / r["prompt_tokens"] for r in runs), 4
        )
    rlt, lru = row["rlt_ns_per_token"], row["lru_ns_per_token"]
    row["rlt_over_lru"] = ratio(rlt, lru)
    row["rlt_over_lru_text"] = format_ratio(rlt, lru)
    row["meets_target"] = "yes" if rlt <= target_ratio * lru else "no"
    _prefill_columns(row, samples)
    paired = [
        rlt_rep / lru_rep
        for rlt_rep, lru_rep in zip(per_token["rlt"], per_token["lru"], strict=True)
        if rlt_rep is not None and lru_rep
    ]
    if len(paired) >= 2:
        low, _, high = statistics.quantiles(paired, n=4, method="inclusive")
        row["paired_ratio_text"] = f"{low:.2f}-{high:.2f}x"
    else:
        row["paired_ratio_text"] = "n/a"
    return row


def churn_columns(target: str) -> tuple[tuple[str, str, str], ...]:
    """The churn table's columns (title, ``churn_row`` key, format); ``target`` titles
    the verdict's."""
    return (
        ("shape", "shape", "{}"),
        ("requests", "requests", "{:,}"),
        ("lru hit", "lru_hit_rate", "{:.1%}"),
        ("rlt hit", "rlt_hit_rate", "{:.1%}"),
        ("lru calls", "lru_calls", "{:,}"),
        ("rlt calls", "rlt_calls", "{:,}"),
        ("lru freed", "lru_freed", "{:,}"),
        ("rlt freed", "rlt_freed", "{:,}"),
        ("lru call p50/p99 us", "lru_calls_text", "{}"),
        ("rlt call p50/p99 us", "rlt_calls_text", "{}"),
        ("lru ns/token", "lru_ns_per_token", "{:.0f}"),
        ("rlt ns/token", "rlt_ns_per_token", "{:.0f}"),
        ("rlt/lru", "rlt_over_lru_text", "{}"),
        ("paired IQR", "paired_ratio_text", "{}"),
        (target, "meets_target", "{}"),
        ("rlt / prefill", "rlt_prefill_share", "{:.3%}"),
    )


def _quantile(ordered: list[int], q: float) -> float:
    """The ``q`` quantile of a sorted, non-empty list (nearest rank)."""
    if not ordered:
        return 0.0
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def eviction_row(
    shape: str,
    tokens: int,
    samples: dict[str, dict[str, list[int]]],
    target_ratio: float,
) -> dict[str, Any]:
    """One (shape, evict size) row: per policy the median ns per freed token, the median call
    time, tokens freed; ``rlt`` over ``lru`` and whether it meets ``target_ratio``, and the
    quartiles of the per-repetition (paired) ratios.

    ``samples[policy]`` holds ``ns`` (timed calls) and ``freed`` per repetition, and
    optionally ``wall_ns`` (wall time, when ``ns`` is CPU time).
    """
    row: dict[str, Any] = {"shape": shape, "evict_tokens": tokens}
    for policy, got in samples.items():
        ns, freed = got["ns"], got["freed"]
        per_token = [n / f for n, f in zip(ns, freed, strict=True) if f]
        row[f"{policy}_ns_per_token"] = round(statistics.median(per_token), 1)
        row[f"{policy}_median_ms"] = round(statistics.median(ns) / 1e6, 3)
        row[f"{policy}_freed_median"] = int(statistics.median(freed))
        row[f"{policy}_freed_min"] = min(freed)
        row[f"{policy}_freed_max"] = max(freed)
        if got.get("wall_ns"):
            row[f"{policy}_wall_median_ms"] = round(statistics.median(got["wall_ns"]) / 1e6, 3)
        row[f"{policy}_samples_ns"] = ns
    rlt, lru = row["rlt_ns_per_token"], row["lru_ns_per_token"]
    row["rlt_over_lru"] = ratio(rlt, lru)
    row["rlt_over_lru_text"] = format_ratio(rlt, lru)
    row["meets_target"] = "yes" if rlt <= target_ratio * lru else "no"
    _prefill_columns(row, samples)
    # The spread: repetition i times both policies on trees of one seed, back to back, so
    # its ratio is one paired measurement; their quartiles show how firm the verdict is.
    paired = [
        (r_ns / r_freed) / (l_ns / l_freed)
        for r_ns, r_freed, l_ns, l_freed in zip(
            samples["rlt"]["ns"],
            samples["rlt"]["freed"],
            samples["lru"]["ns"],
            samples["lru"]["freed"],
            strict=True,
        )
        if r_freed and l_freed and l_ns
    ]
    if len(paired) >= 2:
        # "inclusive": quartiles within the samples' range (the default extrapolates past
        # it for a few samples, even below zero)
        low, _, high = statistics.quantiles(paired, n=4, method="inclusive")
        row["paired_ratio_quartiles"] = [round(low, 3), round(high, 3)]
        row["paired_ratio_text"] = f"{low:.2f}-{high:.2f}x"
    else:
        row["paired_ratio_quartiles"] = None
        row["paired_ratio_text"] = "n/a"
    return row
