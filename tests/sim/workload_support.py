"""Helpers for the workload tests: the shared real-data folder and a list workload."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sim.workloads import WorkloadRequest

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DATA = PROJECT_ROOT.parent / "shared" / "data"


def real_file(name: str) -> Path:
    """A real sample from ``../shared/data`` (relative to the project root), else skip."""
    path = DATA / name
    if not path.is_file():
        pytest.skip(f"real sample {name} not found: ../shared/data is absent in this checkout")
    return path


@dataclass
class ListWorkload:
    requests: list[WorkloadRequest] = field(default_factory=list)
    name: str = "hand"

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self.requests)
