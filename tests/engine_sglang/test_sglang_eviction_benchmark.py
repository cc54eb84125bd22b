"""``benchmarks/sglang_eviction.py`` end to end on a small run, on the tier's device.

With ``KVROUTE_TEST_DEVICE=cuda`` (a GPU machine, ``scripts/gpu_engine_check.sh``) the run puts
SGLang's KV pool on the GPU; elsewhere on the CPU. The figures are not checked (timing is the
benchmark's job), only that both policies ran on the same trees and freed what they say.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sglang_harness import DEVICE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sglang_eviction


def test_a_small_run_writes_both_policies_per_point(tmp_path: Path) -> None:
    out = tmp_path / "eviction.json"
    code = sglang_eviction.main(
        [
            *("--repeats", "1", "--churn-repeats", "1", "--shapes", "longdoc"),
            *("--device", DEVICE, "--out", str(out)),
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == DEVICE
    assert doc["clock"] == ("process CPU time" if DEVICE == "cpu" else "synchronized wall time")
    rows = doc["rows"]
    assert [r["evict_tokens"] for r in rows] == list(sglang_eviction.EVICT_TOKENS)
    for row in rows:
        # RLT drops exactly what is asked (page size 1); LRU frees whole leaves, so at least.
        assert row["rlt_freed_min"] == row["rlt_freed_max"] == row["evict_tokens"]
        assert row["lru_freed_min"] >= row["evict_tokens"]
        assert row["rlt_ns_per_token"] > 0
        assert row["lru_ns_per_token"] > 0
        assert row["meets_target"] in ("yes", "no")
        assert len(row["floor_samples_ns"]) == 1  # one repeat: one floor sample
        assert row["floor_freed_min"] == row["evict_tokens"]
        assert row["floor_over_lru"] == pytest.approx(
            row["floor_ns_per_token"] / row["lru_ns_per_token"]
        )
    (churn,) = doc["churn"]
    (batched,) = doc["churn_batched"]
    assert doc["churn_batch"] == sglang_eviction.CHURN_BATCH
    assert (churn["batch"], batched["batch"]) == (1, sglang_eviction.CHURN_BATCH)
    for row in (churn, batched):
        assert row["shape"] == "longdoc"
        for policy in ("lru", "rlt"):
            assert row[f"{policy}_calls"] > 0
            assert row[f"{policy}_freed"] > 0
            assert 0 < row[f"{policy}_hit_rate"] < 1
    for policy in ("lru", "rlt"):  # one call for a batch's requests, not one for each
        assert batched[f"{policy}_calls"] < churn[f"{policy}_calls"]
    (build,) = doc["builds"]
    assert build["shape"] == "longdoc"
    assert build["builds"] == len(sglang_eviction.EVICT_TOKENS)  # one per point and policy
    assert build["lru_us_per_request"] > 0
    assert build["rlt_us_per_request"] > 0


def recorded_frees(cache: object) -> list[list[int]]:
    """Make ``cache``'s pool record the KV indices of each ``free_segment`` call."""
    allocator = cache.token_to_kv_pool_allocator  # type: ignore[attr-defined]
    calls: list[list[int]] = []
    free_segment = allocator.free_segment

    def recording(indices: torch.Tensor, start_pos: int = 0) -> None:
        calls.append(indices.tolist())
        free_segment(indices, start_pos=start_pos)

    allocator.free_segment = recording
    return calls


def test_the_pool_floor_frees_as_many_of_the_trees_indices_in_one_call() -> None:
    keys = sglang_eviction.SHAPES["gsp"](np.random.default_rng(1), 20_000)
    cache = sglang_eviction.build(keys, "rlt", 25_000, 3, "sglang", DEVICE)
    held = set(cache.all_values_flatten().tolist())
    calls = recorded_frees(cache)
    assert sglang_eviction.timed_free(cache, 1_234) > 0
    assert len(calls) == 1
    assert len(calls[0]) == len(set(calls[0])) == 1_234
    assert set(calls[0]) <= held


@pytest.mark.parametrize(("shape", "batch"), [("chat", 1), ("longdoc", 1), ("chat", 8)])
@pytest.mark.parametrize("policy", ["lru", "rlt"])
def test_under_churn_every_kv_index_is_in_the_tree_or_free_once(
    shape: str, batch: int, policy: str
) -> None:
    """A full cache serving a churn stream (RLT: leaves trimmed short, emptied page by page,
    parents joining), one request or a batch of them per eviction: at the end the pool's
    free indices and the tree's are disjoint, distinct and all of the pool, so no index was
    freed twice or lost."""
    from _tree_shapes import SHAPES as KEY_SHAPES
    from _tree_shapes import churn_keys

    from engine_ext.cache.keys import key_to_ids

    capacity = 20_000
    stream = churn_keys(KEY_SHAPES[shape], np.random.default_rng(5), capacity)
    cache = sglang_eviction.make_cache(policy, capacity, 3, "sglang", DEVICE)
    got = sglang_eviction.replay([key_to_ids(k) for k in stream], cache, capacity, batch=batch)
    assert got["freed"] > 0
    assert 3 <= len(got["call_ns"]) <= -(-len(stream) // batch)  # at most one call a batch
    held = cache.all_values_flatten().tolist()
    free = cache.token_to_kv_pool_allocator.free_pages.tolist()
    assert len(held) == len(set(held)) == cache.total_size()
    assert len(free) == len(set(free))
    assert set(held).isdisjoint(free)
    assert sorted(held + free) == list(range(1, capacity + 1))


def test_builds_are_timed_per_policy_and_paired() -> None:
    row = sglang_eviction.build_row("gsp", 10, {"lru": [1_000, 3_000], "rlt": [2_000, 4_000]})
    assert row["lru_us_per_request"] == 0.2  # median 2,000 ns over 10 requests
    assert row["rlt_us_per_request"] == 0.3
    assert row["rlt_over_lru"] == 1.667  # the median of 2 and 4/3, pair by pair
    assert row["builds"] == 2


@pytest.mark.parametrize("device", ["tpu", "cuda"])
def test_an_unknown_device_or_no_gpu_is_a_usage_error(
    device: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if device.startswith("cuda"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        sglang_eviction.main(["--device", device, "--out", "/dev/null"])
    assert exit_info.value.code == 2
    assert "--device" in capsys.readouterr().err


def test_a_churn_batch_below_two_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        sglang_eviction.main(["--churn-batch", "1", "--out", "/dev/null"])
    assert exit_info.value.code == 2
    assert "--churn-batch must be >= 2" in capsys.readouterr().err


def test_a_floor_of_no_repeats_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        sglang_eviction.main(["--floor-repeats", "0", "--out", "/dev/null"])
    assert exit_info.value.code == 2
    assert "--floor-repeats must be >= 1" in capsys.readouterr().err
