"""Stand-ins for SGLang's GPU kernel packages on a machine that lacks them (GPU checks only).

As soon as torch sees a GPU, SGLang 0.5.23 imports its CUDA kernel packages (``sgl_kernel``,
``flashinfer``, ``deep_gemm``: wheels of a GB and more) at module import, also from
quantization and MoE modules that the radix cache and the KV allocator never call.
``scripts/gpu_engine_check.sh`` loads this module first on a GPU machine where those wheels
cannot travel. Its finder is last on ``sys.meta_path``, so it answers only for a package that
is really missing; every attribute of a stand-in is another stand-in, and calling one raises,
so a kernel that were used would fail loudly instead of computing anything.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

STUBBED = ("sgl_kernel", "flashinfer", "deep_gemm")
stubbed: list[str] = []


def _fail(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("a GPU kernel package is not installed on this machine")


class _StubMeta(type):
    """Any attribute of a stand-in is another stand-in; calling one fails."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{cls.__name__}.{name}")


def _stub(name: str) -> Any:
    return _StubMeta(name, (), {"__init__": _fail})


class _MissingModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        stubbed.append(spec.name)
        module = _MissingModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.append(_Finder())
