"""Eviction cost inside SGLang: our ``rlt`` backend vs SGLang's built-in leaf-LRU (issue 6).

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

The gather floor. A small RLT eviction takes a few tokens off nearly every leaf, and each
leaf's freed KV indices live in its own ``value`` tensor, so an RLT that keeps SGLang's tree
must at least read every leaf it trims or deletes. The first ``--floor-repeats`` (default 7)
repetitions also time just that, cold, on fresh trees of the same seed: the leaves RLT's
call touched (found by their leaf positions, ``rlt_leaf_seq``, which equal builds share),
their KV indices gathered by whichever is cheaper, one ``torch.cat`` of their values or one
tail view each, and one ``free_segment``; no draw, no ordering, no bookkeeping. Where that
floor alone costs more per token than LRU's whole call (``floor/lru`` above 1x), no exact RLT
that takes the freed indices from SGLang's tree nodes meets ``rlt <= lru`` there, however
its own steps are written.
"""

from __future__ import annotations

import gc
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import base_parser, format_ratio, ratio, write_json
from _tree_shapes import SHAPES as TREE_SHAPES
from _tree_shapes import KeyBuilder, eviction_row

from engine_ext.cache.keys import key_to_ids
from engine_ext.sglang_rlt import RLTRadixCache

NAME = "sglang_eviction"
POLICIES = ("lru", "rlt")
EVICT_TOKENS = (1_000, 10_000, 50_000)
TREE_TOKENS = 100_000
TARGET_RATIO = 1.0
SEED = 0
FLOOR_REPEATS = 7  # each costs three more tree builds
FLOOR_METHODS = ("cat", "views")

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
def build(
    keys: Sequence[Ids], policy: str, capacity: int, seed: int, pool: str, device: str = "cpu"
) -> RadixCache:
    allocator = make_pool(pool, capacity, device)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=1,
        eviction_policy="lru",
    )
    cache = RLTRadixCache(params, seed=seed) if policy == "rlt" else RadixCache(params)
    for ids in keys:
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))
        fresh = allocator.alloc(len(ids) - match.device_prefix_len)
        value = torch.cat([cache.path_device_indices(match.last_device_node), fresh])
        cache.insert(InsertParams(key=RadixKey(array("q", ids)), value=value))
    return cache


def rlt_tree(
    keys: Sequence[Ids], capacity: int, seed: int, pool: str, device: str = "cpu"
) -> RLTRadixCache:
    return cast(RLTRadixCache, build(keys, "rlt", capacity, seed, pool, device))


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


def timed(call: Callable[[], Any], cuda: bool = False) -> tuple[int, int, Any]:
    """CPU ns and wall ns of ``call()``, run right after a collection with the collector
    off, and what it returned; with ``cuda`` the wall time runs from a synchronized start to
    the end of the queued work."""
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    gc.disable()
    try:
        wall, cpu = time.perf_counter_ns(), time.process_time_ns()
        out = call()
        if cuda:
            torch.cuda.synchronize()
        cpu, wall = time.process_time_ns() - cpu, time.perf_counter_ns() - wall
    finally:
        gc.enable()
    return cpu, wall, out


def timed_evict(cache: RadixCache, tokens: int, cuda: bool = False) -> tuple[int, int, int]:
    """CPU ns and wall ns of one ``evict(tokens)`` call, and the tokens it freed."""
    cpu, wall, result = timed(lambda: cache.evict(EvictParams(num_tokens=tokens)), cuda)
    return cpu, wall, int(result.num_tokens_evicted)


def leaf_sizes_by_seq(cache: RLTRadixCache) -> dict[int, int]:
    """Every node's size in tokens by its leaf position, ``rlt_leaf_seq`` (nodes that never
    were a leaf share -1). Reading ``value`` applies pending trims: not before a timed call."""
    sizes: dict[int, int] = {}
    stack = list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        sizes[node.rlt_leaf_seq] = int(node.value.shape[0])
        stack.extend(node.children.values())
    return sizes


