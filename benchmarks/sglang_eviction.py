"""Eviction cost inside SGLang: our ``rlt`` backend vs SGLang's built-in leaf-LRU.

Run with the engine virtualenv (SGLang + torch on a CPU):
``.venv-engine/bin/python benchmarks/sglang_eviction.py``.

Both policies are SGLang classes on SGLang's own tree: ``RadixCache`` with
``eviction_policy="lru"`` and ``engine_ext.sglang_rlt.RLTRadixCache``. Each repetition builds
a fresh ~100k-token tree from the same seeded inserts (match, allocate the uncached part from
the KV pool, insert, as the scheduler does), then times one ``evict(EvictParams(n))`` call
for n = 1k, 10k and 50k tokens, the garbage collector off. The time is the process's CPU
time (``time.process_time_ns``, torch on one thread): the benchmark machine is shared, and
wall time charges a long call for other processes' time slices (the JSON keeps wall medians
too). Policies alternate (the order flips every repetition); the figure is the median over
repetitions of CPU ns per token actually freed (SGLang's LRU frees whole leaves, so it may
free more than asked).

The KV pool is SGLang's real ``TokenToKVPoolAllocator`` on the CPU (``--pool sglang``): its
``free`` concatenates the freed indices onto the free list, once per call, so LRU pays one
such call per evicted leaf and RLT one per ``evict``. ``--pool noop`` swaps in an allocator
whose ``free`` does nothing, to show the tree work alone. On a GPU every ``free`` is a
device ``torch.cat``, a kernel launch: ``--device cuda`` puts the pool (and so every index
tensor in the tree) on the GPU, as a serving worker has it, and then times wall-clock ns
from a synchronized start to a synchronized end of the call (a CUDA launch returns before the
work is done; the GPU machine is not shared, so wall time is fair there).

Tree shapes (the same as ``benchmarks/eviction_cost.py``): ``gsp`` (groups of a ~1k-token
shared prefix with 8 questions of ~256 tokens), ``chat`` (multi-turn conversations under a
few system prompts, some forked), ``longdoc`` (a dozen ~8k-token documents).

The pool floor. Every eviction gives the KV indices it frees back to the pool, at least in
one ``free_segment`` call (SGLang's LRU makes one per leaf, RLT one per ``evict``). The first
``--floor-repeats`` (default 7) repetitions also time that call alone, cold, on a fresh tree of
the same seed: one ``free_segment`` of as many of the tree's KV indices as RLT freed (a
throwaway tree: only the cost counts). Where that floor alone costs more per token than LRU's
whole call (``floor/lru`` above 1x), no eviction that frees exactly what is asked meets
``rlt <= lru`` there, however its own steps are written.

Under churn (the third table). A fresh tree is the state a cache starts in, not the one it
serves in: each shape's churn stream (``_tree_shapes.churn_keys``: requests drawn with
replacement from keys worth twice the capacity, five capacities' worth in all) is served
by a cache of ``TREE_TOKENS`` tokens (its KV pool that size) as SGLang's scheduler does:
match, lock the prefix, evict the tokens the request's new part needs beyond the pool's
free room, allocate, insert, unlock. Every evict call is timed (CPU ns on a CPU pool); the
figure is their total per token freed (median over repetitions, RLT seeded differently in
each), with the calls' p50 and p99 and the stream's hit rate. RLT's trims leave short
leaves, which empty often: a fresh tree has none, so only this table times that path. The
next table serves the same streams ``--churn-batch`` (default 8) requests at a time, as
SGLang's scheduler admits a prefill batch: every request of the batch matched and locked,
one eviction for all their new tokens, then each allocated and inserted. Leaf-LRU frees
whole leaves, more than asked, which spares it calls while RLT frees what is asked; one
call per batch shares each call's fixed cost among its requests.

Tree building. Every build is timed too (CPU time of its matches, allocations and inserts):
the ``rlt`` backend marks paths and keeps its leaf registry and arena up to date on every
match and insert, and the second table compares that with SGLang's own tree per request.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import base_parser, format_ratio, ratio, write_json
from _tree_shapes import SHAPES as TREE_SHAPES
from _tree_shapes import (
    KeyBuilder,
    churn_columns,
    churn_keys,
    churn_row,
    churn_sample,
    eviction_row,
    prefill_summary,
)

from engine_ext.cache.keys import key_to_ids
from engine_ext.sglang_rlt import RLTRadixCache

NAME = "sglang_eviction"
POLICIES = ("lru", "rlt")
EVICT_TOKENS = (1_000, 10_000, 50_000)
TREE_TOKENS = 100_000
TARGET_RATIO = 1.0
SEED = 0
FLOOR_REPEATS = 7  # each costs one more tree build
CHURN_BATCH = 8  # requests a batch in the second churn table (a prefill batch's worth)

Ids = list[int]


# -- tree shapes: the reference benchmark's seeded insert sequences, as token ids ------------------
def _as_ids(builder: KeyBuilder) -> Callable[[np.random.Generator, int], list[Ids]]:
    def build_ids(gen: np.random.Generator, target: int) -> list[Ids]:
        return [key_to_ids(key) for key in builder(gen, target)]

    return build_ids


SHAPES: dict[str, Callable[[np.random.Generator, int], list[Ids]]] = {
    name: _as_ids(builder) for name, builder in TREE_SHAPES.items()
}


# -- KV pools -------------------------------------------------------------------------------------
class NoopAllocator:
    """A pool that hands out fresh indices and forgets frees: the tree's own cost alone."""

    def __init__(self, size: int, device: str = "cpu") -> None:
        self.size = size
        self.device = device
        self._next = 1

    def alloc(self, need: int) -> torch.Tensor:
        out = torch.arange(self._next, self._next + need, dtype=torch.int64, device=self.device)
        self._next += need
        return out

    def free_segment(self, values: torch.Tensor, start_pos: int = 0) -> None:
        pass

    def free(self, values: torch.Tensor) -> None:
        pass


