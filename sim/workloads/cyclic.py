"""``cyclic``: the worst case for LRU, K distinct prompts requested again and again in order.

One pass over the K prompts puts ``K * (prompt_len + output_len - 1)`` tokens in the tree
(prompt plus the answer but its last token, what a finished request inserts); K is the
smallest count that makes this ``ratio`` times ``capacity_tokens`` or more. With the cycle
slightly larger than the cache, leaf-LRU always evicts exactly the prompt that comes back
next and hits nothing after the first pass (when requests run one at a time and
``capacity_tokens`` is the worker's capacity), while a randomized policy (RLT) keeps a
random part of the cycle and hits it on every pass: the paper's O(n) vs O(log n)
competitive-ratio gap. Each prompt has one fixed answer, as a deterministic model gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.tokens import random_tokens
from sim.workloads.base import RequestList, WorkloadRequest, poisson_arrivals_ms

__all__ = ["CyclicConfig", "CyclicWorkload"]


@dataclass(frozen=True, slots=True)
class CyclicConfig:
    capacity_tokens: int = 196_000
    ratio: float = 1.1
    prompt_len: int = 1024
    output_len: int = 4
    cycles: int = 5
    rate: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.capacity_tokens < 1 or self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("capacity_tokens, prompt_len and output_len must be >= 1")
        if not self.ratio > 0 or math.isinf(self.ratio):
            raise ValueError(f"ratio must be a positive number, got {self.ratio}")
        if self.cycles < 1:
            raise ValueError("cycles must be >= 1")

    @property
    def footprint_tokens(self) -> int:
        """Tokens one request leaves in the tree: its prompt and all but one answer token."""
        return self.prompt_len + self.output_len - 1

    @property
    def num_prompts(self) -> int:
        return max(1, math.ceil(self.ratio * self.capacity_tokens / self.footprint_tokens))

    @property
    def cycle_tokens(self) -> int:
        return self.num_prompts * self.footprint_tokens


class CyclicWorkload(RequestList):
    """``cycles`` passes over the same K prompts in the same order; ``limit`` keeps the first."""

    def __init__(self, config: CyclicConfig | None = None, limit: int | None = None) -> None:
        self.config = cfg = config or CyclicConfig()
        gen = np.random.default_rng(cfg.seed)
        k = cfg.num_prompts
        prompts = [random_tokens(gen, cfg.prompt_len) for _ in range(k)]
        answers = [random_tokens(gen, cfg.output_len) for _ in range(k)]
        count = k * cfg.cycles if limit is None else min(limit, k * cfg.cycles)
        arrivals = poisson_arrivals_ms(gen, cfg.rate, count)
        requests = [
            WorkloadRequest(
                f"cyc-{n // k}-{n % k}",
                t,
                prompts[n % k],
                cfg.output_len,
                answers[n % k],
                group=n % k,
            )
            for n, t in enumerate(arrivals)
        ]
        super().__init__("cyclic", requests)

    @property
    def reusable_working_set(self) -> int:
        """Every prompt comes back: K prompts (their answers are never part of a prompt)."""
        return self.config.num_prompts * self.config.prompt_len
