"""Fixtures of the reference-cache tests."""

from __future__ import annotations

import pytest
from rlt_paths import PATHS, use_path


@pytest.fixture(params=PATHS)
def rlt_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on each of RLT's eviction paths on the reference cache (``rlt_paths``)."""
    use_path(request.param, monkeypatch)
    return str(request.param)
