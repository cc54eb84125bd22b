"""Built-in routing policies."""

from typing import Any

from kvroute.registry import Registry
from router_service.routing.policies.basic import PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy
from router_service.routing.policies.cache_aware import (
    CACHE_AWARE_PRESETS,
    CacheAwarePolicy,
    CacheAwareSettings,
)
from router_service.routing.policies.lbgr import LBGRPolicy, lbgr_paper

__all__ = [
    "CACHE_AWARE_PRESETS",
    "CacheAwarePolicy",
    "CacheAwareSettings",
    "LBGRPolicy",
    "PowerOfTwoPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "register_builtins",
]


def register_builtins(registry: Registry[Any]) -> None:
    registry.register("random", RandomPolicy)
    registry.register("round_robin", RoundRobinPolicy)
    registry.register("power_of_two", PowerOfTwoPolicy)
    registry.register("cache_aware", CacheAwarePolicy)
    registry.register("lbgr", LBGRPolicy)
    registry.register("lbgr_paper", lbgr_paper)
