"""RLT eviction inside SGLang 0.5.x: the radix cache behind ``--radix-cache-backend rlt``.

``RLTRadixCache`` subclasses SGLang's classic ``RadixCache`` and keeps everything of it
(tree, ``RadixKey`` matching, page alignment, locking, KV-pool freeing, KV events, metrics)
except the eviction order. The RLT algorithm itself is not written again here: the reference
cache's ``RLTEviction`` (marking phases, the phase rules of ``evict``, the draw on a leaf
registry) runs unchanged on SGLang's tree through ``_SGLangTree``, a small view that
offers what it reads and calls. What is SGLang-specific lives in this module:

- marking: every insert (``_insert_helper``) marks its path, and every match
  (``_match_prefix_helper``, so also ``touch_prefix``) does what the reference cache's
  ``marking`` says: marks its path (``"path"``, the default) or only the node it splits off
  (``"split"``, the paper's rule; ``--radix-eviction-policy-config {"marking": "split"}``);
  nodes carry ``mark_phase`` as the reference nodes do, and a split copies it to the new
  upper node;
- the leaf registry: the reference cache's ``LeafRegistry`` (``leaf_registry``), kept up to
  date by the tree hooks (a new leaf joins, a leaf that gets a child or is deleted leaves,
  ``inc_lock_ref`` / ``dec_lock_ref`` record locks), so candidates, sizes and trims are
  numpy arrays, in the order nodes became leaves: the reference cache's order, which makes
  a seeded run reproducible and equal to the reference (``tests/engine_sglang``);
- the arena: every node's KV indices live in one tensor and a node's ``value`` is a view of
  it (``_place`` on insert, ``_split_node`` re-points both halves); the registry holds each
  leaf's offset. The KV indices an eviction frees are then runs of the arena: on a CPU
  arena copied into a staging array by the compiled loop that cuts them
  (``kernels.trim_gather``), on a GPU gathered by torch at the end (one index, or a few
  slices), and given back in one ``free_segment`` call, without touching the freed
  leaves' tensors.
  SGLang only ever copies a value out (``torch.cat`` of a path) or drops it, so views are
  safe; the arena is repacked when it fills (``_pack_arena``);
- trimming: ``evict(n)`` drops whole pages from leaf tails. Emptied leaves go through
  SGLang's own ``_delete_leaf`` and ``kv_events.record_remove``; a trimmed leaf's ``key``,
  ``value`` and hash lists are cut when SGLang next reads one of them (deferred trims).

Deferred trims. A small eviction spreads over nearly every leaf (1k tokens from a tree of
~260 leaves: ~4 tokens each), and cutting a leaf costs a ``RadixKey`` and a tensor view, a
few microseconds of Python and torch dispatch each, while SGLang's LRU drops ~4 whole
leaves. So a trim only lowers the leaf's size in the registry. Every registered leaf is a
``_RegisteredLeaf``, a ``TreeNode`` subclass whose ``key``, ``value``, ``hash_value`` and
``event_hash_value`` are properties: a read or write of any of them first compares the
registry's size with the stored length (only if an eviction trimmed leaves since the leaf
was last read: ``_Leaves.epoch``) and cuts all four if it is shorter. Every SGLang code path
reads nodes through those attributes (matching reads ``child.key``, locking
``len(node.key)``, ``total_size`` every ``value``), so none can see the untrimmed state;
most trimmed leaves are trimmed again or deleted before anything reads them. A leaf leaves
the registry as a plain ``TreeNode`` again.

This is the only module of kvroute that imports SGLang or torch (the ``engine`` extra).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import sglang
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode
from sglang.srt.mem_cache.utils import compute_node_event_hash_values, compute_node_hash_values

from engine_ext.cache import MARKINGS, kernels
from engine_ext.cache.leaf_registry import LOCKED, LeafRegistry
from engine_ext.cache.rlt import RLTEviction

if TYPE_CHECKING:
    from engine_ext.cache.radix import RadixCache as ReferenceRadixCache

__all__ = [
    "SEED_ENV_VAR",
    "SUPPORTED_SGLANG_SERIES",
    "RLTRadixCache",
    "build_rlt_radix_cache",
    "check_sglang_version",
]

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG_SERIES = "0.5"
SEED_ENV_VAR = "KVROUTE_RLT_SEED"
# Keys of --radix-eviction-policy-config that this backend reads (SGLang's own knob for
# eviction tuning); any other key is refused rather than silently ignored.
CONFIG_KEYS = ("seed", "log_every", "marking")
_DEFAULT_LOG_EVERY = 1000
_MIN_ARENA = 2048  # tokens: the arena holds at least twice this (``_pack_arena``)
# On a GPU arena (torch): up to this many runs to free, a slice each; more, one index.
_FEW_RUNS = 16
# Copy freed KV indices out of a CPU arena's numpy view as they are cut (``_stage_tails``,
# ``_queue_runs``); tests turn it off to run the torch path that a GPU arena takes.
_NUMPY_GATHER = True


def _cut_key(key: RadixKey, keep: int) -> RadixKey:
    """``key[:keep]``: what ``RadixKey.__getitem__`` builds for it, without its checks."""
    if key.is_bigram:
        return key[:keep]
    return RadixKey(key.token_ids[:keep], key.extra_key, cache_salt=key.cache_salt)


def _cut(state: dict[str, Any], keep: int, page: int) -> None:
    """Cut a node's stored ``key``, ``value`` and hash lists to ``keep`` tokens."""
    state["key"] = _cut_key(state["key"], keep)
    state["value"] = state["value"][:keep]  # a view of the arena
    for name in ("hash_value", "event_hash_value"):
        if state[name] is not None:
            state[name] = state[name][: keep // page]
    state["rlt_len"] = keep


def _current(node: Any) -> dict[str, Any]:
    """A registered leaf's attributes, cut first to its size in the registry if evictions
    trimmed it since they were last read (deferred trims)."""
    state: dict[str, Any] = node.__dict__
    leaves = state["rlt_leaves"]
    if state["rlt_epoch"] != leaves.epoch:
        state["rlt_epoch"] = leaves.epoch
        size = int(leaves.size[state["slot"]])
        if size != state["rlt_len"]:
            _cut(state, size, leaves.page_size)
    return state


def _deferred(name: str) -> property:
    def read(node: Any) -> Any:
        return _current(node)[name]

    def write(node: Any, value: Any) -> None:
        _current(node)[name] = value

    return property(read, write, doc=f"``{name}``, cut to the leaf's size in the registry")


class _RegisteredLeaf(TreeNode):
    """A leaf in the registry (the module docstring): its ``key``, ``value`` and hash lists
    are cut to the size the registry holds for it when SGLang reads or writes one of them.
    Never constructed: registering a leaf assigns ``__class__``, unregistering it (it got a
    child, or was deleted) turns it back into a plain ``TreeNode``."""

    key = _deferred("key")
    value = _deferred("value")
    hash_value = _deferred("hash_value")
    event_hash_value = _deferred("event_hash_value")

    @property
    def evicted(self) -> bool:
        """SGLang's ``value is None``, without applying a pending cut (a cut never makes a
        value None): deleting a leaf asks it of every sibling (``_update_leaf_status``)."""
        return self.__dict__["value"] is None


class _Leaves(LeafRegistry):
    """The reference cache's leaf registry (order, sizes, marks and locks as arrays) plus
    where each leaf's KV indices start in the arena (``off``), and ``epoch``, which counts
    the evictions that trimmed leaves (a leaf read at the current epoch needs no cut)."""

    ARRAYS = (*LeafRegistry.ARRAYS, ("off", 0))
    off: np.ndarray

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        super().__init__()

    def clear(self) -> None:
        super().clear()
        self.epoch = 0

    def add(self, node: Any) -> None:
        state = node.__dict__
        node.__class__ = _RegisteredLeaf
        state["rlt_leaves"] = self
        state["rlt_epoch"] = self.epoch
        super().add(node)
        self.off[node.slot] = state["rlt_off"]

    def drop(self, node: Any) -> None:
        """Unregister a leaf that got a child, cut to its size first."""
        _current(node)
        self.remove(node)
        node.__class__ = TreeNode


def _as_list(values: Any) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def _positions_on(device: torch.device, starts: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
    """The arena positions of the runs (``kernels.run_positions``), as an index on ``device``.

    To a CUDA device through pinned memory and without blocking: a copy from pageable memory
    (a plain ``.to(device)``) makes the host wait for every kernel already queued on the
    stream, so an eviction would stall the scheduler that overlaps it with the running
    batch's forward pass. The caching host allocator keeps the pinned copy until the
    transfer is done, and the index that reads it is queued after it on the same stream.
    """
    positions = torch.from_numpy(kernels.run_positions(starts, lengths))
    if device.type == "cuda":
        return positions.pin_memory().to(device, non_blocking=True)
    return positions.to(device)


def check_sglang_version(version: str) -> None:
    """Refuse SGLang releases outside 0.5.x: the subclass relies on 0.5's private helpers."""
    parts = version.split(".")
    if ".".join(parts[:2]) != SUPPORTED_SGLANG_SERIES:
        raise ValueError(
            f"kvroute's rlt radix cache supports SGLang {SUPPORTED_SGLANG_SERIES}.x "
            f"(tested with 0.5.23), found sglang {version}; install kvroute[engine] to get "
            "the pinned version, or drop --radix-cache-backend rlt"
        )


class _SGLangTree:
    """What ``RLTEviction`` reads and calls on a cache (duck-typed), served by SGLang's tree,
    the plugin's leaf registry and its arena. Trims and deletions queue the runs of arena
    positions they free; ``RLTRadixCache.evict`` frees them all at once."""

    __slots__ = ("cache", "capacity_tokens", "leaves", "marking", "page_size", "runs")

    def __init__(
        self, cache: RLTRadixCache, capacity_tokens: int, page_size: int, marking: str
    ) -> None:
        self.cache = cache
        self.capacity_tokens = capacity_tokens
        self.page_size = page_size
        self.marking = marking
        self.leaves = _Leaves(page_size)
        # Arena runs to free: (starts, lengths, their sum), arrays or lists; on a
        # CPU arena none (they are copied out at once: RLTRadixCache._queue_runs).
        self.runs: list[tuple[Any, Any, int]] = []

    @property
    def root(self) -> Any:
        return self.cache.root_node

    @property
    def total_tokens(self) -> int:
        return int(self.cache.evictable_size_ + self.cache.protected_size_)

    def cut_tails(self, slots: np.ndarray, pages: np.ndarray, k: int) -> int:
        """Cut ``pages[i]`` pages (fewer than the leaf holds; 0 allowed) off the leaf in
        ``slots[i]``, ``i < k``: the registry's sizes only (``kernels.trim``, which also
        gives the runs of arena positions cut); each leaf's attributes are cut when SGLang
        next reads them."""
        leaves, cache, page = self.leaves, self.cache, self.page_size
        if cache.kv_events.enabled:
            cache._record_tails_removed(slots[:k].tolist(), (pages[:k] * page).tolist())
        if cache._arena_np is not None:  # a CPU arena: the cut KV indices are copied out now
            cut = cache._stage_tails(slots, pages, k)
        else:
            starts, lengths = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.int64)
            cut = kernels.trim(leaves.size, slots, pages, k, page, leaves.off, starts, lengths)
            self.runs.append((starts, lengths, cut))
        leaves.epoch += 1
        cache.evictable_size_ -= cut
        return cut

    def trim_leaf(self, node: Any, num_tokens: int) -> int:
        """Drop ``num_tokens`` (whole pages) from a registered, unlocked leaf's tail, all of
        it if it holds no more."""
        leaves, cache, slot = self.leaves, self.cache, node.slot
        size = int(leaves.size[slot])
        if num_tokens >= size:
            return self.delete_emptied([node])
        if num_tokens <= 0:
            return 0
        if cache.kv_events.enabled:
            cache._record_tail_removed(node, size - num_tokens)
        leaves.size[slot] = size - num_tokens
        leaves.epoch += 1
        cache._queue_runs([int(leaves.off[slot]) + size - num_tokens], [num_tokens], num_tokens)
        cache.evictable_size_ -= num_tokens
        return num_tokens

    def delete_emptied(self, nodes: Sequence[Any]) -> int:
        return self.cache._delete_emptied(nodes)


class RLTRadixCache(RadixCache):
    """SGLang's classic radix cache with RLT eviction (marking phases, random leaf tails).

    ``capacity_tokens`` is the RLT capacity C (default: the KV pool's size, as the paper's
    SGLang fork uses); ``seed`` seeds the sampler through the same path as the reference
    cache (``random.Random(seed)`` -> ``RLTEviction``), so equal seeds give equal draws;
    ``marking`` is what a match marks, as the reference cache's (``MARKINGS``).
    """

    def __init__(
        self,
        params: CacheInitParams,
        *,
        capacity_tokens: int | None = None,
        seed: int = 0,
        log_every: int = _DEFAULT_LOG_EVERY,
        marking: str = "path",
    ) -> None:
        check_sglang_version(sglang.__version__)
        if marking not in MARKINGS:
            raise ValueError(f"unknown marking {marking!r}; known: {', '.join(MARKINGS)}")
        if params.eviction_policy_config:
            raise ValueError(
                "RLTRadixCache takes no eviction-policy config; pass seed= directly or use "
                "build_rlt_radix_cache, which reads --radix-eviction-policy-config"
            )
        if capacity_tokens is None:
            allocator = params.token_to_kv_pool_allocator
            if allocator is None or not getattr(allocator, "size", None):
                raise ValueError(
                    "RLTRadixCache needs capacity_tokens or a KV pool allocator with a size"
                )
            capacity_tokens = int(allocator.size)
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.seed = seed
        self.log_every = log_every
        self.eviction_calls = 0
        self.evicted_tokens_total = 0
        self._tree = _SGLangTree(self, capacity_tokens, params.page_size, marking)
        self._split_in_match = False  # set by _split_node: the match being walked split
        self._leaves = self._tree.leaves
        self._arena: torch.Tensor | None = None  # every node's KV indices (module docstring)
        self._arena_np: np.ndarray | None = None  # the same memory, on a CPU arena
        self._arena_top = 0
        # On a CPU arena, the KV indices to free are copied here as they are cut, and the
        # first ``_staged`` of them given to the pool in one call (``_free_queued``).
        self._staging: np.ndarray | None = None
        self._staged = 0
        # RLTEviction only reads what _SGLangTree offers; see the module docstring.
        self.rlt = RLTEviction(cast("ReferenceRadixCache", self._tree), random.Random(seed))
        super().__init__(params)
        if not self.disable:
            logger.info(
                "kvroute RLT radix cache active: capacity %d tokens, page size %d, seed %d, "
                "eviction loops %s",
                capacity_tokens,
                self.page_size,
                seed,
                "compiled"
                if kernels.COMPILED
                else "in Python, page by page (kvroute was built without a C "
                "compiler: evictions cost more CPU; reinstall where one is)",
            )

    @property
    def capacity_tokens(self) -> int:
        return self._tree.capacity_tokens

    @property
    def phases_started(self) -> int:
        return self.rlt.phases_started

    @property
    def marking(self) -> str:
        return self._tree.marking

    @property
    def marked_tokens(self) -> int:
        return self.rlt.marked_tokens

    def is_marked(self, node: Any) -> bool:
        return bool(self.rlt.is_marked(node))

    # -- tree hooks: marks, the leaf registry, the arena ------------------------------------
    def reset(self) -> None:
        leaves = self._leaves
        for node in leaves:  # detached from now on: plain nodes, cut to their sizes
            _current(node)
            node.__class__ = TreeNode
            node.slot = -1
        super().reset()
        root = self.root_node.__dict__
        root["mark_phase"] = -1
        root["slot"] = -1
        leaves.clear()
        self._tree.runs = []  # (empty unless an evict stopped between its draw and its free)
        self._staging = None
        self._staged = 0
        self._arena = None
        self._arena_np = None
        self._arena_top = 0
        self.rlt.reset()

    def _path(self, node: Any) -> list[Any]:
        """``node``'s path, root excluded, root-to-leaf (the reference cache's order)."""
        root = self.root_node
        path = []
        while node is not root:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _mark_path(self, node: Any) -> None:
        path = self._path(node)
        if path:
            self.rlt.on_access(path)

    def _match_prefix_helper(self, node: Any, key: RadixKey) -> tuple[list[Any], Any]:
        self._split_in_match = False
        value, last_node = super()._match_prefix_helper(node, key)
        path = self._path(last_node)
        if path:  # SGLang's match splits at most once: its last node
            self.rlt.on_match(path, self._split_in_match)
        return value, last_node

    def _insert_helper(
        self, node: Any, key: RadixKey, value: Any, priority: int = 0, inserted_len: int = 0
    ) -> tuple[int, Any]:
        arena = self._arena
        if arena is not None and (value.dtype != arena.dtype or value.device != arena.device):
            raise RuntimeError(  # refused before the tree changes
                f"KV indices of {value.dtype} on {value.device} in a tree of {arena.dtype} on "
                f"{arena.device}: every value must come from the one KV pool allocator"
            )
        prefix_len, last_node = super()._insert_helper(node, key, value, priority, inserted_len)
        if prefix_len < len(key):  # the helper created ``last_node`` as a new leaf
            state = last_node.__dict__
            state["mark_phase"] = -1
            state["slot"] = -1
            self._place(last_node)
            parent = last_node.parent
            if parent.__dict__["slot"] >= 0:  # it was a leaf until now
                self._leaves.drop(parent)
            self._leaves.add(last_node)
        self._mark_path(last_node)
        return prefix_len, last_node

    def _split_node(self, key: RadixKey, child: Any, split_len: int) -> Any:
        below = child.__dict__
        slot = below["slot"]
        if slot >= 0:
            _current(child)
        start, length = below["rlt_off"], below["rlt_len"]
        upper = super()._split_node(key, child, split_len)
        self._split_in_match = True  # (inserts split too; only a match reads it)
        # SGLang cloned both halves; point them back at the arena instead.
        arena = self._arena
        assert arena is not None
        above = upper.__dict__
        above["value"] = arena[start : start + split_len]
        above["rlt_off"], above["rlt_len"] = start, split_len
        above["mark_phase"] = below["mark_phase"]  # the lower part keeps its leaf slot
        above["slot"] = -1
        below["value"] = arena[start + split_len : start + length]
        below["rlt_off"], below["rlt_len"] = start + split_len, length - split_len
        if slot >= 0:
            self._leaves.off[slot] = start + split_len
            self._leaves.size[slot] = length - split_len
        return upper

    def inc_lock_ref(self, node: Any) -> Any:
        result = super().inc_lock_ref(node)
        self._lock_changed(node)
        return result

    def dec_lock_ref(self, node: Any, params: Any = None) -> Any:
        result = super().dec_lock_ref(node, params)
        self._lock_changed(node)
        return result

    def _lock_changed(self, node: Any) -> None:
        """A lock on the path from ``node`` was taken or released: of that path only
        ``node`` can be a leaf, and a locked leaf is no candidate."""
        slot = node.__dict__.get("slot", -1)
        if slot >= 0:
            self._leaves.mark[slot] = LOCKED if node.lock_ref else node.mark_phase

    def _place(self, node: Any) -> None:
        """Copy a new node's KV indices into the arena; its ``value`` becomes a view."""
        state = node.__dict__
        value = state["value"]
        n = int(value.shape[0])
        arena = self._arena
        if arena is None or self._arena_top + n > arena.shape[0]:
            arena = self._pack_arena(n, value, node)
        top = self._arena_top
        view = arena[top : top + n]
        view.copy_(value)
        state["value"] = view
        state["rlt_off"], state["rlt_len"] = top, n
        self._arena_top = top + n

    def _pack_arena(self, room: int, like: torch.Tensor, new: Any) -> torch.Tensor:
        """A new arena with the tree's KV indices (but ``new``'s, not placed yet) packed at
        its start; every node is pointed at it, and the old one goes with its last view.

        It holds twice the KV pool (or twice what the tree holds plus ``room``, if more):
        the tree never holds more than the pool, so a pack comes at most once per pool's
        worth of tokens inserted, and costs one pass over the nodes and one copy."""
        nodes: list[Any] = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is new:
                continue
            if node.__dict__["slot"] >= 0:
                _current(node)
            nodes.append(node)
        starts = np.array([node.__dict__["rlt_off"] for node in nodes], dtype=np.int64)
        lengths = np.array([node.__dict__["rlt_len"] for node in nodes], dtype=np.int64)
        live = int(lengths.sum())
        pool = getattr(self.token_to_kv_pool_allocator, "size", None) or self.capacity_tokens
        size = 2 * max(int(pool), live + room, _MIN_ARENA)
        arena = torch.empty(size, dtype=like.dtype, device=like.device)
        if live:
            old = self._arena
            assert old is not None
            arena[:live] = old.index_select(0, _positions_on(old.device, starts, lengths))
        off = self._leaves.off
        top = 0
        for node, length in zip(nodes, lengths.tolist(), strict=True):
            state = node.__dict__
            state["value"] = arena[top : top + length]
            state["rlt_off"] = top
            if state["slot"] >= 0:
                off[state["slot"]] = top
            top += length
        self._arena = arena
        self._arena_np = arena.numpy() if _NUMPY_GATHER and arena.device.type == "cpu" else None
        self._arena_top = live
        if self._arena_np is not None:  # room for a pool's worth, its pages touched now,
            self._staging_room(size // 2)[self._staged :].fill(0)  # not inside an eviction
        return arena

    # -- eviction ------------------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        start_time = time.perf_counter()
        self.rlt.evict(params.num_tokens)
        freed = self._free_queued()
        self.update_eviction_metrics(freed, start_time)
        self.eviction_calls += 1
        self.evicted_tokens_total += freed
        if self.eviction_calls % self.log_every == 0:
            logger.info(
                "kvroute RLT: %d evict calls, %d tokens evicted, %d phases, %d marked tokens",
                self.eviction_calls,
                self.evicted_tokens_total,
                self.rlt.phases_started,
                self.rlt.marked_tokens,
            )
        return EvictResult(num_tokens_evicted=freed)

    def _free_queued(self) -> int:
        """Free the KV indices the eviction cut, in one ``free_segment`` call (SGLang's LRU
        makes one per leaf). On a CPU arena they are already copied out, in the staging
        array (``_stage_tails``, ``_queue_runs``); else they are runs of the arena: a slice
        per run for a few runs, else one index over all of them (torch, on the arena's
        device)."""
        staged, self._staged = self._staged, 0
        if staged:
            assert self._staging is not None
            assert not self._tree.runs
            # A view of the staging array, which the next eviction overwrites: SGLang's
            # allocators copy what they keep ("callers may overwrite req_to_token views",
            # ``_copy_for_free_group``), as its own callers free views of reused buffers.
            view = torch.from_numpy(self._staging[:staged])
            self.token_to_kv_pool_allocator.free_segment(view, start_pos=0)
            return staged
        runs, self._tree.runs = self._tree.runs, []
        freed = sum(total for _, _, total in runs)
        if not freed:
            return 0
        arena = self._arena
        assert arena is not None
        indices: Any
        if sum(len(lengths) for _, lengths, _ in runs) <= _FEW_RUNS:
            pieces = [
                arena[start : start + length]
                for starts, lengths, _ in runs
                for start, length in zip(_as_list(starts), _as_list(lengths), strict=True)
                if length
            ]
            indices = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        else:
            starts = np.concatenate([np.asarray(run[0], dtype=np.int64) for run in runs])
            lengths = np.concatenate([np.asarray(run[1], dtype=np.int64) for run in runs])
            indices = arena.index_select(0, _positions_on(arena.device, starts, lengths))
        # Tree values are page-aligned copies of KV rows and every run is whole pages, so
        # the freed indices form a page-exact segment, as SGLang's LRU frees a leaf.
        self.token_to_kv_pool_allocator.free_segment(indices, start_pos=0)
        return freed

    def _stage_tails(self, slots: np.ndarray, pages: np.ndarray, k: int) -> int:
        """On a CPU arena: ``kernels.trim``'s cuts, with the KV indices they free copied
        into the staging array in the same compiled loop (``kernels.trim_gather``)."""
        leaves, mirror = self._leaves, self._arena_np
        assert mirror is not None
        staging = self._staging_room(self.evictable_size_)  # no cut frees more than that
        at = self._staged
        cut = kernels.trim_gather(
            leaves.size, slots, pages, k, self.page_size, leaves.off, mirror, staging, at
        )
        self._staged = at + cut
        return cut

    def _queue_runs(self, starts: Any, lengths: Any, total: int) -> None:
        """Queue arena runs to free (arrays or lists): on a CPU arena, copied
        into the staging array now (``kernels.gather``); else kept for ``_free_queued``."""
        mirror = self._arena_np
        if mirror is None:
            self._tree.runs.append((starts, lengths, total))
            return
        if not total:
            return
        if isinstance(starts, list):
            starts = np.array(starts, dtype=np.int64)
            lengths = np.array(lengths, dtype=np.int64)
        staging, at = self._staging_room(total), self._staged
        self._staged = at + kernels.gather(mirror, starts, lengths, len(starts), staging[at:])
        assert self._staged == at + total, (self._staged, at, total)

    def _staging_room(self, more: int) -> np.ndarray:
        """The staging array, grown (keeping what is staged) to hold ``more`` after it."""
        staging, staged = self._staging, self._staged
        if staging is not None and len(staging) - staged >= more:
            return staging
        mirror = self._arena_np
        assert mirror is not None
        grown = np.empty(
            max(staged + more, 2 * (0 if staging is None else len(staging)), _MIN_ARENA),
            dtype=mirror.dtype,
        )
        if staged:
            assert staging is not None
            grown[:staged] = staging[:staged]
        self._staging = grown
        return grown

    def _delete_emptied(self, nodes: Sequence[Any]) -> int:
        """Delete RLT's emptied leaves (unlocked; children before parents) with SGLang's
        helpers, queueing their arena runs; a parent that is left childless, and is not
        deleted later in ``nodes``, joins the registry."""
        leaves, root, gone = self._leaves, self.root_node, set(nodes)
        events = self.kv_events.enabled
        registered: list[Any] = []
        starts: list[int] = []
        lengths: list[int] = []
        for node in nodes:
            state = node.__dict__
            length = state["rlt_len"]
            if state["slot"] >= 0:
                registered.append(node)
                if events:
                    length = len(_current(node)["key"])  # the event reports what is left
                else:  # no cut: nothing reads a deleted leaf's key or value again
                    length = int(leaves.size[state["slot"]])
                    # SGLang's _delete_leaf takes the stored key's length off the evictable
                    # size; the trims since it was cut are off it already (cut_tails).
                    self.evictable_size_ += state["rlt_len"] - length
                node.__class__ = TreeNode  # SGLang reads the stored attributes from here on
            starts.append(state["rlt_off"])
            lengths.append(length)
            parent = node.parent
            self._delete_leaf(node)
            self.kv_events.record_remove(node)
            if not parent.children and parent is not root and parent not in gone:
                leaves.add(parent)
        leaves.remove_many(registered)
        leaves.compact()
        total = sum(lengths)
        self._queue_runs(starts, lengths, total)
        return total

    def _record_tails_removed(self, slots: list[int], tokens: list[int]) -> None:
        """KV events for tails about to be cut (``_SGLangTree.cut_tails``)."""
        leaves = self._leaves
        for slot, taken in zip(slots, tokens, strict=True):
            if taken:
                self._record_tail_removed(leaves.nodes[slot], int(leaves.size[slot]) - taken)

    def _record_tail_removed(self, node: Any, keep: int) -> None:
        """A ``BlockRemoved`` for the pages past ``keep``, hashed as SGLang stored them."""
        page = self.page_size
        if node.hash_value is None:  # the recorder computes these lazily the same way
            node.hash_value = compute_node_hash_values(node, page)
        if node.key.extra_key is not None or node.key.cache_salt is not None:
            compute_node_event_hash_values(node, page)  # fills node.event_hash_value
        tail = TreeNode(priority=node.priority)  # a detached stand-in, never in the tree
        tail.parent = node
        tail.key = node.key[keep:]
        tail.hash_value = node.hash_value[keep // page :]
        if node.event_hash_value is not None:
            tail.event_hash_value = node.event_hash_value[keep // page :]
        self.kv_events.record_remove(tail)


# -- the registered factory ---------------------------------------------------------------
def _refusals(ctx: Any) -> list[str]:
    """What in this server's configuration the rlt backend cannot serve correctly."""
    args = ctx.server_args
    checks = [
        (ctx.disable_radix_cache, "--disable-radix-cache turns prefix caching off"),
        (ctx.is_hybrid_swa, "hybrid sliding-window (SWA) models need SGLang's SWA cache"),
        (ctx.is_hybrid_ssm, "hybrid Mamba/SSM models need SGLang's Mamba cache"),
        (getattr(ctx, "is_dsa", False), "DSA (sparse-attention) models are not verified"),
        (ctx.enable_hierarchical_cache, "--enable-hierarchical-cache (HiCache)"),
        (getattr(args, "enable_lmcache", False), "--enable-lmcache"),
        (getattr(args, "enable_flexkv", False), "--enable-flexkv"),
        (
            getattr(args, "enable_unified_cache_external_linker", False),
            "--enable-unified-cache-external-linker",
        ),
        (
            getattr(args, "disaggregation_decode_retraction_backup", None) == "host_pool",
            "host-pool retraction in PD disaggregation",
        ),
    ]
    return [reason for refused, reason in checks if refused]


def _seed_from(config: Mapping[str, Any], server_args: Any) -> int:
    """--radix-eviction-policy-config's "seed", else $KVROUTE_RLT_SEED, else --random-seed."""
    raw = config.get("seed")
    if raw is None:
        raw = os.environ.get(SEED_ENV_VAR)
    if raw is None:
        raw = getattr(server_args, "random_seed", None)
    try:
        return 0 if raw is None else int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"the rlt seed must be an integer, got {raw!r}") from None


def build_rlt_radix_cache(ctx: Any) -> RLTRadixCache:
    """Factory for ``register_radix_cache_backend("rlt", ...)``: validate, then build.

    ``ctx`` is SGLang's ``TreeCacheBuildContext``. Configurations the classic tree cannot
    serve are refused with the reason; ``--radix-eviction-policy-config`` may carry
    ``{"seed": N, "log_every": M}``.
    """
    check_sglang_version(sglang.__version__)
    refused = _refusals(ctx)
    if refused:
        raise ValueError(
            "--radix-cache-backend rlt does not support this configuration: "
            + "; ".join(refused)
            + ". Drop --radix-cache-backend rlt or the option(s) named."
        )
    params = ctx.params
    config = dict(params.eviction_policy_config or {})
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"--radix-eviction-policy-config keys {unknown} mean nothing to the rlt backend; "
            f"it reads {list(CONFIG_KEYS)}"
        )
    if params.eviction_policy.lower() != "lru":
        logger.warning(
            "--radix-eviction-policy %s is ignored: --radix-cache-backend rlt evicts by RLT",
            params.eviction_policy,
        )
    log_every = int(config.get("log_every", _DEFAULT_LOG_EVERY))
    marking = str(config.get("marking", "path"))
    # The config is consumed here; the base class would hand it to its LRU strategy.
    params = dataclasses.replace(params, eviction_policy_config=None)
    return RLTRadixCache(
        params,
        seed=_seed_from(config, ctx.server_args),
        log_every=log_every,
        marking=marking,
    )
