"""RLT's two eviction paths on the reference cache, for tests to choose: the reference loop
(``rlt_reference``, what runs without the C extension) and the compiled draw (``kernels``)."""

from __future__ import annotations

import pytest

from engine_ext.cache import kernels

PATHS = ("reference", "compiled")
BUILT = kernels.COMPILED  # as imported: tests patch ``kernels.COMPILED``


def use_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the reference cache's ``RLTEviction`` take ``path`` (one of ``PATHS``)."""
    if path == "compiled" and not BUILT:
        pytest.skip("the C extension is not built here (test_kernels says why)")
    monkeypatch.setattr(kernels, "COMPILED", path == "compiled")
