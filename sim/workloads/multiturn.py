"""``multiturn``: closed-loop chat clients whose every turn resends the whole conversation.

The paper's ShareGPT and UltraChat benchmarks (``multi-turn.py`` in its code): client c has
``turns[c % len(turns)]`` turns (the paper cycles 2, 4, 6, 8); each turn's new user message
is forced to exactly ``user_len`` tokens (cut, or padded with one benign token, ``" a"``, as
the paper's ``force_len_tokens`` does) and every answer has ``output_len`` tokens. Turn k's
prompt is the whole history, ``u_0 + a_0 + ... + a_(k-1) + u_k``, so it extends the previous
turn's prompt and answer: the answer tokens are fixed here in ``WorkloadRequest.output``, and
the simulated engine inserts prompt + answer into its cache as SGLang does, so the next turn
hits them.

Closed loop: a turn is sent only after the client's previous answer came back (``after``).
Arrivals come from one Poisson sequence at ``rate``, taken in rounds: round k holds turn k
of every client that has one, in a seeded random order of clients, and the i-th request gets
the i-th arrival; the simulator then releases it at ``max(arrival, previous answer)``. The
paper's client launches one turn of a random ready client per Poisson tick: both keep the
offered rate while clients are ready and both wait for answers. The random order matters:
in client order, turn counts cycled with period 4 would meet a 4-worker fleet in lockstep
(clients 3, 7, 11... all 8-turn ones would start on the same worker under least-loaded or
smallest-tree routing), an artefact the paper's random pick does not have.

Text: synthetic random tokens by default, or the user messages of a ShareGPT-format file
(``[{"id", "conversations": [{"from": "human"|"gpt", "value"}]}]``, or ``role``/``content``
messages, ``.json`` or ``.jsonl``) tokenised with the emulator's word tokenizer. As in the
paper's loader, conversations with at least ``max(turns)`` user messages are used whole when
there are ``num_clients`` of them; otherwise all user messages are stitched in file order,
each client taking the next ``turns`` messages (the paper takes ``max(turns)`` a client and
drops the extra ones; taking only those used lets 1,000 single-turn ShareGPT prompts feed the
640 turns of the paper's setting; when the file has too few, messages wrap round, where the
paper stops).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim.tokens import ids_to_key, random_tokens
from sim.workloads.base import RequestList, WorkloadRequest, poisson_arrivals_ms
from sim.workloads.files import WorkloadFileError, iter_jsonl, read_json

__all__ = ["MultiTurnConfig", "MultiTurnWorkload", "load_sharegpt"]

_USER_ROLES = ("human", "user")


@dataclass(frozen=True, slots=True)
class MultiTurnConfig:
    """Paper defaults (``multi_conv.sh``): 128 clients, turns 2/4/6/8, 1024-token user
    messages, 4 output tokens, 12 requests/s."""

    num_clients: int = 128
    turns: tuple[int, ...] = (2, 4, 6, 8)
    user_len: int = 1024
    output_len: int = 4
    rate: float = 12.0
    seed: int = 0
    dataset: str | None = None

    def __post_init__(self) -> None:
        if self.num_clients < 1:
            raise ValueError("num_clients must be >= 1")
        if not self.turns or min(self.turns) < 1:
            raise ValueError("turns must be non-empty, each >= 1")
        if self.user_len < 1 or self.output_len < 1:
            raise ValueError("user_len and output_len must be >= 1")


class MultiTurnWorkload(RequestList):
    """The turns of every client, in arrival order; ``limit`` keeps the first ones."""

    def __init__(self, config: MultiTurnConfig | None = None, limit: int | None = None) -> None:
        self.config = cfg = config or MultiTurnConfig()
        gen = np.random.default_rng(cfg.seed)
        turns = [cfg.turns[c % len(cfg.turns)] for c in range(cfg.num_clients)]
        messages = _user_messages(cfg, turns, gen)
        answers = [[random_tokens(gen, cfg.output_len) for _ in range(t)] for t in turns]
        slots = [
            (k, int(c))
            for k in range(max(turns))
            for c in gen.permutation([c for c, t in enumerate(turns) if t > k])
        ]
        if limit is not None:
            slots = slots[:limit]
        arrivals = poisson_arrivals_ms(gen, cfg.rate, len(slots))
        histories = [_histories(m, a) for m, a in zip(messages, answers, strict=True)]
        requests = [
            WorkloadRequest(
                rid=f"mt-{c}-{k}",
                arrival_ms=t,
                prompt=histories[c][k],
                max_new_tokens=cfg.output_len,
                output=answers[c][k],
                group=c,
                after=f"mt-{c}-{k - 1}" if k else None,
            )
            for (k, c), t in zip(slots, arrivals, strict=True)
        ]
        super().__init__("multiturn", requests)


def _histories(messages: Sequence[str], answers: Sequence[str]) -> list[str]:
    """Prompt of every turn: all earlier messages and answers, then the new message."""
    prompts, history = [], ""
    for message, answer in zip(messages, answers, strict=True):
        history += message
        prompts.append(history)
        history += answer
    return prompts


def _user_messages(
    cfg: MultiTurnConfig, turns: list[int], gen: np.random.Generator
) -> list[list[str]]:
    if cfg.dataset is None:
        return [[random_tokens(gen, cfg.user_len) for _ in range(t)] for t in turns]
    from sim.emulator.tokenizer import encode

    conversations = load_sharegpt(cfg.dataset)
    whole = [c for c in conversations if len(c) >= max(cfg.turns)]
    if len(whole) >= cfg.num_clients:
        texts = [c[:t] for c, t in zip(whole, turns, strict=False)]
    else:
        stitched = [m for c in conversations for m in c]
        if not stitched:
            raise WorkloadFileError(cfg.dataset, None, "no user messages in the file")
        starts = np.cumsum([0, *turns])
        texts = [
            [stitched[(start + k) % len(stitched)] for k in range(t)]
            for start, t in zip(starts, turns, strict=False)
        ]
    pad = encode(" a")[0]
    return [
        [ids_to_key(_forced(encode(text), cfg.user_len, pad)) for text in client]
        for client in texts
    ]


def _forced(ids: list[int], length: int, pad: int) -> list[int]:
    """Exactly ``length`` ids: cut, or padded with ``pad`` (the paper's force_len_tokens)."""
    return ids[:length] if len(ids) >= length else ids + [pad] * (length - len(ids))


def load_sharegpt(path: str | Path) -> list[list[str]]:
    """The user messages of every conversation in a ShareGPT-format file, in file order.

    ``.jsonl``: one conversation object a line; otherwise one JSON list (or one object).
    Conversations without user messages are kept out; malformed records raise
    ``WorkloadFileError`` naming the line (``.jsonl``, syntax errors) or the record.
    """
    records: list[tuple[str, Any]] = []
    if str(path).endswith(".jsonl"):
        records = [(f"line {n}", obj) for n, obj in iter_jsonl(path)]
    else:
        data = read_json(path)
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list):
            raise WorkloadFileError(path, None, "expected a JSON list of conversations")
        records = [(f"record {i}", obj) for i, obj in enumerate(data)]
    conversations = []
    for where, obj in records:
        messages = _user_texts(obj, path, where)
        if messages:
            conversations.append(messages)
    return conversations


def _user_texts(obj: Any, path: str | Path, where: str) -> list[str]:
    line = int(where.split()[1]) if where.startswith("line") else None

    def bad(reason: str) -> WorkloadFileError:
        prefix = "" if line is not None else f"{where}: "
        return WorkloadFileError(path, line, prefix + reason)

    if not isinstance(obj, dict):
        raise bad("expected a conversation object")
    raw = obj.get("conversations", obj.get("messages"))
    if not isinstance(raw, list):
        raise bad("missing list 'conversations' (or 'messages')")
    texts = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise bad(f"message {i} is not an object")
        role = message.get("from", message.get("role"))
        text = message.get("value", message.get("content"))
        if not isinstance(role, str) or not isinstance(text, str):
            raise bad(f"message {i} needs string 'from' and 'value' (or 'role' and 'content')")
        if role in _USER_ROLES:
            texts.append(text)
    return texts