def touched(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    """Leaf positions an evict trimmed or deleted, with the tokens each keeps, from
    ``leaf_sizes_by_seq`` before (on an equal tree) and after it."""
    return {
        seq: after.get(seq, 0)
        for seq, size in before.items()
        if seq >= 0 and after.get(seq, 0) < size
    }


def timed_gather(
    cache: RLTRadixCache, keeps: dict[int, int], tokens: int, method: str, cuda: bool = False
) -> int:
    """The gather floor (module docstring) with one ``method`` on a fresh tree, for the
    unlocked leaves at the positions ``keeps`` names (``touched``): CPU ns, or synchronized
    wall ns with ``cuda``. Finding them reads each leaf's position, not its value.
    ``views`` frees exactly the tails RLT freed; ``cat`` frees as many indices, the first of
    the concatenation (a throwaway tree: only the cost counts)."""
    leaves = [leaf for leaf in cache.evictable_leaves if leaf.rlt_leaf_seq in keeps]
    kept = [keeps[leaf.rlt_leaf_seq] for leaf in leaves]
    allocator = cache.token_to_kv_pool_allocator

    def gather() -> None:
        if method == "cat":
            indices = torch.cat([leaf.value for leaf in leaves])[:tokens]
        else:
            indices = torch.cat([leaf.value[k:] for leaf, k in zip(leaves, kept, strict=True)])
        allocator.free_segment(indices, start_pos=0)

    cpu, wall, _ = timed(gather, cuda)
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
    ns on a GPU pool), ``cpu_ns`` and ``wall_ns`` both kept; and the gather floor's ``ns``
    in the first ``floor_repeats`` repetitions."""
    cuda = device != "cpu"
    samples = {p: {"ns": [], "cpu_ns": [], "wall_ns": [], "freed": []} for p in POLICIES}
    samples["floor"] = {"ns": [], "freed": []}
    for rep in range(repeats):
        for policy in POLICIES if rep % 2 == 0 else POLICIES[::-1]:
            cache = build(keys, policy, capacity, seed=rep, pool=pool, device=device)
            before = cache.total_size()
            cpu, wall, freed = timed_evict(cache, tokens, cuda)
            check_sizes(cache, before, freed)
            samples[policy]["ns"].append(wall if cuda else cpu)
            samples[policy]["cpu_ns"].append(cpu)
            samples[policy]["wall_ns"].append(wall)
            samples[policy]["freed"].append(freed)
            if policy == "rlt" and rep < floor_repeats:
                keeps = touched(
                    leaf_sizes_by_seq(rlt_tree(keys, capacity, rep, pool, device)),
                    leaf_sizes_by_seq(cast(RLTRadixCache, cache)),
                )
                floor = min(
                    timed_gather(rlt_tree(keys, capacity, rep, pool, device), keeps, freed, m, cuda)
                    for m in FLOOR_METHODS
                )
                samples["floor"]["ns"].append(floor)
                samples["floor"]["freed"].append(freed)
    return samples


def summarize_point(
    shape: str, tokens: int, samples: dict[str, dict[str, list[int]]]
) -> dict[str, Any]:
    """The row of ``eviction_row`` (``floor`` rides along as a third policy), and the gather
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
    )


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
        help=f"repetitions that also time the gather floor (default {FLOOR_REPEATS}; >= 1)",
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
    for shape in args.shapes:
        keys = SHAPES[shape](np.random.default_rng(SEED), TREE_TOKENS)
        stats = tree_stats(keys, args.pool, device)
        capacity = stats["tokens"] + stats["tokens"] // 100  # a bit above: no eviction on build
        shapes.append({"shape": shape, **stats, "capacity_tokens": capacity})
        for tokens in EVICT_TOKENS:
            samples = measure_point(
                keys, capacity, tokens, repeats, args.pool, device, args.floor_repeats
            )
            rows.append(summarize_point(shape, tokens, samples))
    wall_s = time.perf_counter() - started

    version = _sglang_version()
    where = "CPU time" if device == "cpu" else f"wall time on {torch.cuda.get_device_name(device)}"
    print(
        f"## Eviction {where} inside SGLang {version}, rlt vs lru "
        f"(pool: {args.pool}, KV indices on {device})\n"
    )
    print(markdown_table(shapes, SHAPE_COLUMNS) + "\n")
    print(markdown_table(rows, columns(device)) + "\n")
    held = sum(1 for r in rows if r["meets_target"] == "yes")
    beyond = sum(1 for r in rows if (r["floor_over_lru"] or 0) > TARGET_RATIO)
    print(
        f"rlt <= lru per evicted token at {held} of {len(rows)} points; "
        f"median of {repeats} repeats per point; {wall_s:.1f} s wall\n"
        f"the gather floor alone costs more per token than lru at {beyond} of {len(rows)} "
        f"points (median of {min(repeats, args.floor_repeats)} repeats)"
    )
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
            "floor_methods": list(FLOOR_METHODS),
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
