"""RLT eviction inside SGLang 0.5.x: the radix cache behind ``--radix-cache-backend rlt``.

``RLTRadixCache`` subclasses SGLang's classic ``RadixCache`` and keeps everything of it
(tree, ``RadixKey`` matching, page alignment, locking, KV-pool freeing, KV events, metrics)
except the eviction order. The RLT algorithm itself is not written again here: the reference
cache's ``RLTEviction`` (marking phases, the phase rules of ``evict``) and its batched sampler
``draw_leaf_evictions`` run unchanged on SGLang's tree through ``_SGLangTree``, a small view
that offers what ``RLTEviction`` reads. What is SGLang-specific lives in this module:

- marking: every match (``_match_prefix_helper``, so also ``touch_prefix``) and every insert
  (``_insert_helper``) marks its path; nodes carry ``mark_phase`` as the reference nodes do,
  and a split copies it to the new upper node;
- candidate order: SGLang keeps its evictable leaves in a ``set`` (iteration order follows
  memory addresses), so every node carries ``rlt_leaf_seq``, the moment it last became a
  leaf, and candidates are sorted by it. That is the reference cache's order, which makes a
  seeded run reproducible and equal to the reference (``tests/engine_sglang``);
- trimming: ``evict(n)`` drops whole pages from leaf tails. Emptied leaves go through
  SGLang's own ``_delete_leaf`` and ``kv_events.record_remove``; all freed KV indices
  (emptied leaves and trimmed tails) go back to the pool in one ``free_segment`` call. A
  trimmed leaf's ``key``, ``value`` and hash lists are cut when SGLang next reads one of
  them (deferred trims).

Deferred trims. A small eviction spreads over nearly every leaf (1k tokens from a tree of
~260 leaves: ~4 tokens each), and cutting a leaf costs a ``RadixKey`` and a tensor split,
a few microseconds of Python and torch dispatch each, while SGLang's LRU drops ~4 whole
leaves. So a trim only records the new length and turns the node into a
``_PendingTrimNode``, a ``TreeNode`` subclass whose ``key``, ``value``, ``hash_value`` and
``event_hash_value`` are properties: the first read or write of any of them cuts all four
to the recorded length and turns the node back into a plain ``TreeNode``. Every SGLang code
path reads nodes through those attributes (matching reads ``child.key``, locking
``len(node.key)``, ``total_size`` every ``value``), so none can see the untrimmed state;
most trimmed leaves are trimmed again or deleted before anything reads them. The tails'
KV indices are freed at eviction time, as before (``_tails``: a view per leaf, or for many
short leaves one concatenation of their values and one index).

This is the only module of kvroute that imports SGLang or torch (the ``engine`` extra).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Iterable, Mapping
from operator import attrgetter
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import sglang
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode
from sglang.srt.mem_cache.utils import compute_node_event_hash_values, compute_node_hash_values

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
CONFIG_KEYS = ("seed", "log_every")
_DEFAULT_LOG_EVERY = 1000
_leaf_seq_of = attrgetter("rlt_leaf_seq")
# Freeing trimmed tails (``_tails``): a tensor view per leaf (~4 us cold), or one
# concatenation plus one index at about this much per token copied.
_VIEW_NS = 4_000
_COPY_NS = 12


def _cut_key(key: RadixKey, keep: int) -> RadixKey:
    """``key[:keep]``: what ``RadixKey.__getitem__`` builds for it, without its checks."""
    if key.is_bigram:
        return key[:keep]
    return RadixKey(key.token_ids[:keep], key.extra_key, cache_salt=key.cache_salt)


def _settle(node: Any) -> None:
    """Cut a ``_PendingTrimNode`` to its recorded length; it is a plain ``TreeNode`` again."""
    state = node.__dict__
    keep, page, _ = state.pop("rlt_trim")
    node.__class__ = TreeNode
    state["key"] = _cut_key(state["key"], keep)
    state["value"] = state["value"][:keep]  # a view of the node's own storage
    for name in ("hash_value", "event_hash_value"):
        if state[name] is not None:
            state[name] = state[name][: keep // page]


def _settling(name: str) -> property:
    def read(node: Any) -> Any:
        _settle(node)
        return node.__dict__[name]

    def write(node: Any, value: Any) -> None:
        _settle(node)
        node.__dict__[name] = value

    return property(read, write, doc=f"``{name}``, cut to the pending trim on first use")


class _PendingTrimNode(TreeNode):
    """A leaf whose tail RLT freed and whose attributes are cut on first use (deferred
    trims in the module docstring). Never constructed: a trim assigns ``__class__``; the
    pending length, page size and stored ``value``'s length are ``rlt_trim`` in the instance
    dict."""

    key = _settling("key")
    value = _settling("value")
    hash_value = _settling("hash_value")
    event_hash_value = _settling("event_hash_value")


def _tails(
    stored: list[Any], lengths: list[int], keeps: list[int], sizes: list[int], dropped: int
) -> list[Any]:
    """The KV indices ``stored[i][keeps[i]:sizes[i]]`` of every trimmed leaf (``dropped`` of
    them in all), as few tensors; ``lengths[i]`` is ``len(stored[i])``.

    A view per leaf costs ~1.3 us warm (more cold) of torch dispatch; concatenating all the
    values and taking the tails with one ``index_select`` (on a CPU ~2.5x faster than
    indexing with ``values[positions]``) costs a few ns per token copied. Paired runs
    of ``benchmarks/sglang_eviction.py``'s trees: the index is ~15% faster on chat trees
    (many leaves of ~50 tokens), 6-12% on GSP's (~260 of ~256; 41 pairs each at 1k and 10k
    tokens); on a few long documents it would copy ~100k tokens for a dozen tails. The
    estimate below picks the cheaper."""
    if len(stored) * _VIEW_NS >= (sum(lengths) + dropped) * _COPY_NS:
        keep, size, length = (np.array(c, dtype=np.int64) for c in (keeps, sizes, lengths))
        tail = size - keep
        # A run of ``tail[i]`` positions from ``start[i]`` per leaf: one arange, shifted.
        start = np.cumsum(length) - length + keep
        shift = np.repeat(start - (np.cumsum(tail) - tail), tail)
        positions = torch.from_numpy(shift + np.arange(len(shift), dtype=np.int64))
        values = torch.cat(stored)
        return [values.index_select(0, positions.to(values.device))]
    return [value[k:n] for value, k, n in zip(stored, keeps, sizes, strict=True)]


def _leaf_size(node: Any) -> int:
    """Tokens in a leaf, without cutting a pending trim."""
    state = node.__dict__
    trim = state.get("rlt_trim")
    return int(trim[0]) if trim is not None else int(state["value"].numel())


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
    """What ``RLTEviction`` reads from a cache, served by SGLang's tree (duck-typed)."""

    __slots__ = ("cache", "capacity_tokens", "page_size", "sizes")

    def __init__(self, cache: RLTRadixCache, capacity_tokens: int, page_size: int) -> None:
        self.cache = cache
        self.capacity_tokens = capacity_tokens
        self.page_size = page_size
        self.sizes: dict[Any, int] = {}  # the last gather's leaf sizes, until its trims

    @property
    def root(self) -> Any:
        return self.cache.root_node

    @property
    def total_tokens(self) -> int:
        return int(self.cache.evictable_size_ + self.cache.protected_size_)

    def evictable_leaves(self) -> list[Any]:
        """Unlocked leaves in the order they became leaves (the reference cache's order)."""
        return sorted(self.cache.evictable_leaves, key=_leaf_seq_of)

    def evictable_leaf_sizes(self) -> list[tuple[Any, int]]:
        """The same leaves with their sizes in tokens (a pending trim's length, else the
        value tensor's: one C call, where a ``RadixKey``'s ``len`` is two Python calls).
        Kept until ``drop_tails``, so that the trims do not read every leaf's size again."""
        pairs = [(leaf, _leaf_size(leaf)) for leaf in self.evictable_leaves()]
        self.sizes = dict(pairs)
        return pairs

    def drop_tails(self, plan: Iterable[tuple[Any, int]]) -> int:
        sizes, self.sizes = self.sizes, {}
        return self.cache._drop_tails(plan, sizes)


