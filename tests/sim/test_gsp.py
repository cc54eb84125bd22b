"""The ``gsp`` workload: sizes, prefix sharing, orders, Poisson arrivals, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from sim.tokens import ids_to_key, key_to_ids
from sim.workloads import GSPConfig, GSPWorkload, poisson_arrivals_ms
from sim.workloads.gsp import SEPARATOR

LENS = (64, 128)


def gsp(order: str = "grouped", seed: int = 0, **kw: object) -> GSPWorkload:
    config = GSPConfig(num_groups=8, prompts_per_group=4, total_lens=LENS, order=order, seed=seed)
    return GSPWorkload(config, **kw)  # type: ignore[arg-type]


def common_prefix(texts: list[str]) -> int:
    """Length of the prefix shared by all ``texts``, one character at a time."""
    n = 0
    while all(len(t) > n and t[n] == texts[0][n] for t in texts):
        n += 1
    return n


def test_paper_defaults() -> None:
    cfg = GSPConfig()
    assert (cfg.num_groups, cfg.prompts_per_group, cfg.prefix_ratio) == (128, 32, 0.5)
    assert cfg.total_lens == (512, 1024, 2048, 4096, 8192)
    assert (cfg.output_len, cfg.order, cfg.rate) == (4, "random", 12.0)


def test_sizes_and_lengths() -> None:
    w = gsp()
    assert len(w) == 32
    assert w.name == "gsp"
    for r in w:
        assert r.group is not None
        total = LENS[r.group % 2]
        # system prompt (ratio x L) + one separator token + (L - system) question tokens
        assert len(r.prompt) == total + 1
        assert r.max_new_tokens == 4
        assert len(r.output) == 4
    assert w.total_prompt_tokens == 16 * 65 + 16 * 129
    assert w.prefix_lens == [33, 65] * 4
    assert w.reusable_working_set == 4 * 33 + 4 * 65
    assert len({r.rid for r in w}) == 32


def test_each_group_shares_exactly_its_prefix_and_nothing_across_groups() -> None:
    w = gsp()
    groups: dict[int, list[str]] = {}
    for r in w:
        assert r.group is not None
        groups.setdefault(r.group, []).append(r.prompt)
    assert sorted(groups) == list(range(8))
    for g, prompts in groups.items():
        shared = w.prefix_lens[g]
        assert len(prompts) == 4
        assert common_prefix(prompts) == shared
        assert all(p[shared - 1] == SEPARATOR for p in prompts)
        assert len(set(prompts)) == 4
    firsts = [prompts[0] for prompts in groups.values()]
    assert all(common_prefix([a, b]) == 0 for a in firsts for b in firsts if a is not b)


def test_orders() -> None:
    grouped = [r.group for r in gsp("grouped")]
    assert grouped == [g for g in range(8) for _ in range(4)]
    round_robin = [r.group for r in gsp("round_robin")]
    assert round_robin == list(range(8)) * 4
    shuffled = [r.group for r in gsp("random")]
    assert sorted(shuffled) == sorted(grouped)
    assert shuffled not in (grouped, round_robin)
    # The same prompts in every order: only the sequence changes.
    assert sorted(r.prompt for r in gsp("random")) == sorted(r.prompt for r in gsp("grouped"))


def test_round_robin_visits_every_prompt_once() -> None:
    prompts = [r.prompt for r in gsp("round_robin")]
    assert len(set(prompts)) == 32


def test_determinism_by_seed() -> None:
    a, b, c = gsp("random", seed=3), gsp("random", seed=3), gsp("random", seed=4)
    assert list(a) == list(b)
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert [r.arrival_ms for r in a] != [r.arrival_ms for r in c]


def test_limit_caps_the_requests() -> None:
    full, capped = gsp("round_robin"), gsp("round_robin", limit=5)
    assert len(capped) == 5
    assert [r.prompt for r in capped] == [r.prompt for r in full][:5]


def test_arrivals_start_at_zero_and_follow_the_rate() -> None:
    w = GSPWorkload(GSPConfig(num_groups=50, prompts_per_group=40, total_lens=(4,), rate=12.0))
    arrivals = np.array([r.arrival_ms for r in w])
    assert arrivals[0] == 0.0
    assert (np.diff(arrivals) >= 0).all()
    # 2000 arrivals at 12/s: the mean gap is 83.3 ms (standard error ~1.9 ms).
    assert np.diff(arrivals).mean() == pytest.approx(1000 / 12, rel=0.08)


def test_poisson_arrival_counts_per_second_are_poisson() -> None:
    arrivals = np.asarray(poisson_arrivals_ms(np.random.default_rng(1), 12.0, 12_000))
    seconds = int(arrivals[-1] // 1000)
    counts = np.bincount((arrivals // 1000).astype(int), minlength=seconds + 1)[:seconds]
    # Poisson: mean == variance == rate.
    assert counts.mean() == pytest.approx(12.0, rel=0.05)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.12)


def test_poisson_arrivals_edge_cases() -> None:
    gen = np.random.default_rng(0)
    assert poisson_arrivals_ms(gen, 5.0, 0) == []
    assert poisson_arrivals_ms(gen, float("inf"), 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_arrivals_ms(gen, 0.0, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"order": "sorted"}, "unknown gsp order 'sorted'; known: random, grouped, round_robin"),
        ({"prefix_ratio": 1.0}, "prefix_ratio must be in"),
        ({"num_groups": 0}, "num_groups and prompts_per_group must be >= 1"),
        ({"total_lens": (1,)}, "total_lens must be non-empty"),
        ({"output_len": 0}, "output_len must be >= 1"),
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GSPConfig(**kwargs)  # type: ignore[arg-type]


def test_token_keys_round_trip_including_the_surrogate_block() -> None:
    ids = [0, 1, 271, 0xD7FF, 0xD800, 0xDFFF, 0xE000, 128_255]
    key = ids_to_key(ids)
    assert len(key) == len(ids)
    assert key_to_ids(key) == ids
    key.encode("utf-8")  # always encodable
