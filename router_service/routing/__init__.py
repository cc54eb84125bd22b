"""The pure routing core: no I/O, no FastAPI, no Redis; clock and RNG are injected."""

from router_service.routing.features import FEATURE_NAMES, residual_features
from router_service.routing.hold_queue import Held, HoldQueue, HoldSettings
from router_service.routing.load import DecayedLoads, Reservation
from router_service.routing.policies import (
    CACHE_AWARE_PRESETS,
    CacheAwarePolicy,
    LBGRPolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)
from router_service.routing.policy import (
    IndexSettings,
    RoutingPolicy,
    make_policy,
    policy_names,
    register_policy,
)
from router_service.routing.prefix_index import PrefixIndex
from router_service.routing.router import Router
from router_service.routing.types import (
    Candidate,
    Decision,
    Learned,
    ModelInfo,
    NoEligibleWorker,
    Outcome,
    RouteRequest,
    WorkerSnapshot,
    WorkerStatus,
)

__all__ = [
    "CACHE_AWARE_PRESETS",
    "FEATURE_NAMES",
    "CacheAwarePolicy",
    "Candidate",
    "DecayedLoads",
    "Decision",
    "Held",
    "HoldQueue",
    "HoldSettings",
    "IndexSettings",
    "LBGRPolicy",
    "Learned",
    "ModelInfo",
    "NoEligibleWorker",
    "Outcome",
    "PowerOfTwoPolicy",
    "PrefixIndex",
    "RandomPolicy",
    "Reservation",
    "RoundRobinPolicy",
    "RouteRequest",
    "Router",
    "RoutingPolicy",
    "WorkerSnapshot",
    "WorkerStatus",
    "make_policy",
    "policy_names",
    "register_policy",
    "residual_features",
]
