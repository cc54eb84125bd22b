"""The SGLang tier: runs in the engine virtualenv only (``scripts/test_engine.sh``).

The main test run never collects this directory (``--ignore`` in ``pyproject.toml``). Nothing
here may reach the network: server arguments name no real model, and the Hugging Face hub is
switched to offline mode before SGLang is imported.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    # SGLang warns at import that GPU-only quantization kernels are missing on a CPU.
    config.addinivalue_line("filterwarnings", "ignore:Only CUDA:UserWarning")
