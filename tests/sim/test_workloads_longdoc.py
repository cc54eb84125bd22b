"""``longdoc``: LooGLE-like groups of questions over long shared documents."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from workload_support import real_file

from sim.emulator.tokenizer import encode
from sim.tokens import ids_to_key
from sim.workloads import LongDocConfig, LongDocWorkload, WorkloadFileError, load_loogle


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_paper_defaults() -> None:
    cfg = LongDocConfig()
    assert cfg.doc_lens == (1024, 2048, 4096, 8192)
    assert (cfg.max_questions, cfg.output_len, cfg.rate, cfg.order) == (100, 4, 12.0, "random")
    assert cfg.context_limit == 8192


def test_synthetic_documents_are_cut_to_the_cycled_lengths_and_the_context_budget() -> None:
    cfg = LongDocConfig(num_docs=8, questions_per_doc=5, order="grouped", seed=3)
    w = LongDocWorkload(cfg)
    assert len(w) == 40
    by_group: dict[int, list[str]] = {}
    for r in w:
        assert r.group is not None
        by_group.setdefault(r.group, []).append(r.prompt)
        assert r.max_new_tokens == len(r.output) == 4
    for g, prompts in by_group.items():
        doc = w.doc_tokens[g]
        questions = [len(p) - doc for p in prompts]
        assert all(16 <= q <= 64 for q in questions)
        # 8192 - 64 (safety) - 4 (output) - the longest question, as the paper's long.py.
        assert doc == min((1024, 2048, 4096, 8192)[g % 4], 8192 - 64 - 4 - max(questions))
        assert all(common_prefix(prompts[0], p) >= doc for p in prompts)
    assert w.reusable_working_set == sum(w.doc_tokens)
    assert common_prefix(by_group[0][0], by_group[1][0]) < 3


def test_orders() -> None:
    def groups(order: str) -> list[int | None]:
        cfg = LongDocConfig(num_docs=3, questions_per_doc=2, doc_lens=(32,), order=order)
        return [r.group for r in LongDocWorkload(cfg)]

    assert groups("grouped") == [0, 0, 1, 1, 2, 2]
    assert groups("round_robin") == [0, 1, 2, 0, 1, 2]
    assert sorted(groups("random"), key=str) == sorted(groups("grouped"), key=str)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"order": "sorted"}, "unknown order 'sorted'"),
        ({"doc_lens": ()}, "doc_lens must be non-empty"),
        ({"question_lens": (10, 5)}, "question_lens must satisfy"),
        ({"context_limit": 100}, "context_limit leaves no room"),
        ({"num_docs": 0}, "must be >= 1"),
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LongDocConfig(**kwargs)  # type: ignore[arg-type]


def loogle_line(doc: str, questions: list[str] | None) -> str:
    qa = "none" if questions is None else str([{"Q": q, "A": "x", "S": ["s"]} for q in questions])
    return json.dumps({"input": doc, "title": "t", "qa_pairs": qa, "output": "none"})


def test_loogle_round_trip(tmp_path: Path) -> None:
    doc_a = " ".join(f"alpha{i}" for i in range(100))
    doc_b = " ".join(f"beta{i}" for i in range(3000))
    path = tmp_path / "loogle.jsonl"
    path.write_text(
        "\n".join(
            [
                loogle_line(doc_a, ["What is alpha7?", "Who's there?"]),
                loogle_line("no questions here", None),
                loogle_line(doc_b, ["Why 'beta'?", "How?", "When?"]),
            ]
        )
        + "\n"
    )
    assert load_loogle(path) == [
        (doc_a, ["What is alpha7?", "Who's there?"]),
        (doc_b, ["Why 'beta'?", "How?", "When?"]),
    ]
    cfg = LongDocConfig(doc_lens=(50, 2000), max_questions=2, order="grouped", dataset=str(path))
    w = LongDocWorkload(cfg)
    head = encode("Input:\n")
    expected = [
        head + encode(doc_a)[:50] + encode("\n\nQuestion: What is alpha7?"),
        head + encode(doc_a)[:50] + encode("\n\nQuestion: Who's there?"),
        head + encode(doc_b)[:2000] + encode("\n\nQuestion: Why 'beta'?"),
        head + encode(doc_b)[:2000] + encode("\n\nQuestion: How?"),
    ]
    assert [r.prompt for r in w] == [ids_to_key(ids) for ids in expected]
    assert [r.group for r in w] == [0, 0, 1, 1]


def test_real_loogle_samples_load() -> None:
    for name in ("loogle_longdep_qa.jsonl", "loogle_shortdep_qa.jsonl"):
        path = real_file(name)
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        counts = [len(ast.literal_eval(x["qa_pairs"])) for x in lines]
        records = load_loogle(path)
        assert [len(qs) for _, qs in records] == counts
        assert [d for d, _ in records] == [x["input"] for x in lines]
        w = LongDocWorkload(LongDocConfig(dataset=str(path)))
        assert len(w) == sum(min(c, 100) for c in counts)
        # Every document is long enough for its target: 1024, 2048, 4096, ~8.1k tokens.
        assert w.doc_tokens[:3] == [2 + 1024, 2 + 2048, 2 + 4096]
        assert 8000 < w.doc_tokens[3] < 8192


@pytest.mark.parametrize(
    ("lines", "where"),
    [
        (
            ['{"input": "d", "qa_pairs": "[]"}', '{"input": "d", "qa_pairs": [}'],
            ":2: not valid JSON",
        ),
        (['{"qa_pairs": "[]"}'], ":1: missing field 'input'"),
        (['{"input": 5, "qa_pairs": "[]"}'], ":1: field 'input' should be str"),
        (["", "", '{"input": "d", "qa_pairs": "[{\'Q\': "}'], ":3: qa_pairs is not a Python"),
        (['{"input": "d", "qa_pairs": "{1: 2}"}'], ":1: qa_pairs should be a list"),
        (['{"input": "d", "qa_pairs": "[{\'A\': 1}]"}'], ":1: qa_pairs[0] has no string 'Q'"),
    ],
)
def test_malformed_loogle_names_the_line(tmp_path: Path, lines: list[str], where: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(WorkloadFileError) as info:
        load_loogle(path)
    assert str(info.value).startswith(f"{path}")
    assert where in str(info.value)
