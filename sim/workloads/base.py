"""What a workload yields, and arrival processes shared by the generators."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["Workload", "WorkloadRequest", "poisson_arrivals_ms"]


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request: arrival time, prompt tokens (a key string, see ``sim.tokens``), output.

    ``output`` holds the tokens the model is to "generate" when a later request depends on
    them (a multi-turn conversation quotes earlier answers); otherwise it is empty.
    """

    rid: str
    arrival_ms: float
    prompt: str
    max_new_tokens: int
    output: str = ""
    group: int | None = None


class Workload(Protocol):
    name: str

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[WorkloadRequest]: ...


def poisson_arrivals_ms(gen: np.random.Generator, rate_per_s: float, count: int) -> Sequence[float]:
    """Arrival times (ms) of a Poisson process at ``rate_per_s``, first arrival at 0.

    ``rate_per_s`` = inf sends everything at time 0 (a burst), as SGLang's bench_serving does.
    """
    if count <= 0:
        return []
    if rate_per_s == float("inf"):
        return [0.0] * count
    if rate_per_s <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate_per_s}")
    gaps = gen.exponential(1000.0 / rate_per_s, size=count)
    gaps[0] = 0.0
    arrivals: list[float] = np.cumsum(gaps).tolist()
    return arrivals
