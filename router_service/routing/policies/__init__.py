"""Built-in routing policies."""

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


def register_builtins() -> None:
    from router_service.routing.policy import register_policy

    register_policy("random", RandomPolicy)
    register_policy("round_robin", RoundRobinPolicy)
    register_policy("power_of_two", PowerOfTwoPolicy)
    register_policy("cache_aware", CacheAwarePolicy)
    register_policy("lbgr", LBGRPolicy)
    register_policy("lbgr_paper", lbgr_paper)