def make_pool(kind: str, size: int, device: str = "cpu") -> Any:
    if kind == "noop":
        return NoopAllocator(size, device)
    return TokenToKVPoolAllocator(size, torch.bfloat16, device, None, need_sort=False)


# -- building and timing --------------------------------------------------------------------------
def make_cache(policy: str, capacity: int, seed: int, pool: str, device: str = "cpu") -> RadixCache:
    """An empty cache of ``policy`` over a KV pool of ``capacity`` tokens."""
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=make_pool(pool, capacity, device),
        page_size=1,
        eviction_policy="lru",
    )
    return RLTRadixCache(params, seed=seed) if policy == "rlt" else RadixCache(params)


def build(
    keys: Sequence[Ids], policy: str, capacity: int, seed: int, pool: str, device: str = "cpu"
) -> RadixCache:
    cache = make_cache(policy, capacity, seed, pool, device)
    allocator = cache.token_to_kv_pool_allocator
    for ids in keys:
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))
        fresh = allocator.alloc(len(ids) - match.device_prefix_len)
        value = torch.cat([cache.path_device_indices(match.last_device_node), fresh])
        cache.insert(InsertParams(key=RadixKey(array("q", ids)), value=value))
    return cache


def tree_stats(keys: Sequence[Ids], pool: str, device: str = "cpu") -> dict[str, int]:
    cache = build(keys, "lru", 10 * TREE_TOKENS, SEED, pool, device)
    nodes, stack = 0, list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        nodes += 1
        stack.extend(node.children.values())
    return {
        "tokens": cache.total_size(),
        "nodes": nodes,
        "leaves": len(cache.evictable_leaves),
        "inserts": len(keys),
    }


def timed(
    call: Callable[[], Any], cuda: bool = False, collect: bool = True
) -> tuple[int, int, Any]:
    """CPU ns and wall ns of ``call()``, run with the collector off (right after a
    collection, unless ``collect`` is False), and what it returned; with ``cuda`` the wall
    time runs from a synchronized start to the end of the queued work."""
    if collect:
        gc.collect()
    if cuda:
        torch.cuda.synchronize()
    enabled = gc.isenabled()
    gc.disable()
    try:
        wall, cpu = time.perf_counter_ns(), time.process_time_ns()
        out = call()
        if cuda:
            torch.cuda.synchronize()
        cpu, wall = time.process_time_ns() - cpu, time.perf_counter_ns() - wall
    finally:
        if enabled:
            gc.enable()
    return cpu, wall, out


