"""Seeded workload generators (no data files needed) and loaders of real traces by path."""

from sim.workloads.base import Workload, WorkloadRequest, poisson_arrivals_ms
from sim.workloads.gsp import GSP_ORDERS, GSPConfig, GSPWorkload

__all__ = [
    "GSP_ORDERS",
    "GSPConfig",
    "GSPWorkload",
    "Workload",
    "WorkloadRequest",
    "poisson_arrivals_ms",
]
