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
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang_harness import DEVICE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sglang_eviction


def test_a_small_run_writes_both_policies_per_point(tmp_path: Path) -> None:
    out = tmp_path / "eviction.json"
    code = sglang_eviction.main(
        ["--repeats", "1", "--shapes", "longdoc", "--device", DEVICE, "--out", str(out)]
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


def recorded_frees(cache: object) -> list[int]:
    """Make ``cache``'s pool record the KV indices each ``free_segment`` call gets."""
    allocator = cache.token_to_kv_pool_allocator  # type: ignore[attr-defined]
    freed: list[int] = []
    free_segment = allocator.free_segment

    def recording(indices: torch.Tensor, start_pos: int = 0) -> None:
        freed.extend(indices.tolist())
        free_segment(indices, start_pos=start_pos)

    allocator.free_segment = recording
    return freed


@pytest.mark.parametrize("tokens", [300, 14_000])
def test_the_gather_floor_reads_the_leaves_rlt_trimmed_or_deleted(tokens: int) -> None:
    """Equal builds share leaf positions, so the floor finds on a fresh tree exactly the
    leaves that RLT's evict touched; gathering their tails frees the very indices RLT
    freed (300 tokens: trims only), or those of every touched first leaf (14k of 20k: leaves
    empty; a parent that then joins and loses tokens too is left out of the floor)."""
    keys = sglang_eviction.SHAPES["gsp"](np.random.default_rng(1), 20_000)
    capacity = 25_000
    evicted, fresh, sizes = (
        sglang_eviction.rlt_tree(keys, capacity, 3, "sglang", DEVICE) for _ in range(3)
    )
    before = sglang_eviction.leaf_sizes_by_seq(sizes)
    by_rlt = recorded_frees(evicted)
    freed = evicted.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted
    assert freed == tokens
    keeps = sglang_eviction.touched(before, sglang_eviction.leaf_sizes_by_seq(evicted))
    firsts = {leaf.rlt_leaf_seq for leaf in fresh.evictable_leaves}
    assert len(keeps.keys() & firsts) > len(firsts) // 2  # a spread, as RLT's draw is
    assert keeps.keys() <= firsts  # parents that joined were split off: position -1
    by_floor = recorded_frees(fresh)
    assert sglang_eviction.timed_gather(fresh, keeps, freed, "views") > 0
    if tokens == 300:
        assert 0 not in keeps.values()
        assert sorted(by_floor) == sorted(by_rlt)
    else:
        assert 0 in keeps.values()  # emptied
        assert set(by_floor) <= set(by_rlt)
        assert len(set(by_floor)) == sum(before[seq] - kept for seq, kept in keeps.items())


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


def test_a_floor_of_no_repeats_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        sglang_eviction.main(["--floor-repeats", "0", "--out", "/dev/null"])
    assert exit_info.value.code == 2
    assert "--floor-repeats must be >= 1" in capsys.readouterr().err
