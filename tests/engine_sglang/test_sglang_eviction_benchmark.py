"""``benchmarks/sglang_eviction.py`` end to end on a small run, on the tier's device.

With ``KVROUTE_TEST_DEVICE=cuda`` (a GPU machine, ``scripts/gpu_engine_check.sh``) the run puts
SGLang's KV pool on the GPU; elsewhere on the CPU. The figures are not checked (timing is the
benchmark's job), only that both policies ran on the same trees and freed what they say.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
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
