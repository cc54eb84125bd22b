"""Service models of GPU workers: named profiles with cited sources.

Every figure comes from ``notes/service-model-calibration.md`` (kvroute's calibration page,
which cites each input: model configs [C], Vidur's A100 operator profiles and SGLang/vLLM
published measurements [M], and datasheet scaling [D]). The profiles were fixed before any
simulation result was looked at and are not tuned to match the paper.

Step-time model (DistServe / BLIS form), in ms::

    prefill_step = max(T_w, a * N_new + c * sum_i n_i * (p_i + n_i / 2)) + o_step
    decode_step  = T_w + beta * sum(L) + b * B + o_step

``N_new`` is the uncached tokens computed in the step, ``n_i`` / ``p_i`` request i's new
tokens and tokens already in KV, ``L`` the context lengths of the ``B`` running sequences.
SGLang runs prefill first: a decode step runs only when no prefill batch can be formed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

__all__ = ["PROFILES", "ServiceProfile", "get_profile"]


@dataclass(frozen=True, slots=True)
class ServiceProfile:
    """One worker's hardware/model timing and limits."""

    name: str
    kv_capacity_tokens: int
    chunked_prefill_tokens: int
    max_running_requests: int
    weight_ms: float  # T_w: reading the weights once per step
    kv_read_ms_per_token: float  # beta: per context token per decode step
    per_seq_ms: float  # b: per running sequence per decode step
    prefill_ms_per_token: float  # a: linear layers per new token
    attn_ms_per_token_pair: float  # c: attention per (new token x context token)
    step_overhead_ms: float  # o_step: CPU overhead per step
    request_overhead_ms: float  # o_req: tokenisation, HTTP, detokenisation per request
    source: str = ""

    def prefill_ms(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Time of one prefill step; ``chunks`` are (new tokens, tokens already in KV)."""
        new = attn = 0.0
        for n, prior in chunks:
            new += n
            attn += n * (prior + n / 2)
        compute = self.prefill_ms_per_token * new + self.attn_ms_per_token_pair * attn
        return max(self.weight_ms, compute) + self.step_overhead_ms

    def decode_ms(self, context_tokens: int, batch: int) -> float:
        """Time of one decode step over ``batch`` sequences holding ``context_tokens`` in all."""
        return (
            self.weight_ms
            + self.kv_read_ms_per_token * context_tokens
            + self.per_seq_ms * batch
            + self.step_overhead_ms
        )

    def scaled(self, speed: float) -> ServiceProfile:
        """The same worker running ``speed`` times as fast (0.5 = half speed)."""
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        return replace(
            self,
            name=f"{self.name}@{speed:g}x",
            weight_ms=self.weight_ms / speed,
            kv_read_ms_per_token=self.kv_read_ms_per_token / speed,
            per_seq_ms=self.per_seq_ms / speed,
            prefill_ms_per_token=self.prefill_ms_per_token / speed,
            attn_ms_per_token_pair=self.attn_ms_per_token_pair / speed,
            step_overhead_ms=self.step_overhead_ms / speed,
        )


_CALIBRATION = "notes/service-model-calibration.md"

PROFILES: dict[str, ServiceProfile] = {
    # The paper's main setting: Llama-3.1-8B bf16, one SGLang 0.4.6 worker per L40.
    "llama3.1-8b-l40": ServiceProfile(
        name="llama3.1-8b-l40",
        kv_capacity_tokens=196_000,  # (0.88 x 45 GiB - weights - activations) / 128 KiB [D]
        chunked_prefill_tokens=8192,  # SGLang 0.4.6 default [C]
        max_running_requests=2048,  # KV capacity binds first [C]
        weight_ms=24.0,  # 16.06 GB / (0.75-0.8 x 864 GB/s) [D]
        kv_read_ms_per_token=0.20e-3,  # 131,072 B / 650 GB/s [D]
        per_seq_ms=0.04,  # Vidur A100 batch 1->64 growth x 1.7 [D]
        prefill_ms_per_token=0.114,  # Vidur A100 0.066 ms/token x 312/181 TFLOPS [D]
        attn_ms_per_token_pair=5.5e-6,  # 0.524 MFLOP per pair at ~95 TFLOPS [D]
        step_overhead_ms=1.5,  # Vidur CPU overheads 1-2 ms [M]
        request_overhead_ms=5.0,  # Vidur/BLIS 3-8 ms [M]
        source=f"{_CALIBRATION}, profile llama3.1-8b-l40",
    ),
    # Llama-3.1-70B, FP8 weights, bf16 KV, one H200 (the paper's larger-model setting).
    "llama3.1-70b-h200": ServiceProfile(
        name="llama3.1-70b-h200",
        kv_capacity_tokens=193_000,  # (0.907 x 139.9 - 67.7 - 0.3) GiB / 320 KiB [D]
        chunked_prefill_tokens=8192,  # [C]
        max_running_requests=2048,  # [C]
        weight_ms=21.5,  # 72.7 GB / 3.6 TB/s + 1.5 ms [D]
        kv_read_ms_per_token=0.091e-3,  # [D]
        per_seq_ms=0.06,  # [D]
        prefill_ms_per_token=0.157,  # FP8 at ~0.9 PFLOPS [D]; NIM 2xH100 TTFT agrees [M]
        attn_ms_per_token_pair=5.2e-6,  # [D]
        step_overhead_ms=1.5,  # [M]
        request_overhead_ms=5.0,  # [M]
        source=f"{_CALIBRATION}, profile llama3.1-70b-h200",
    ),
}


def get_profile(name: str) -> ServiceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None
