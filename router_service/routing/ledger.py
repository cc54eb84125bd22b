"""The router's ledger of its requests in flight, per worker, and what they will cost.

A decayed load (the paper's) forgets a request within about a second, whatever it still
holds; a request that decodes for a minute keeps its worker's batch and KV busy all that
time. The ledger counts each routed request until it completes:

- ``prefill_tokens``: prompt tokens still to prefill (uncached when routed; a request leaves
  this count at its first token, or when it completes if no first token was seen), and
  ``prefill_pairs``, their attention work: ``u * (c + u / 2)`` for ``u`` uncached tokens
  after ``c`` cached ones (attention grows with the square of a long prompt);
- ``kv_tokens``: the KV tokens its requests hold or will hold (prompt + expected output);
- ``in_flight``: requests, and ``pending_units``: uncached units routed and not completed;
- ``recent_prefill(worker, now_ms)``: the prefill the worker has done lately, per
  millisecond (tokens and attention pairs routed to it, exponentially weighted by their age
  over ``recent_window_ms``, less what is still queued). SGLang runs prefill first, so the
  prefills that arrive while a request decodes stall its decode steps; the share of the
  worker's time that prefill took lately is the router's forecast of that. What is still
  queued is not in it: that delays the next request's first token (``prefill_tokens``), not
  its decode, and one long prompt routed a moment ago would otherwise price its worker out
  of every decode until long after it is done. Computed from the routing times, not on a
  timer.

Output lengths are not known at routing time: ``OutputEstimate`` learns them from
completions (the share of ``max_new_tokens`` that requests really generate, and a typical
length for requests that give none).

>>> ledger = Ledger()
>>> ledger.open("r1", "w", uncached=800, prompt_tokens=1000, max_new_tokens=200)
>>> ledger.prefill_tokens["w"], ledger.kv_tokens["w"]
(800.0, 1200.0)
>>> ledger.prefill_pairs["w"]  # 800 * (200 + 800 / 2)
480000.0
>>> ledger.first_token("r1"); ledger.prefill_tokens["w"], ledger.prefill_pairs["w"]
(0.0, 0.0)
>>> _ = ledger.close("r1", output_tokens=50)
>>> ledger.kv_tokens["w"], ledger.in_flight["w"]
(0.0, 0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Ledger", "OutputEstimate", "attention_pairs"]


def attention_pairs(cached: float, uncached: float) -> float:
    """Attention work of prefilling ``uncached`` tokens after ``cached`` ones: each new
    token attends to the cached ones and, on average, half of the new ones."""
    return max(0.0, uncached) * (max(0.0, cached) + max(0.0, uncached) / 2.0)


class OutputEstimate:
    """Expected output tokens of a request, learned from those that completed.

    With ``max_new_tokens`` given: that cap times the share of it requests really generate
    (an exponentially weighted mean over completions, 1.0 until one is seen: benchmarks and
    ``ignore_eos`` clients generate the cap). Without: an exponentially weighted mean of
    output lengths (``default_tokens`` until one is seen). Both are plain means of what was
    seen until ``1 / weight`` completions, so the first one replaces the default.

    >>> est = OutputEstimate(weight=0.1)
    >>> est.expected(100), est.expected(None)
    (100.0, 256.0)
    >>> est.observe(100, 20); est.observe(None, 40)
    >>> round(est.expected(100), 6), est.expected(None)
    (20.0, 30.0)
    """

    def __init__(self, weight: float = 0.02, default_tokens: float = 256.0) -> None:
        self.weight = weight
        self.share = 1.0
        self.mean_tokens = default_tokens
        self._seen = 0  # completions with a count, and with a cap (the first ones weigh more)
        self._seen_capped = 0

    def expected(self, max_new_tokens: int | None) -> float:
        if max_new_tokens is None:
            return self.mean_tokens
        return max(1.0, self.share * max_new_tokens)

    def observe(self, max_new_tokens: int | None, output_tokens: int) -> None:
        if output_tokens < 0 or not math.isfinite(output_tokens):
            return
        # A mean of all seen so far until there are 1 / weight of them, then exponential:
        # the first completion replaces the default instead of nudging it.
        self._seen += 1
        self.mean_tokens += max(self.weight, 1.0 / self._seen) * (output_tokens - self.mean_tokens)
        if max_new_tokens:
            self._seen_capped += 1
            share = min(1.0, output_tokens / max_new_tokens)
            self.share += max(self.weight, 1.0 / self._seen_capped) * (share - self.share)


@dataclass(slots=True)
class _Open:
    worker: str
    uncached: int  # units
    prefill: float  # tokens
    pairs: float  # attention pairs of the prefill
    kv: float
    max_new_tokens: int | None
    prefilling: bool = True


class Ledger:
    """Open requests and their per-worker totals; O(1) per open, first token and close."""

    def __init__(
        self,
        outputs: OutputEstimate | None = None,
        recent_window_ms: float = 2000.0,
        time_scale: float = 1.0,
    ) -> None:
        for name, value in (("recent_window_ms", recent_window_ms), ("time_scale", time_scale)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self.outputs = outputs or OutputEstimate()
        # In the workers' time: the callers' clock runs 1 / time_scale as fast as emulated
        # workers' (``--time-scale``), and the prefill's share is of the workers' time.
        self.recent_window_ms = recent_window_ms
        self.time_scale = time_scale
        # worker -> (time, prefill tokens and pairs routed, weighted exp(-age / window))
        self._recent: dict[str, tuple[float, float, float]] = {}
        self.in_flight: dict[str, int] = {}
        self.pending_units: dict[str, int] = {}
        self.prefill_tokens: dict[str, float] = {}
        self.prefill_pairs: dict[str, float] = {}
        self.prefilling: dict[str, int] = {}  # requests whose first token is not seen yet
        self.kv_tokens: dict[str, float] = {}
        self._open: dict[str, _Open] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def open(
        self,
        request_id: str,
        worker: str,
        *,
        uncached: int,
        prompt_tokens: float,
        max_new_tokens: int | None,
        tokens_per_unit: float = 1.0,
        now_ms: float | None = None,
    ) -> None:
        """Count a routed request: ``uncached`` prompt units (``tokens_per_unit`` tokens each)
        to prefill, ``prompt_tokens`` in all, routed at ``now_ms`` (None: not counted in
        ``recent_prefill``)."""
        kv = prompt_tokens + self.outputs.expected(max_new_tokens)
        prefill = uncached * tokens_per_unit
        pairs = attention_pairs(prompt_tokens - prefill, prefill)
        self._open[request_id] = _Open(worker, uncached, prefill, pairs, kv, max_new_tokens)
        self.in_flight[worker] = self.in_flight.get(worker, 0) + 1
        self.pending_units[worker] = self.pending_units.get(worker, 0) + uncached
        self.prefill_tokens[worker] = self.prefill_tokens.get(worker, 0.0) + prefill
        self.prefill_pairs[worker] = self.prefill_pairs.get(worker, 0.0) + pairs
        self.prefilling[worker] = self.prefilling.get(worker, 0) + 1
        self.kv_tokens[worker] = self.kv_tokens.get(worker, 0.0) + kv
        if now_ms is not None and prefill > 0:
            at, tokens, total_pairs = self._decayed(worker, now_ms)
            self._recent[worker] = (at, tokens + prefill, total_pairs + pairs)

    def _decayed(self, worker: str, now_ms: float) -> tuple[float, float, float]:
        at, tokens, pairs = self._recent.get(worker, (now_ms, 0.0, 0.0))
        if now_ms <= at:  # a caller's clock never runs back here; if it does, no decay
            return at, tokens, pairs
        keep = math.exp(-(now_ms - at) * self.time_scale / self.recent_window_ms)
        return now_ms, tokens * keep, pairs * keep

    def recent_prefill(self, worker: str, now_ms: float) -> tuple[float, float]:
        """(tokens, attention pairs) per millisecond of the prefill ``worker`` did lately:
        each request's routed to it, weighted ``exp(-age / recent_window_ms)``, less what
        is still to prefill (``prefill_tokens``, ``prefill_pairs``), over the window."""
        if worker not in self._recent:
            return 0.0, 0.0
        _, tokens, pairs = self._decayed(worker, now_ms)
        tokens = max(0.0, tokens - self.prefill_tokens.get(worker, 0.0))
        pairs = max(0.0, pairs - self.prefill_pairs.get(worker, 0.0))
        return tokens / self.recent_window_ms, pairs / self.recent_window_ms

    def first_token(self, request_id: str) -> None:
        """The request's prefill is done: its tokens leave the prefill count."""
        entry = self._open.get(request_id)
        if entry is not None and entry.prefilling:
            entry.prefilling = False
            _sub(self.prefill_tokens, entry.worker, entry.prefill)
            _sub(self.prefill_pairs, entry.worker, entry.pairs)
            _sub(self.prefilling, entry.worker, 1)

    def close(self, request_id: str, output_tokens: int | None = None) -> str | None:
        """The request ended; returns its worker (None when it was not open here)."""
        entry = self._open.pop(request_id, None)
        if entry is None:
            return None
        worker = entry.worker
        _sub(self.in_flight, worker, 1)
        _sub(self.pending_units, worker, entry.uncached)
        if entry.prefilling:
            _sub(self.prefill_tokens, worker, entry.prefill)
            _sub(self.prefill_pairs, worker, entry.pairs)
            _sub(self.prefilling, worker, 1)
        _sub(self.kv_tokens, worker, entry.kv)
        if output_tokens is not None:
            self.outputs.observe(entry.max_new_tokens, output_tokens)
        return worker

    def drop_worker(self, worker: str) -> list[str]:
        """Forget a worker: its open requests are dropped (returned) and its totals go."""
        gone = [rid for rid, e in self._open.items() if e.worker == worker]
        for rid in gone:
            del self._open[rid]
        totals: dict[str, int] | dict[str, float]
        for totals in (
            self.in_flight,
            self.pending_units,
            self.prefill_tokens,
            self.prefill_pairs,
            self.prefilling,
            self.kv_tokens,
        ):
            totals.pop(worker, None)
        self._recent.pop(worker, None)
        return gone


def _sub(totals: dict[str, Any], worker: str, amount: float) -> None:
    """Subtract from a worker's total, never below zero (float sums round off)."""
    if worker in totals:
        left = totals[worker] - amount
        totals[worker] = left if left > 1e-9 else type(totals[worker])(0)
