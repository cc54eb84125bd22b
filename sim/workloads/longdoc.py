"""``longdoc``: many questions over a few long shared documents (the paper's LooGLE benchmark).

As the paper's ``long.py``: group g is one document, truncated to ``doc_lens[g % 4]`` tokens
(1024, 2048, 4096, 8192) and at most to the context budget ``context_limit - 64 - output_len
- longest question`` (so the 8192 target becomes ~8.1k tokens, as in the paper); each of its
questions is a request with prompt ``"Input:\\n{doc}\\n\\nQuestion: {q}"`` and a fixed
output of ``output_len`` tokens (4). Requests follow one of the three prefix-sharing orders
(``random``, ``grouped``, ``round_robin``) with Poisson arrivals at ``rate``.

Text: synthetic by default (random document tokens, ``questions_per_doc`` random questions
of ``question_lens`` tokens, uniform), or a LooGLE-format JSONL file by path (``input``: the
document, ``qa_pairs``: a Python-literal list of ``{"Q": ..., "A": ...}``, parsed with
``ast.literal_eval``; at most ``max_questions`` per document, records without questions
skipped as the paper does), tokenised with the emulator's word tokenizer. The paper's 8B
runs tokenised with Llama 3's tokenizer; ours gives ~5-6 characters a token instead of ~4,
so a document truncated to N tokens here holds more text, but the token counts match.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.tokens import ids_to_key, random_tokens
from sim.workloads.base import (
    GROUP_ORDERS,
    RequestList,
    WorkloadRequest,
    order_groups,
    poisson_arrivals_ms,
)
from sim.workloads.files import WorkloadFileError, field, iter_jsonl

__all__ = ["LongDocConfig", "LongDocWorkload", "load_loogle"]

_CONTEXT_SAFETY = 64  # the paper's CTX_SAFETY


@dataclass(frozen=True, slots=True)
class LongDocConfig:
    """Paper defaults (``long.sh``): lengths 1024..8192, up to 100 questions a document,
    output 4, 12 requests/s. ``num_docs`` and ``questions_per_doc`` size the synthetic set
    (8 is about the mean of LooGLE's long-dependency set: 43 questions over our 5 samples)."""

    num_docs: int = 128
    questions_per_doc: int = 8
    max_questions: int = 100
    doc_lens: tuple[int, ...] = (1024, 2048, 4096, 8192)
    question_lens: tuple[int, int] = (16, 64)
    output_len: int = 4
    order: str = "random"
    rate: float = 12.0
    seed: int = 0
    context_limit: int = 8192
    dataset: str | None = None

    def __post_init__(self) -> None:
        if self.order not in GROUP_ORDERS:
            raise ValueError(f"unknown order {self.order!r}; known: {', '.join(GROUP_ORDERS)}")
        if self.num_docs < 1 or self.questions_per_doc < 1 or self.max_questions < 1:
            raise ValueError("num_docs, questions_per_doc and max_questions must be >= 1")
        if not self.doc_lens or min(self.doc_lens) < 1:
            raise ValueError("doc_lens must be non-empty, each >= 1")
        lo, hi = self.question_lens
        if not 1 <= lo <= hi:
            raise ValueError(f"question_lens must satisfy 1 <= min <= max, got {lo}, {hi}")
        if self.output_len < 1:
            raise ValueError("output_len must be >= 1")
        if self.context_limit <= _CONTEXT_SAFETY + self.output_len + hi:
            raise ValueError("context_limit leaves no room for a document")


class LongDocWorkload(RequestList):
    """The questions of every document in the configured order; ``limit`` keeps the first."""

    def __init__(self, config: LongDocConfig | None = None, limit: int | None = None) -> None:
        self.config = cfg = config or LongDocConfig()
        gen = np.random.default_rng(cfg.seed)
        groups = _groups(cfg, gen)
        self.doc_tokens = [len(doc) for doc, _ in groups]
        order = order_groups([len(qs) for _, qs in groups], cfg.order, gen)
        if limit is not None:
            order = order[:limit]
        arrivals = poisson_arrivals_ms(gen, cfg.rate, len(order))
        outputs = [random_tokens(gen, cfg.output_len) for _ in order]
        requests = [
            WorkloadRequest(
                f"doc-{g}-{q}", t, groups[g][0] + groups[g][1][q], cfg.output_len, out, group=g
            )
            for (g, q), t, out in zip(order, arrivals, outputs, strict=True)
        ]
        super().__init__("longdoc", requests)

    @property
    def reusable_working_set(self) -> int:
        """Tokens that can be reused: one copy of every document asked more than once."""
        return sum(self.doc_tokens)


def _budget(cfg: LongDocConfig, group: int, longest_question: int) -> int:
    target = cfg.doc_lens[group % len(cfg.doc_lens)]
    room = cfg.context_limit - _CONTEXT_SAFETY - cfg.output_len - longest_question
    return max(1, min(target, room))


def _groups(cfg: LongDocConfig, gen: np.random.Generator) -> list[tuple[str, list[str]]]:
    """(document prefix, question suffixes) per group, as token keys."""
    if cfg.dataset is None:
        lo, hi = cfg.question_lens
        groups = []
        for g in range(cfg.num_docs):
            lens = gen.integers(lo, hi + 1, size=cfg.questions_per_doc).tolist()
            doc = random_tokens(gen, _budget(cfg, g, max(lens)))
            groups.append((doc, [random_tokens(gen, n) for n in lens]))
        return groups
    from sim.emulator.tokenizer import encode

    head = encode("Input:\n")
    groups = []
    for g, (document, questions) in enumerate(load_loogle(cfg.dataset)[: cfg.num_docs]):
        tails = [encode(f"\n\nQuestion: {q}") for q in questions[: cfg.max_questions]]
        # The paper budgets with the whole template minus the document: head + tail.
        doc_ids = encode(document)[: _budget(cfg, g, len(head) + max(map(len, tails)))]
        groups.append((ids_to_key(head + doc_ids), [ids_to_key(t) for t in tails]))
    return groups


def load_loogle(path: str | Path) -> list[tuple[str, list[str]]]:
    """(document text, questions) for every record with questions in a LooGLE JSONL file.

    ``qa_pairs`` is a Python-literal string (LooGLE's release) or a JSON list; each pair is
    an object with a string ``Q``. Anything else raises ``WorkloadFileError`` with the line.
    """
    records = []
    for line, obj in iter_jsonl(path):
        document = field(obj, "input", str, path, line)
        raw = obj.get("qa_pairs")
        if raw in (None, "none", "", []):
            continue
        if isinstance(raw, str):
            try:
                raw = ast.literal_eval(raw)
            except (ValueError, SyntaxError, MemoryError, RecursionError) as exc:
                reason = f"qa_pairs is not a Python literal ({type(exc).__name__})"
                raise WorkloadFileError(path, line, reason) from None
        if not isinstance(raw, list):
            raise WorkloadFileError(path, line, "qa_pairs should be a list of {'Q': ..., 'A': ...}")
        questions = []
        for i, pair in enumerate(raw):
            if not isinstance(pair, dict) or not isinstance(pair.get("Q"), str):
                raise WorkloadFileError(path, line, f"qa_pairs[{i}] has no string 'Q'")
            questions.append(pair["Q"])
        if questions:
            records.append((document, questions))
    return records
