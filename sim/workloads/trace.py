"""``trace`` and ``azure``: replay of recorded traffic from a file the user gives.

Mooncake JSONL (``trace``): one request a line, ``timestamp`` (ms since the trace start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``, one id per 512-token block
of the prompt (``len(hash_ids) == ceil(input_length / 512)``); requests that share a leading
run of ids share that KV prefix. Each prompt is rebuilt as the concatenation of one token run
per block, generated deterministically from the block's id (and the seed), the last block
cut to ``input_length``; so two prompts share exactly the prefix their ids share. A block's
first two tokens spell its id (``id % V``, ``id // V % V`` with V the vocabulary size) so
different blocks never share a first token by chance, which keeps the replayed prefix
structure exact (for ids below V**2, ~1.6e10).

Azure CSV (``azure``): ``TIMESTAMP,ContextTokens,GeneratedTokens`` with absolute ISO times
(Azure LLM inference traces 2023): real arrivals and lengths, no prefix data, so every
prompt is unique random tokens.

Both: arrivals are shifted to start at 0 and divided by ``time_scale`` (2 = replay twice as
fast, twice the load); ``limit`` keeps the first requests in time order; an output length of
0 is sent as 1 (an engine request generates at least one token). A malformed line raises
``WorkloadFileError`` naming the file and the line.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sim.tokens import VOCAB_SIZE, array_to_key, random_tokens
from sim.workloads.base import RequestList, WorkloadRequest
from sim.workloads.files import WorkloadFileError, field, iter_jsonl, read_lines

__all__ = ["BLOCK_TOKENS", "TraceWorkload", "block_tokens", "load_azure", "load_mooncake"]

BLOCK_TOKENS = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceWorkload(RequestList):
    """Requests replayed from a trace file; ``hash_ids`` per request (empty for Azure)."""

    def __init__(
        self, name: str, requests: Sequence[WorkloadRequest], hash_ids: Sequence[tuple[int, ...]]
    ) -> None:
        super().__init__(name, requests)
        self.hash_ids = list(hash_ids)


def block_tokens(hash_ids: Sequence[int], seed: int = 0) -> list[str]:
    """The 512 tokens of each block: its id in two tokens, then 510 pseudo-random ones.

    The random part is a counter-based hash (SplitMix64's finaliser) of (seed, id, position),
    computed for many blocks at once: the same block always gets the same tokens.
    """
    out: list[str] = []
    vocab = np.uint64(VOCAB_SIZE)
    steps = np.arange(1, BLOCK_TOKENS - 1, dtype=np.uint64) * _GOLDEN
    for start in range(0, len(hash_ids), 2048):
        ids = np.asarray(hash_ids[start : start + 2048], dtype=np.uint64).reshape(-1, 1)
        with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
            state = _mix(ids * _GOLDEN + np.uint64(seed % 2**64) * _SEED_STEP)
            tokens = _mix(state + steps) % vocab
        grid = np.hstack([ids % vocab, ids // vocab % vocab, tokens])
        text = array_to_key(grid.ravel())
        out.extend(text[i : i + BLOCK_TOKENS] for i in range(0, len(text), BLOCK_TOKENS))
    return out


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SEED_STEP = np.uint64(0xD1B54A32D192ED03)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def _check_scale(time_scale: float, limit: int | None, skip: int = 0) -> None:
    if not time_scale > 0 or math.isinf(time_scale):
        raise ValueError(f"time_scale must be a positive number, got {time_scale}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")


def load_mooncake(
    path: str | Path,
    *,
    time_scale: float = 1.0,
    limit: int | None = None,
    seed: int = 0,
    skip: int = 0,
) -> TraceWorkload:
    """Replay a Mooncake-format JSONL trace (see the module docstring); ``skip`` leaves out
    the first requests in time (a later window of the trace, its clock from its first)."""
    _check_scale(time_scale, limit, skip)
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    for line, obj in iter_jsonl(path):
        stamp = field(obj, "timestamp", (int, float), path, line)
        length = field(obj, "input_length", int, path, line)
        output = field(obj, "output_length", int, path, line)
        ids = field(obj, "hash_ids", list, path, line)
        if not math.isfinite(stamp) or stamp < 0:
            raise WorkloadFileError(path, line, f"timestamp must be a number >= 0, got {stamp}")
        if length < 1 or output < 0:
            raise WorkloadFileError(path, line, "input_length must be >= 1, output_length >= 0")
        if any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
            raise WorkloadFileError(path, line, "hash_ids must be integers >= 0")
        blocks = math.ceil(length / BLOCK_TOKENS)
        if len(ids) != blocks:
            raise WorkloadFileError(
                path,
                line,
                f"{len(ids)} hash_ids for input_length {length}; expected "
                f"ceil({length}/{BLOCK_TOKENS}) = {blocks}",
            )
        rows.append((float(stamp), length, output, tuple(ids)))
    rows = _first_in_time(rows, limit, skip)
    start = rows[0][0] if rows else 0.0
    needed = sorted({h for *_, ids in rows for h in ids})
    blocks = dict(zip(needed, block_tokens(needed, seed), strict=True))
    requests = []
    for i, (stamp, length, output, ids) in enumerate(rows):
        prompt = "".join(blocks[h] for h in ids)[:length]
        arrival = (stamp - start) / time_scale
        requests.append(WorkloadRequest(f"trace-{i}", arrival, prompt, max(1, output)))
    return TraceWorkload("trace", requests, [ids for *_, ids in rows])


def load_azure(
    path: str | Path,
    *,
    time_scale: float = 1.0,
    limit: int | None = None,
    seed: int = 0,
    skip: int = 0,
) -> TraceWorkload:
    """Replay an Azure-format CSV trace: real times and lengths, unique random prompts;
    ``skip`` leaves out the first requests in time (a later window, its clock from its first)."""
    _check_scale(time_scale, limit, skip)
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    lines = read_lines(path)
    header = next(lines, None)
    if header is None or tuple(c.strip() for c in header[1].split(",")) != AZURE_COLUMNS:
        raise WorkloadFileError(path, 1, f"expected the header {','.join(AZURE_COLUMNS)}")
    for line, text in lines:
        if not text.strip():
            continue
        cells = [c.strip() for c in text.split(",")]
        if len(cells) != 3:
            raise WorkloadFileError(path, line, f"expected 3 comma-separated values: {text!r}")
        try:
            stamp = dt.datetime.fromisoformat(cells[0])
        except ValueError:
            raise WorkloadFileError(path, line, f"bad TIMESTAMP {cells[0]!r}") from None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=dt.UTC)
        try:
            context, generated = int(cells[1]), int(cells[2])
        except ValueError:
            raise WorkloadFileError(
                path, line, f"token counts must be integers: {text!r}"
            ) from None
        if context < 1 or generated < 0:
            raise WorkloadFileError(path, line, "ContextTokens must be >= 1, GeneratedTokens >= 0")
        rows.append((stamp.timestamp() * 1000.0, context, generated, ()))
    rows = _first_in_time(rows, limit, skip)
    start = rows[0][0] if rows else 0.0
    gen = np.random.default_rng(seed)
    requests = [
        WorkloadRequest(
            f"azure-{i}", (stamp - start) / time_scale, random_tokens(gen, n), max(1, out)
        )
        for i, (stamp, n, out, _) in enumerate(rows)
    ]
    return TraceWorkload("azure", requests, [() for _ in rows])


def _first_in_time(
    rows: list[tuple[float, int, int, tuple[int, ...]]], limit: int | None, skip: int = 0
) -> list[tuple[float, int, int, tuple[int, ...]]]:
    """Rows in time order (stable for equal times): ``limit`` of them after the first
    ``skip`` (all after them when ``limit`` is None)."""
    rows = sorted(rows, key=lambda row: row[0])
    return rows[skip:] if limit is None else rows[skip : skip + limit]
