"""RLT's eviction paths on the reference cache, for tests to choose: without the C extension,
Python lists for a tree of few leaves (below ``FEW_LEAVES``) and numpy arrays; with it, its
loops (``engine_ext.cache.kernels``) on the arrays at any size."""

from __future__ import annotations

import pytest

from engine_ext.cache import kernels, rlt

PATHS = ("lists", "arrays", "compiled")


def use_numpy_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every one of RLT's per-eviction loops in numpy, as an install without a C
    compiler does."""
    for name, twin in kernels.NUMPY_LOOPS.items():
        monkeypatch.setattr(kernels, name, twin)


def use_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the reference cache's ``RLTEviction`` take ``path`` (one of ``PATHS``)."""
    if path == "compiled":
        if not kernels.COMPILED:
            pytest.skip("the C extension is not built here (test_kernels says why)")
        monkeypatch.setattr(rlt, "FEW_LEAVES", -1)  # the loops are the compiled ones already
        return
    use_numpy_kernels(monkeypatch)
    monkeypatch.setattr(rlt, "FEW_LEAVES", 32 if path == "lists" else -1)
