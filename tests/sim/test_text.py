"""Token ids as prompt text (sim.text), and a router that sees that text."""

from __future__ import annotations

import numpy as np
import pytest

from engine_ext.cache.keys import common_prefix_length
from router_service.routing import Router, WorkerStatus, make_policy
from sim.cluster import ClusterConfig, route_request, simulate
from sim.emulator.tokenizer import encode
from sim.text import LLAMA3_VOCAB_CHARS, char_lengths, render_text
from sim.tokens import VOCAB_SIZE, ids_to_key, random_tokens
from sim.workloads.base import RequestList, WorkloadRequest


def test_every_token_is_one_word_of_its_drawn_length() -> None:
    ids = list(range(0, VOCAB_SIZE, 997))
    lengths = char_lengths()
    for i in ids:
        word = render_text(ids_to_key([i]))
        assert len(word) == lengths[i] >= 2
        assert word[0] == " "
        assert not word[-1].isspace()
    assert len(render_text(ids_to_key(ids))) == int(lengths[ids].sum())
    assert render_text("") == ""


def test_the_lengths_follow_the_measured_distribution() -> None:
    lengths = char_lengths()
    table = np.array([n for n, _ in LLAMA3_VOCAB_CHARS], dtype=float)
    counts = np.array([c for _, c in LLAMA3_VOCAB_CHARS], dtype=float)
    mean = float((np.maximum(table, 2) * counts).sum() / counts.sum())
    assert lengths.mean() == pytest.approx(mean, rel=0.01)
    assert lengths.mean() == pytest.approx(5.81, abs=0.05)
    assert lengths.std() == pytest.approx(3.90, abs=0.1)
    assert (char_lengths() == lengths).all()  # fixed: the same id, the same text everywhere


def test_the_emulator_reads_the_text_back_as_as_many_tokens_with_the_same_prefixes() -> None:
    gen = np.random.default_rng(0)
    shared = random_tokens(gen, 300)
    a, b = shared + random_tokens(gen, 200), shared + random_tokens(gen, 250)
    ta, tb = render_text(a), render_text(b)
    ea, eb = encode(ta), encode(tb)
    assert (len(ea), len(eb)) == (len(a), len(b))
    assert common_prefix_length(ea, eb) >= 300  # the shared tokens stay shared
    assert common_prefix_length(ea, eb) <= 301  # and the rest does not (a word may collide)
    assert ta[: len(render_text(shared))] == tb[: len(render_text(shared))]


def _by_length(minimum: int, maximum: int, count: int) -> str:
    """``count`` distinct token ids whose text has between ``minimum`` and ``maximum`` chars."""
    lengths = char_lengths()
    ids = np.flatnonzero((lengths >= minimum) & (lengths <= maximum))
    assert len(ids) >= 2 * count
    return ids_to_key(ids[:count].tolist())


def test_token_share_above_the_threshold_but_character_share_below_is_not_routed_by_cache() -> None:
    """cache_aware's paper preset: 0.5 of *characters*, as sgl-router 0.4.6. A prompt whose
    shared prefix is 60% of its tokens but, in text, under 40% of its characters, does not
    follow its prefix when the router is sent text; sent token ids, it does."""
    prefix = _by_length(2, 3, 60)  # 60 short tokens
    long_ids = np.flatnonzero(char_lengths() >= 9)
    first = prefix + ids_to_key(long_ids[:40].tolist())
    second = prefix + ids_to_key(long_ids[40:80].tolist())
    assert len(prefix) / len(second) == 0.6
    assert len(render_text(prefix)) / len(render_text(second)) < 0.4
    r1, r2 = WorkloadRequest("r1", 0.0, first, 4), WorkloadRequest("r2", 5000.0, second, 4)
    workers = [WorkerStatus("http://a"), WorkerStatus("http://b")]
    for prompt_format, branch, chosen in (
        ("text", "smallest_tree", "http://b"),
        ("ids", "cache", "http://a"),
    ):
        # The routing core: r1 goes to a (both trees empty), r2 matches it on 60% of tokens.
        router = Router(make_policy("cache_aware", preset="paper"))
        assert router.route(route_request(r1, prompt_format), workers, 0.0).chosen == "http://a"
        decision = router.decide(route_request(r2, prompt_format), workers)
        assert (decision.branch, decision.chosen) == (branch, chosen), prompt_format

        # The simulator, end to end.
        config = ClusterConfig(
            workers=2,
            policy="cache_aware",
            policy_params={"preset": "paper"},
            eviction="lru",
            prompt_format=prompt_format,
        )
        run = simulate(config, RequestList("pair", [r1, r2]))
        by_id = {r.rid: r.worker for r in run.records}
        index = "1" if prompt_format == "text" else "0"
        assert by_id == {"r1": "http://sim-worker-0", "r2": f"http://sim-worker-{index}"}


def test_route_request_carries_text_or_ids_and_the_token_count() -> None:
    item = WorkloadRequest("r", 0.0, ids_to_key([5, 6, 7]), 4)
    ids, text = route_request(item, "ids"), route_request(item, "text")
    assert ids.key == item.prompt
    assert text.key == render_text(item.prompt)
    assert ids.prompt_tokens == text.prompt_tokens == 3
    assert text.units == len(text.key) > 3
    with pytest.raises(ValueError, match="unknown prompt_format 'json'; known: ids, text"):
        ClusterConfig(prompt_format="json")
