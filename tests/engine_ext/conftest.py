"""Fixtures of the reference-cache tests."""

from __future__ import annotations

import pytest

from engine_ext.cache import rlt


@pytest.fixture(params=["few-leaves", "vectorised"])
def rlt_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on both of RLT's eviction paths on the reference cache: Python lists for a
    tree of few leaves (the default below ``FEW_LEAVES``) and numpy arrays (forced here)."""
    if request.param == "vectorised":
        monkeypatch.setattr(rlt, "FEW_LEAVES", -1)
    return str(request.param)