class RLTRadixCache(RadixCache):
    """SGLang's classic radix cache with RLT eviction (marking phases, random leaf tails).

    ``capacity_tokens`` is the RLT capacity C (default: the KV pool's size, as the paper's
    SGLang fork uses); ``seed`` seeds the sampler through the same path as the reference
    cache (``random.Random(seed)`` -> ``RLTEviction``), so equal seeds give equal draws.
    """

    def __init__(
        self,
        params: CacheInitParams,
        *,
        capacity_tokens: int | None = None,
        seed: int = 0,
        log_every: int = _DEFAULT_LOG_EVERY,
    ) -> None:
        check_sglang_version(sglang.__version__)
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
        self._next_leaf_seq = 0
        self._tree = _SGLangTree(self, capacity_tokens, params.page_size)
        # RLTEviction only reads what _SGLangTree offers; see the module docstring.
        self.rlt = RLTEviction(cast("ReferenceRadixCache", self._tree), random.Random(seed))
        super().__init__(params)
        if not self.disable:
            logger.info(
                "kvroute RLT radix cache active: capacity %d tokens, page size %d, seed %d",
                capacity_tokens,
                self.page_size,
                seed,
            )

    @property
    def capacity_tokens(self) -> int:
        return self._tree.capacity_tokens

    @property
    def phases_started(self) -> int:
        return self.rlt.phases_started

    @property
    def marked_tokens(self) -> int:
        return self.rlt.marked_tokens

    def is_marked(self, node: Any) -> bool:
        return bool(self.rlt.is_marked(node))

    # -- tree hooks: marks and leaf order ------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.root_node.mark_phase = -1
        self.root_node.rlt_leaf_seq = -1
        self.rlt.reset()
        self._tree.sizes = {}  # (empty unless an evict stopped between gather and trims)

    def _take_leaf_seq(self) -> int:
        self._next_leaf_seq += 1
        return self._next_leaf_seq

    def _mark_path(self, node: Any) -> None:
        root = self.root_node
        path = []
        while node is not root:
            path.append(node)
            node = node.parent
        if path:
            self.rlt.on_access(path)

    def _match_prefix_helper(self, node: Any, key: RadixKey) -> tuple[list[Any], Any]:
        value, last_node = super()._match_prefix_helper(node, key)
        self._mark_path(last_node)
        return value, last_node

    def _insert_helper(
        self, node: Any, key: RadixKey, value: Any, priority: int = 0, inserted_len: int = 0
    ) -> tuple[int, Any]:
        prefix_len, last_node = super()._insert_helper(node, key, value, priority, inserted_len)
        if prefix_len < len(key):  # the helper created ``last_node`` as a new leaf
            last_node.mark_phase = -1
            last_node.rlt_leaf_seq = self._take_leaf_seq()
        self._mark_path(last_node)
        return prefix_len, last_node

    def _split_node(self, key: RadixKey, child: Any, split_len: int) -> Any:
        upper = super()._split_node(key, child, split_len)
        upper.mark_phase = child.mark_phase  # the lower part keeps its leaf position
        upper.rlt_leaf_seq = -1  # internal; gets a position when it becomes a leaf
        return upper

    # -- eviction ------------------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        start_time = time.perf_counter()
        freed = self.rlt.evict(params.num_tokens)
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

    def _drop_tails(self, plan: Iterable[tuple[Any, int]], known: Mapping[Any, int]) -> int:
        """Apply the sampler's plan: (unlocked leaf, tokens) with emptied leaves first.

        Emptied leaves are deleted with SGLang's helpers, children before parents. A leaf
        that keeps some tokens gets a pending trim (the module docstring): its tail's KV
        indices are a view of its value, the cut of its attributes waits for their next use.
        All freed KV indices go back in one ``free_segment`` call (SGLang's LRU makes one per
        leaf). One pass over the plan: a small eviction touches every candidate leaf.
        ``known``: leaves' sizes read since the last change of the tree (the candidates');
        a leaf not in it (a parent that joined) is read here.
        """
        root, page, pending = self.root_node, self.page_size, _PendingTrimNode
        events = self.kv_events.enabled
        freed: list[Any] = []
        stored: list[Any] = []  # trimmed leaves' values as stored (longer if a trim was
        lengths: list[int] = []  # pending) and their lengths, what they keep, their sizes
        keeps: list[int] = []  # before this trim
        sizes: list[int] = []
        dropped = 0  # tokens trimmed off the leaves that stay
        for node, tokens in plan:
            size = known.get(node)
            if size is None:
                size = _leaf_size(node)
            if tokens < size:
                state = node.__dict__
                keep = size - tokens
                if events:
                    self._record_tail_removed(node, keep)  # (applies a pending trim first)
                trim = state.get("rlt_trim")
                length = size if trim is None else trim[2]
                stored.append(state["value"])
                lengths.append(length)
                keeps.append(keep)
                sizes.append(size)
                dropped += tokens
                state["rlt_trim"] = (keep, page, length)
                node.__class__ = pending
                continue
            freed.append(node.value)  # (applies a pending trim first)
            parent = node.parent
            self._delete_leaf(node)
            self.kv_events.record_remove(node)
            if not parent.children and parent is not root:
                parent.rlt_leaf_seq = self._take_leaf_seq()
        if stored:
            freed.extend(_tails(stored, lengths, keeps, sizes, dropped))
            self.evictable_size_ -= dropped
        if not freed:
            return 0
        # Tree values are page-aligned copies of KV rows and every tail is whole pages, so
        # the freed indices form a page-exact segment, as SGLang's LRU frees a leaf.
        indices = torch.cat(freed) if len(freed) > 1 else freed[0]
        self.token_to_kv_pool_allocator.free_segment(indices, start_pos=0)
        return int(indices.numel())

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
    # The config is consumed here; the base class would hand it to its LRU strategy.
    params = dataclasses.replace(params, eviction_policy_config=None)
    return RLTRadixCache(params, seed=_seed_from(config, ctx.server_args), log_every=log_every)