def timed_evict(
    cache: RadixCache, tokens: int, cuda: bool = False, collect: bool = True
) -> tuple[int, int, int]:
    """CPU ns and wall ns of one ``evict(tokens)`` call, and the tokens it freed."""
    evict = cache.evict
    cpu, wall, result = timed(lambda: evict(EvictParams(num_tokens=tokens)), cuda, collect)
    return cpu, wall, int(result.num_tokens_evicted)


def timed_free(cache: RadixCache, tokens: int, cuda: bool = False) -> int:
    """The pool floor (module docstring) on a fresh tree: one ``free_segment`` of ``tokens``
    of its KV indices, taken before the timed call: CPU ns, or synchronized wall ns with
    ``cuda``."""
    indices = cache.all_values_flatten()[:tokens].clone()
    allocator = cache.token_to_kv_pool_allocator
    cpu, wall, _ = timed(lambda: allocator.free_segment(indices, start_pos=0), cuda)
    return wall if cuda else cpu


def check_sizes(cache: RadixCache, before: int, freed: int) -> None:
    """Outside the timed call: the tree lost exactly what evict reported."""
    if cache.total_size() != before - freed or cache.evictable_size() != before - freed:
        raise AssertionError(f"{type(cache).__name__}: sizes do not add up after evict")


def measure_point(
    keys: Sequence[Ids],
    capacity: int,
    tokens: int,
    repeats: int,
    pool: str,
    device: str = "cpu",
    floor_repeats: int = FLOOR_REPEATS,
) -> dict[str, dict[str, list[int]]]:
    """Samples per policy: ``ns`` is the figure (CPU ns on a CPU pool, synchronized wall
    ns on a GPU pool), ``cpu_ns`` and ``wall_ns`` both kept, and ``build_ns`` (CPU ns of
    the build before); and the pool floor's ``ns`` in the first ``floor_repeats``
    repetitions."""
    cuda = device != "cpu"
    samples = {
        p: {"ns": [], "cpu_ns": [], "wall_ns": [], "freed": [], "build_ns": []} for p in POLICIES
    }
    samples["floor"] = {"ns": [], "freed": []}
    for rep in range(repeats):
        for policy in POLICIES if rep % 2 == 0 else POLICIES[::-1]:
            started = time.process_time_ns()
            cache = build(keys, policy, capacity, seed=rep, pool=pool, device=device)
            samples[policy]["build_ns"].append(time.process_time_ns() - started)
            before = cache.total_size()
            cpu, wall, freed = timed_evict(cache, tokens, cuda)
            check_sizes(cache, before, freed)
            samples[policy]["ns"].append(wall if cuda else cpu)
            samples[policy]["cpu_ns"].append(cpu)
            samples[policy]["wall_ns"].append(wall)
            samples[policy]["freed"].append(freed)
            if policy == "rlt" and rep < floor_repeats:
                fresh = build(keys, "rlt", capacity, seed=rep, pool=pool, device=device)
                samples["floor"]["ns"].append(timed_free(fresh, freed, cuda))
                samples["floor"]["freed"].append(freed)
    return samples


