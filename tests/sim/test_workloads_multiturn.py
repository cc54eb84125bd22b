"""``multiturn``: whole-history prompts, closed-loop dependencies, ShareGPT loading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from workload_support import ListWorkload, real_file

from sim.cluster import ClusterConfig, simulate
from sim.emulator.tokenizer import encode
from sim.tokens import ids_to_key
from sim.workloads import (
    MultiTurnConfig,
    MultiTurnWorkload,
    WorkloadFileError,
    WorkloadRequest,
    load_sharegpt,
)


def small(**kw: object) -> MultiTurnWorkload:
    config = MultiTurnConfig(num_clients=4, turns=(2, 3), user_len=16, output_len=3, **kw)  # type: ignore[arg-type]
    return MultiTurnWorkload(config)


def test_paper_defaults() -> None:
    cfg = MultiTurnConfig()
    assert (cfg.num_clients, cfg.turns, cfg.user_len, cfg.output_len, cfg.rate) == (
        128,
        (2, 4, 6, 8),
        1024,
        4,
        12.0,
    )
    assert cfg.dataset is None


def test_turns_cycle_over_clients_and_prompts_hold_the_whole_history() -> None:
    w = small()
    by_id = {r.rid: r for r in w}
    assert len(w) == 2 + 3 + 2 + 3
    for client, turns in enumerate((2, 3, 2, 3)):
        prompts = [by_id[f"mt-{client}-{k}"] for k in range(turns)]
        assert f"mt-{client}-{turns}" not in by_id
        for k, r in enumerate(prompts):
            assert r.group == client
            assert len(r.prompt) == (k + 1) * 16 + k * 3
            assert len(r.output) == r.max_new_tokens == 3
            if k == 0:
                assert r.after is None
            else:
                before = prompts[k - 1]
                assert r.after == before.rid
                # The previous prompt and its answer, then a new 16-token message.
                assert r.prompt.startswith(before.prompt + before.output)
    firsts = [by_id[f"mt-{c}-0"].prompt for c in range(4)]
    assert len({p[:1] for p in firsts}) == 4  # clients share nothing


def test_slots_go_round_by_round_in_a_random_client_order_with_poisson_arrivals() -> None:
    w = MultiTurnWorkload(MultiTurnConfig(num_clients=40, turns=(2, 3), user_len=4, rate=12.0))
    order = [tuple(map(int, r.rid.split("-")[1:])) for r in w]
    rounds = [[c for c, k in order if k == turn] for turn in range(3)]
    assert [k for _, k in order] == sorted(k for _, k in order)  # round by round
    assert sorted(rounds[0]) == sorted(rounds[1]) == list(range(40))
    assert sorted(rounds[2]) == list(range(1, 40, 2))  # the 3-turn clients
    assert rounds[0] != sorted(rounds[0])  # shuffled, like the paper's random ready client
    assert rounds[0] != rounds[1]
    arrivals = np.array([r.arrival_ms for r in w])
    assert arrivals[0] == 0.0
    assert (np.diff(arrivals) >= 0).all()
    big = MultiTurnWorkload(MultiTurnConfig(num_clients=300, turns=(4,), user_len=2, rate=12.0))
    gaps = np.diff([r.arrival_ms for r in big])
    assert gaps.mean() == pytest.approx(1000 / 12, rel=0.08)


def test_limit_keeps_every_dependency() -> None:
    w = MultiTurnWorkload(MultiTurnConfig(num_clients=4, turns=(2, 3), user_len=4), limit=6)
    rids = [r.rid for r in w]
    assert len(rids) == 6
    assert all(r.after in rids[: rids.index(r.rid)] for r in w if r.after)


def test_determinism_by_seed() -> None:
    assert list(small(seed=1)) == list(small(seed=1))
    assert [r.prompt for r in small(seed=1)] != [r.prompt for r in small(seed=2)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_clients": 0}, "num_clients must be >= 1"),
        ({"turns": ()}, "turns must be non-empty"),
        ({"turns": (2, 0)}, "turns must be non-empty, each >= 1"),
        ({"user_len": 0}, "user_len and output_len must be >= 1"),
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MultiTurnConfig(**kwargs)  # type: ignore[arg-type]


# -- ShareGPT files ------------------------------------------------------------------------
CONVERSATIONS = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "How do radix trees cache prefixes?"},
            {"from": "gpt", "value": "They share common prefixes between keys."},
            {"from": "human", "value": "And eviction?"},
            {"from": "gpt", "value": "Leaves go first."},
        ],
    },
    {
        "id": "b",
        "conversations": [
            {"from": "system", "value": "You are terse."},
            {"from": "human", "value": "Hello there, how are you today?"},
            {"from": "gpt", "value": "Fine."},
            {"from": "human", "value": "Tell me about LRU " * 20},
        ],
    },
]


def forced(text: str, length: int) -> str:
    ids = encode(text)[:length]
    return ids_to_key(ids + [encode(" a")[0]] * (length - len(ids)))


def test_sharegpt_json_round_trip_uses_whole_conversations(tmp_path: Path) -> None:
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(CONVERSATIONS))
    assert load_sharegpt(path) == [
        ["How do radix trees cache prefixes?", "And eviction?"],
        ["Hello there, how are you today?", "Tell me about LRU " * 20],
    ]
    cfg = MultiTurnConfig(num_clients=2, turns=(2,), user_len=12, output_len=2, dataset=str(path))
    by_id = {r.rid: r for r in MultiTurnWorkload(cfg)}
    first, second = by_id["mt-1-0"], by_id["mt-1-1"]
    assert first.prompt == forced("Hello there, how are you today?", 12)  # padded
    assert second.prompt == first.prompt + first.output + forced("Tell me about LRU " * 20, 12)
    assert len(encode("Tell me about LRU " * 20)) > 12  # ... and this one was cut


def test_sharegpt_jsonl_and_role_content_messages_stitch_when_too_few(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    lines = [{"conversations": [{"role": "user", "content": f"question {i}"}]} for i in range(3)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert load_sharegpt(path) == [["question 0"], ["question 1"], ["question 2"]]
    cfg = MultiTurnConfig(num_clients=3, turns=(2, 1), user_len=3, output_len=1, dataset=str(path))
    by_id = {r.rid: r for r in MultiTurnWorkload(cfg)}
    # Stitched in file order, each client the messages of its turns, wrapping round when short.
    assert by_id["mt-0-0"].prompt == forced("question 0", 3)
    assert by_id["mt-0-1"].prompt.endswith(forced("question 1", 3))
    assert by_id["mt-1-0"].prompt == forced("question 2", 3)
    assert by_id["mt-2-0"].prompt == forced("question 0", 3)
    assert by_id["mt-2-1"].prompt.endswith(forced("question 1", 3))


def test_real_sharegpt_samples_load() -> None:
    path = real_file("dialogstudio_sharegpt_original_example.json")
    raw = json.loads(path.read_text())
    expected = [[m["value"] for m in c["conversations"] if m["from"] == "human"] for c in raw]
    assert load_sharegpt(path) == expected
    assert len(expected) == 5
    prompts = real_file("mlenergy_ShareGPT_V3_filtered_1000.json")
    singles = load_sharegpt(prompts)
    assert len(singles) == 1000
    assert all(len(c) == 1 for c in singles)
    cfg = MultiTurnConfig(num_clients=8, user_len=64, dataset=str(prompts))
    w = MultiTurnWorkload(cfg)
    assert len(w) == 2 * (2 + 4 + 6 + 8)
    by_id = {r.rid: r for r in w}
    assert by_id["mt-0-0"].prompt == forced(singles[0][0], 64)


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("bad.jsonl", '{"conversations": []}\n{"conversations": [}\n', ":2: not valid JSON"),
        ("bad.jsonl", '{"conversations": []}\n\n[1, 2]\n', ":3: expected a JSON object"),
        ("bad.jsonl", '{"conversations": [{"from": "human"}]}\n', ":1: message 0 needs"),
        ("bad.json", '[\n  {"id": 1,\n  "conversations": [}\n]', ":3: not valid JSON"),
        ("bad.json", '[{"conversations": []}, {"id": "x"}]', ": record 1: missing list"),
        ("bad.json", '{"a": 1}', ": record 0: missing list"),
    ],
)
def test_malformed_sharegpt_names_the_line(
    tmp_path: Path, name: str, text: str, where: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(WorkloadFileError) as info:
        load_sharegpt(path)
    assert str(info.value).startswith(str(path))
    assert where in str(info.value)


def test_missing_file_is_a_workload_file_error(tmp_path: Path) -> None:
    with pytest.raises(WorkloadFileError, match="cannot read"):
        load_sharegpt(tmp_path / "nope.json")


# -- closed loop in the simulator ----------------------------------------------------------
def test_a_turn_never_starts_before_the_previous_answer() -> None:
    # 40 requests a second on one worker: slots come much faster than answers, so most
    # turns wait for their dependency and are released late.
    cfg = MultiTurnConfig(num_clients=6, turns=(3, 5), user_len=400, output_len=8, rate=40.0)
    workload = MultiTurnWorkload(cfg)
    run = simulate(ClusterConfig(workers=1, policy="round_robin", eviction="lru"), workload)
    records = {r.rid: r for r in run.records}
    assert len(records) == len(workload)
    waited = 0
    for item in workload:
        record = records[item.rid]
        assert record.finished_ms is not None
        assert record.arrival_ms >= item.arrival_ms
        if item.after is None:
            assert record.arrival_ms == item.arrival_ms
            continue
        before = records[item.after]
        assert before.finished_ms is not None
        assert record.arrival_ms == max(item.arrival_ms, before.finished_ms)
        waited += record.arrival_ms > item.arrival_ms
        # The whole previous turn (prompt + answer but its last token) is cached.
        assert record.cached_tokens >= before.prompt_tokens + cfg.output_len - 1
    assert waited >= len(workload) // 2


def test_unknown_or_later_dependency_is_refused() -> None:
    workload = ListWorkload(
        [
            WorkloadRequest("b", 0.0, "xy", 1, after="a"),
            WorkloadRequest("a", 0.0, "xz", 1),
        ]
    )
    with pytest.raises(ValueError, match="waits for 'a', which does not come earlier"):
        simulate(ClusterConfig(workers=1), workload)
