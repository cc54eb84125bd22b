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
    """A real-data sample (kept next to the project, in ``../shared/data``), else skip."""
    path = DATA / name
    if not path.is_file():
        pytest.skip(
            f"needs the real-data sample {name} (a slice of a public dataset or trace), which a "
            "clone of the repository does not include; the synthetic version of this workload "
            f"is tested without it. To run it, put the file at {path}"
        )
    return path


@dataclass
class ListWorkload:
    requests: list[WorkloadRequest] = field(default_factory=list)
    name: str = "hand"

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self.requests)