def replay(
    keys: Sequence[Ids], cache: RadixCache, capacity: int, cuda: bool = False, batch: int = 1
) -> dict[str, Any]:
    """Serve the churn stream ``keys`` (module docstring) with ``cache``, whose KV pool
    holds ``capacity`` tokens, ``batch`` requests at a time: match and lock each request's
    prefix, evict once what the batch's new tokens need beyond the pool's free room (SGLang
    allocates a batch's tokens together), then allocate and insert each request (matched
    again first, as it may now reach what the batch inserted before it) and unlock. Every
    evict call's ns (CPU ns, or synchronized wall ns with ``cuda``), the tokens freed, and
    the stream's hit tokens (matched before the batch's inserts) and prompt tokens."""
    allocator = cache.token_to_kv_pool_allocator
    call_ns: list[int] = []
    freed = hits = 0

    def match(ids: Ids) -> Any:
        return cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))

    def make_room(need: int) -> None:
        nonlocal freed
        # the pool's free room: every index it handed out is in the tree
        short = need - (capacity - cache.evictable_size() - cache.protected_size())
        if short > 0:
            cpu, wall, got = timed_evict(cache, short, cuda, collect=False)
            call_ns.append(wall if cuda else cpu)
            freed += got

    for start in range(0, len(keys), batch):
        group = keys[start : start + batch]
        matches = [match(ids) for ids in group]
        for found in matches:
            cache.inc_lock_ref(found.last_device_node)  # held while the batch allocates
        hits += sum(found.device_prefix_len for found in matches)
        make_room(sum(len(i) - m.device_prefix_len for i, m in zip(group, matches, strict=True)))
        for i, ids in enumerate(group):
            found = matches[i] if i == 0 else match(ids)
            node = found.last_device_node
            if i:
                cache.inc_lock_ref(node)  # its path, perhaps longer now, while it allocates
            need = len(ids) - found.device_prefix_len
            make_room(need)  # (the batch's eviction made room for all of them)
            value = torch.cat([cache.path_device_indices(node), allocator.alloc(need)])
            cache.insert(InsertParams(key=RadixKey(array("q", ids)), value=value))
            if i:
                cache.dec_lock_ref(node)
        for found in matches:
            cache.dec_lock_ref(found.last_device_node)
    return churn_sample(keys, call_ns, freed, hits)


def measure_churn(
    keys: Sequence[Ids], repeats: int, pool: str, device: str = "cpu", batch: int = 1
) -> dict[str, list[dict[str, Any]]]:
    """Per policy, one ``replay`` per repetition, policies interleaved; the collector is off
    for each whole stream (collected before it)."""
    samples: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    for rep in range(repeats):
        for policy in POLICIES if rep % 2 == 0 else POLICIES[::-1]:
            gc.collect()
            gc.disable()
            try:
                cache = make_cache(policy, TREE_TOKENS, rep, pool, device)
                samples[policy].append(replay(keys, cache, TREE_TOKENS, device != "cpu", batch))
            finally:
                gc.enable()
    return samples


def summarize_point(
    shape: str, tokens: int, samples: dict[str, dict[str, list[int]]]
) -> dict[str, Any]:
    """The row of ``eviction_row`` (``floor`` rides along as a third policy), and the pool
    floor per token over LRU's whole call per token."""
    row = eviction_row(shape, tokens, samples, TARGET_RATIO)
    row["floor_over_lru"] = ratio(row["floor_ns_per_token"], row["lru_ns_per_token"])
    row["floor_over_lru_text"] = format_ratio(row["floor_ns_per_token"], row["lru_ns_per_token"])
    return row


def columns(device: str) -> tuple[tuple[str, str, str], ...]:
    """The rows' columns; the time is CPU time on a CPU pool, wall time on a GPU pool."""
    clock = "CPU" if device == "cpu" else "wall"
    return (
        ("shape", "shape", "{}"),
        ("evict", "evict_tokens", "{:,}"),
        ("lru freed", "lru_freed_median", "{:,}"),
        ("rlt freed", "rlt_freed_median", "{:,}"),
        (f"lru {clock} ms", "lru_median_ms", "{:.2f}"),
        (f"rlt {clock} ms", "rlt_median_ms", "{:.2f}"),
        ("lru ns/token", "lru_ns_per_token", "{:.0f}"),
        ("rlt ns/token", "rlt_ns_per_token", "{:.0f}"),
        ("rlt/lru", "rlt_over_lru_text", "{}"),
        ("paired IQR", "paired_ratio_text", "{}"),
        ("rlt <= lru", "meets_target", "{}"),
        (f"floor {clock} ms", "floor_median_ms", "{:.2f}"),
        ("floor/lru", "floor_over_lru_text", "{}"),
        ("rlt / prefill", "rlt_prefill_share", "{:.3%}"),
    )


