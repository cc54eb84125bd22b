"""kvroute's CPU stand-in for SGLang's ``sgl_kernel``: NOT SGLang's kernel package.

SGLang 0.5.23 imports a module named ``sgl_kernel`` even when it serves on a CPU. Both kernel
packages on PyPI (``sgl-kernel``, ``sglang-kernel``) hold CUDA libraries only. On a CPU
without AMX (and not arm64) SGLang skips every native ``torch.ops.sgl_kernel.*`` operator and
calls only the few module-level functions below, so this pure-torch module (written for
kvroute's real-engine tier) lets a CPU server run. tests/engine_real checks each function
against its definition and SGLang's greedy answers against plain transformers'.
``scripts/real_engine_setup.sh`` copies it into the engine virtualenv only; it is never part
of the kvroute package and is no use on a GPU.

Every other name is a stand-in that raises when called, so a kernel that were really needed
fails loudly instead of computing anything. Its submodules (``sgl_kernel.scalar_type``,
``sgl_kernel.kvcacheio``, ...) do not exist: SGLang catches that ImportError where a CPU
reaches one and takes its own fallback.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F

__version__ = "0.0.0+kvroute.cpu"
KVROUTE_CPU_STAND_IN = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request r: ``req_to_token[pool[r], start[r]:end[r]]`` = its slice of out_cache_loc.

    The slices of ``out_cache_loc`` follow each other in request order (SGLang's Triton
    ``assign_req_to_token_pool`` computes each one's offset as the sum of the earlier lengths).
    """
    del pool_len  # the row length; torch indexes rows by itself
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every KV buffer (its address, its row size in bytes): copy row src[j] onto tgt[j]."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        # Read every source row before writing any, as the kernel's tiles do.
        rows = [ctypes.string_at(ptr + src * stride, stride) for _, src in pairs]
        for (tgt, _), row in zip(pairs, rows, strict=True):
            ctypes.memmove(ptr + tgt * stride, row, stride)


def _act_and_mul(act: Any, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    d = x.shape[-1] // 2
    result = act(x[..., :d]) * x[..., d:]
    if out is None:
        return result
    out.copy_(result)
    return out


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _act_and_mul(F.silu, x, out)


def gelu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _act_and_mul(F.gelu, x, out)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _act_and_mul(lambda a: F.gelu(a, approximate="tanh"), x, out)


def _missing(name: str) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not in kvroute's CPU stand-in (scripts/cpu_sgl_kernel): "
            "this SGLang code path needs the real kernel package (a GPU build)"
        )

    fail.__name__ = name
    fail.__qualname__ = name
    return fail


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
