"""``draw_leaf_evictions``: the batched RLT draw over (leaf, pages) pairs, for the tests.

The caches draw on their leaf registries' arrays (``leaf_sampling.draw_leaf_counts``, with
``draw_first_round`` for a few leaves); the distribution tests state their small trees as
(node, pages) pairs and read the draw back as a plan, which this adapter builds from exactly
those two functions, as ``RLTEviction`` calls them. ``leaf_sampling.FEW_LEAVES`` is read at
call time, so a test can patch it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import numpy as np

from engine_ext.cache import leaf_sampling

N = TypeVar("N", bound=Hashable)


def draw_leaf_evictions(
    candidates: Sequence[tuple[N, int]],
    need: int,
    gen: np.random.Generator,
    parent_joins: Callable[[N], tuple[N, int] | None],
    *,
    max_rounds: int = leaf_sampling._MAX_ROUNDS,
    method: str | None = None,
) -> list[tuple[N, int]]:
    """Pages to drop per leaf after ``need`` uniform leaf picks (or all pages, if fewer).

    ``candidates`` are (leaf, pages >= 1) in a deterministic order; ``parent_joins(leaf)`` is
    called when ``leaf`` empties and returns (parent, pages) if the parent becomes a candidate
    then. Returns (leaf, pages) with emptied leaves first, in the order they empty (children
    before their parents), then the partly trimmed ones. ``draw_leaf_counts`` is the same draw
    on arrays.
    """
    if need <= 0 or not candidates:
        return []
    nodes = [node for node, _ in candidates]

    def joins(label: int) -> int | None:
        joined = parent_joins(nodes[label])
        if joined is None or joined[1] <= 0:
            return None
        nodes.append(joined[0])
        return joined[1]

    first = None
    if (
        len(candidates) <= leaf_sampling.FEW_LEAVES
        and method is None
        and max_rounds == leaf_sampling._MAX_ROUNDS
    ):
        # A handful of leaves: the first round with Python lists (``draw_first_round``);
        # the same draws as the array path, which goes on from them (and the method chosen
        # there) if a leaf empties.
        method, first, taken = leaf_sampling.draw_first_round([p for _, p in candidates], need, gen)
        if taken is not None:
            return [(node, c) for node, c in zip(nodes, taken, strict=True) if c]
    pages = np.fromiter((p for _, p in candidates), dtype=np.int64, count=len(candidates))
    counts, emptied = leaf_sampling.draw_leaf_counts(
        pages, need, gen, joins, max_rounds=max_rounds, method=method, first=first
    )
    taken = counts.tolist()
    if not emptied:
        return [(node, c) for node, c in zip(nodes, taken, strict=True) if c]
    done = set(emptied)
    partial = [i for i, c in enumerate(taken) if c and i not in done]
    return [(nodes[i], taken[i]) for i in emptied] + [(nodes[i], taken[i]) for i in partial]
