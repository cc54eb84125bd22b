"""Helpers for the residual model tests: feature dicts shaped like the router's, and a private
copy of the model registry for tests that register kinds of their own.

(A module and not a ``conftest.py``: ``--doctest-modules`` imports every ``conftest.py`` of
these package-less test folders under the one name ``conftest``, and two of them clash.)
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from models import registry


def random_features(rng: random.Random) -> dict[str, float]:
    """One feature dict with every name of ``FEATURE_NAMES``, in realistic ranges.

    ``test_model_checks`` checks that the names stay those of ``FEATURE_NAMES``.
    """
    return {
        "cached_k": rng.uniform(0.0, 8.0),
        "uncached_k": rng.uniform(0.0, 8.0),
        "queue_ms": rng.uniform(0.0, 5000.0),
        "in_flight": float(rng.randint(0, 20)),
        "pending_k": rng.uniform(0.0, 30.0),
        "prompt_k": rng.uniform(0.5, 8.0),
        "max_new_k": rng.choice((0.0, 0.004, 0.256)),
        "estimate_ms": rng.uniform(1.0, 13000.0),
    }


@contextmanager
def scratch_registry() -> Iterator[None]:
    """Kinds registered inside the block are gone after it (the built-ins stay)."""
    registry.model_kinds()  # load the built-ins and entry points into the real registry first
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry.REGISTRY, "_factories", dict(registry.REGISTRY._factories))
        yield
