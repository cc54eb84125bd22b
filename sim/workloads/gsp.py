"""``gsp``: generated shared prefix, the paper's synthetic workload.

Groups of prompts share a system prompt. Group g has total prompt length
``total_lens[g % len(total_lens)]``; its system prompt is ``round(prefix_ratio * L)`` random
tokens and each prompt is ``system + SEP + question`` with ``L - system`` unique question
tokens, as SGLang's ``bench_serving.py`` ``generated-shared-prefix`` dataset (as modified by the
paper's code) builds ``f"{system}\n\n{question}"``: the ``"\n\n"`` separator is one token
(Llama 3 id 271) shared by the group, so the shared fraction is slightly above the ratio.
Orders: ``grouped`` (all of a group in a row), ``round_robin`` (one prompt of every group in
turn: the reuse distance is a whole cycle of groups, LRU's worst case), ``random`` (shuffled).
Paper defaults: 128 groups x 32 prompts, prefix ratio 0.5, lengths 512..8192, output 4 tokens,
12 requests/s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from sim.tokens import ids_to_key, random_tokens
from sim.workloads.base import GROUP_ORDERS, WorkloadRequest, order_groups, poisson_arrivals_ms

__all__ = ["GSP_ORDERS", "GSPConfig", "GSPWorkload"]

GSP_ORDERS = GROUP_ORDERS
SEPARATOR = ids_to_key([271])  # Llama 3's "\n\n" token


@dataclass(frozen=True, slots=True)
class GSPConfig:
    num_groups: int = 128
    prompts_per_group: int = 32
    prefix_ratio: float = 0.5
    total_lens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    output_len: int = 4
    order: str = "random"
    rate: float = 12.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.order not in GSP_ORDERS:
            raise ValueError(f"unknown gsp order {self.order!r}; known: {', '.join(GSP_ORDERS)}")
        if not 0.0 < self.prefix_ratio < 1.0:
            raise ValueError(f"prefix_ratio must be in (0, 1), got {self.prefix_ratio}")
        if self.num_groups < 1 or self.prompts_per_group < 1:
            raise ValueError("num_groups and prompts_per_group must be >= 1")
        if not self.total_lens or min(self.total_lens) < 2:
            raise ValueError("total_lens must be non-empty, each >= 2 tokens")
        if self.output_len < 1:
            raise ValueError("output_len must be >= 1")


class GSPWorkload:
    """The requests of one GSP run, generated once from the seed."""

    name = "gsp"

    def __init__(self, config: GSPConfig | None = None, limit: int | None = None) -> None:
        self.config = cfg = config or GSPConfig()
        gen = np.random.default_rng(cfg.seed)
        groups: list[list[str]] = []
        self.prefix_lens: list[int] = []
        for g in range(cfg.num_groups):
            total = cfg.total_lens[g % len(cfg.total_lens)]
            prefix_len = min(max(1, round(cfg.prefix_ratio * total)), total - 1)
            prefix = random_tokens(gen, prefix_len) + SEPARATOR
            self.prefix_lens.append(len(prefix))
            groups.append(
                [
                    prefix + random_tokens(gen, total - prefix_len)
                    for _ in range(cfg.prompts_per_group)
                ]
            )
        order = order_groups([cfg.prompts_per_group] * cfg.num_groups, cfg.order, gen)
        if limit is not None:
            order = order[:limit]
        arrivals = poisson_arrivals_ms(gen, cfg.rate, len(order))
        outputs = [random_tokens(gen, cfg.output_len) for _ in order]
        self._requests = [
            WorkloadRequest(f"gsp-{i}", t, groups[g][p], cfg.output_len, out, group=g)
            for i, ((g, p), t, out) in enumerate(zip(order, arrivals, outputs, strict=True))
        ]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self._requests)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self._requests)

    @property
    def reusable_working_set(self) -> int:
        """Tokens that can ever be reused: one copy of every group's shared prefix."""
        return sum(self.prefix_lens)