def build_row(shape: str, inserts: int, build_ns: dict[str, list[int]]) -> dict[str, Any]:
    """Per request CPU us of the builds of one shape, per policy, and the paired ratio
    (builds of one repetition are back to back)."""
    row: dict[str, Any] = {"shape": shape, "inserts": inserts, "builds": len(build_ns["rlt"])}
    for policy in POLICIES:
        row[f"{policy}_us_per_request"] = round(
            statistics.median(build_ns[policy]) / 1e3 / inserts, 1
        )
    paired = [r / lru for r, lru in zip(build_ns["rlt"], build_ns["lru"], strict=True)]
    row["rlt_over_lru"] = round(statistics.median(paired), 3)
    row["rlt_over_lru_text"] = f"{statistics.median(paired):.2f}x"
    return row


BUILD_COLUMNS = (
    ("shape", "shape", "{}"),
    ("requests", "inserts", "{:,}"),
    ("builds", "builds", "{:,}"),
    ("lru us/request", "lru_us_per_request", "{:.0f}"),
    ("rlt us/request", "rlt_us_per_request", "{:.0f}"),
    ("rlt/lru (paired median)", "rlt_over_lru_text", "{}"),
)
CHURN_COLUMNS = churn_columns("rlt <= lru")
SHAPE_COLUMNS = (
    ("shape", "shape", "{}"),
    ("tokens", "tokens", "{:,}"),
    ("nodes", "nodes", "{:,}"),
    ("leaves", "leaves", "{:,}"),
    ("inserts", "inserts", "{:,}"),
    ("capacity", "capacity_tokens", "{:,}"),
)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    lines = [
        "| " + " | ".join(title for title, _, _ in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in columns) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__)
    parser.add_argument("--repeats", type=int, default=None, help="default 21 (5 with --quick)")
    parser.add_argument(
        "--floor-repeats",
        type=int,
        default=FLOOR_REPEATS,
        help=f"repetitions that also time the pool floor (default {FLOOR_REPEATS}; >= 1)",
    )
    parser.add_argument(
        "--churn-repeats", type=int, default=None, help="default 5 (2 with --quick)"
    )
    parser.add_argument(
        "--churn-batch",
        type=int,
        default=CHURN_BATCH,
        help=f"requests per eviction in the batched churn table (default {CHURN_BATCH}; >= 2)",
    )
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES), help="tree shapes"
    )
    parser.add_argument(
        "--pool", choices=("sglang", "noop"), default="sglang", help="KV pool (see above)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the KV pool's index tensors live: cpu (default) or cuda[:N] (a GPU machine)",
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 21)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.floor_repeats < 1:
        parser.error("--floor-repeats must be >= 1")
    churn_repeats = args.churn_repeats or (2 if args.quick else 5)
    if churn_repeats < 1:
        parser.error("--churn-repeats must be >= 1")
    if args.churn_batch < 2:
        parser.error("--churn-batch must be >= 2 (the first churn table is one request a batch)")
    device = args.device
    if device != "cpu":
        if not device.startswith("cuda"):
            parser.error(f"--device must be cpu or cuda[:N], got {device!r}")
        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA build of torch and a visible GPU")
    torch.set_num_threads(1)  # one core, like the scheduler's eviction path
    started = time.perf_counter()
    shapes: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    builds: list[dict[str, Any]] = []
    churn: list[dict[str, Any]] = []
    churn_batched: list[dict[str, Any]] = []
    for shape in args.shapes:
        keys = SHAPES[shape](np.random.default_rng(SEED), TREE_TOKENS)
        stats = tree_stats(keys, args.pool, device)
        capacity = stats["tokens"] + stats["tokens"] // 100  # a bit above: no eviction on build
        shapes.append({"shape": shape, **stats, "capacity_tokens": capacity})
        build_ns: dict[str, list[int]] = {policy: [] for policy in POLICIES}
        for tokens in EVICT_TOKENS:
            samples = measure_point(
                keys, capacity, tokens, repeats, args.pool, device, args.floor_repeats
            )
            rows.append(summarize_point(shape, tokens, samples))
            for policy in POLICIES:
                build_ns[policy].extend(samples[policy]["build_ns"])
        builds.append(build_row(shape, len(keys), build_ns))
        stream = churn_keys(TREE_SHAPES[shape], np.random.default_rng(SEED), TREE_TOKENS)
        ids = [key_to_ids(key) for key in stream]
        for batch, table in ((1, churn), (args.churn_batch, churn_batched)):
            samples_churn = measure_churn(ids, churn_repeats, args.pool, device, batch)
            table.append(churn_row(shape, samples_churn, TARGET_RATIO) | {"batch": batch})
    wall_s = time.perf_counter() - started

    version = _sglang_version()
    where = "CPU time" if device == "cpu" else f"wall time on {torch.cuda.get_device_name(device)}"
    print(
        f"## Eviction {where} inside SGLang {version}, rlt vs lru "
        f"(pool: {args.pool}, KV indices on {device})\n"
    )
    print(markdown_table(shapes, SHAPE_COLUMNS) + "\n")
    print(markdown_table(rows, columns(device)) + "\n")
    print(
        f"Under churn: a full {TREE_TOKENS:,}-token cache serving each shape's stream "
        f"(every evict call, {'CPU' if device == 'cpu' else 'wall'} time):\n"
    )
    print(markdown_table(churn, CHURN_COLUMNS) + "\n")
    print(
        f"The same streams, {args.churn_batch} requests a batch: one evict call for the "
        "batch's new tokens, as SGLang allocates a prefill batch's tokens together:\n"
    )
    print(markdown_table(churn_batched, CHURN_COLUMNS) + "\n")
    print("Tree building, CPU time of match + allocate + insert per request:\n")
    print(markdown_table(builds, BUILD_COLUMNS) + "\n")
    held = sum(1 for r in rows if r["meets_target"] == "yes")
    beyond = sum(1 for r in rows if (r["floor_over_lru"] or 0) > TARGET_RATIO)
    print(
        f"rlt <= lru per evicted token at {held} of {len(rows)} points; "
        f"median of {repeats} repeats per point; {wall_s:.1f} s wall\n"
        f"the pool floor alone costs more per token than lru at {beyond} of {len(rows)} "
        f"points (median of {min(repeats, args.floor_repeats)} repeats)\n"
        f"under churn, rlt <= lru per token freed for "
        f"{sum(1 for r in churn if r['meets_target'] == 'yes')} of {len(churn)} shapes, "
        f"{sum(1 for r in churn_batched if r['meets_target'] == 'yes')} of "
        f"{len(churn_batched)} with {args.churn_batch} requests a batch "
        f"(median of {churn_repeats} streams)"
    )
    print(prefill_summary([*rows, *churn, *churn_batched]) + " (fresh trees and churn)")
    sys.stdout.flush()
    path = write_json(
        args.out,
        NAME,
        {
            "quick": args.quick,
            "repeats": repeats,
            "pool": args.pool,
            "device": device,
            "device_name": "cpu" if device == "cpu" else torch.cuda.get_device_name(device),
            "clock": "process CPU time" if device == "cpu" else "synchronized wall time",
            "sglang_version": _sglang_version(),
            "torch_version": torch.__version__,
            "target_ratio": TARGET_RATIO,
            "floor_repeats": min(repeats, args.floor_repeats),
            "builds": builds,
            "churn_repeats": churn_repeats,
            "churn": churn,
            "churn_batch": args.churn_batch,
            "churn_batched": churn_batched,
            "wall_s": round(wall_s, 3),
            "shapes": shapes,
            "rows": rows,
        },
    )
    print(f"figures written to {path}", file=sys.stderr)
    return 0


def _sglang_version() -> str:
    import sglang

    return str(sglang.__version__)


if __name__ == "__main__":
    sys.exit(main())
