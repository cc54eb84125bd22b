"""Seeded workload generators (no data files needed) and loaders of real traces by path."""

from sim.workloads.base import (
    GROUP_ORDERS,
    RequestList,
    Workload,
    WorkloadRequest,
    order_groups,
    poisson_arrivals_ms,
)
from sim.workloads.cyclic import CyclicConfig, CyclicWorkload
from sim.workloads.files import WorkloadFileError
from sim.workloads.gsp import GSP_ORDERS, GSPConfig, GSPWorkload
from sim.workloads.longdoc import LongDocConfig, LongDocWorkload, load_loogle
from sim.workloads.multiturn import MultiTurnConfig, MultiTurnWorkload, load_sharegpt
from sim.workloads.trace import TraceWorkload, load_azure, load_mooncake

__all__ = [
    "GROUP_ORDERS",
    "GSP_ORDERS",
    "CyclicConfig",
    "CyclicWorkload",
    "GSPConfig",
    "GSPWorkload",
    "LongDocConfig",
    "LongDocWorkload",
    "MultiTurnConfig",
    "MultiTurnWorkload",
    "RequestList",
    "TraceWorkload",
    "Workload",
    "WorkloadFileError",
    "WorkloadRequest",
    "load_azure",
    "load_loogle",
    "load_mooncake",
    "load_sharegpt",
    "order_groups",
    "poisson_arrivals_ms",
]
