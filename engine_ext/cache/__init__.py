"""Reference radix cache (pure Python) with pluggable eviction: ``lru`` and ``rlt``."""

from engine_ext.cache.eviction import (
    EvictionPolicy,
    eviction_policy_names,
    make_eviction_policy,
    register_eviction_policy,
)
from engine_ext.cache.keys import Key, as_key, common_prefix_length
from engine_ext.cache.lru import LRUEviction
from engine_ext.cache.node import RadixNode
from engine_ext.cache.radix import (
    MARKINGS,
    CacheStats,
    CapacityError,
    InsertResult,
    MatchResult,
    RadixCache,
)
from engine_ext.cache.rlt import RLTEviction
from engine_ext.cache.rlt_reference import RLTReference

__all__ = [
    "MARKINGS",
    "CacheStats",
    "CapacityError",
    "EvictionPolicy",
    "InsertResult",
    "Key",
    "LRUEviction",
    "MatchResult",
    "RLTEviction",
    "RLTReference",
    "RadixCache",
    "RadixNode",
    "as_key",
    "common_prefix_length",
    "eviction_policy_names",
    "make_eviction_policy",
    "register_eviction_policy",
]
