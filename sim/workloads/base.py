"""What a workload yields, arrival processes and group orders shared by the generators."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = [
    "GROUP_ORDERS",
    "RequestList",
    "Workload",
    "WorkloadRequest",
    "order_groups",
    "poisson_arrivals_ms",
]

GROUP_ORDERS = ("random", "grouped", "round_robin")


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request: arrival time, prompt tokens (a key string, see ``sim.tokens``), output.

    ``output`` holds the tokens the model is to "generate" when a later request depends on
    them (a multi-turn conversation quotes earlier answers); otherwise it is empty.
    ``after`` names the request this one waits for (closed-loop clients: a conversation's
    next turn is sent only once the previous answer has come back): it is released at
    ``max(arrival_ms, completion of after)``. The named request must come earlier in the
    workload.
    """

    rid: str
    arrival_ms: float
    prompt: str
    max_new_tokens: int
    output: str = ""
    group: int | None = None
    after: str | None = None


class Workload(Protocol):
    name: str

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[WorkloadRequest]: ...


class RequestList:
    """A workload held as a list of requests (what the generators and loaders return)."""

    def __init__(self, name: str, requests: Iterable[WorkloadRequest]) -> None:
        self.name = name
        self._requests = list(requests)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self._requests)

    def __getitem__(self, index: int) -> WorkloadRequest:
        return self._requests[index]

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self._requests)


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


def order_groups(
    sizes: Sequence[int], order: str, gen: np.random.Generator
) -> list[tuple[int, int]]:
    """(group, index in group) pairs in one of the paper's three prefix-sharing orders.

    ``grouped``: all of a group in a row (best case for any cache); ``round_robin``: one
    item of every group in turn, skipping groups that ran out (the reuse distance is a whole
    cycle of groups: LRU's worst case); ``random``: the grouped list shuffled by ``gen``.

    >>> order_groups([2, 1], "round_robin", np.random.default_rng(0))
    [(0, 0), (1, 0), (0, 1)]
    """
    if order not in GROUP_ORDERS:
        raise ValueError(f"unknown order {order!r}; known: {', '.join(GROUP_ORDERS)}")
    grouped = [(g, i) for g, size in enumerate(sizes) for i in range(size)]
    if order == "grouped":
        return grouped
    if order == "round_robin":
        longest = max(sizes, default=0)
        return [(g, i) for i in range(longest) for g, size in enumerate(sizes) if i < size]
    perm = gen.permutation(len(grouped))
    return [grouped[i] for i in perm]
