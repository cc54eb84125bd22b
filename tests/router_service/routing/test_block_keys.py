"""Block keys: the chained block digests replicas share instead of prompts (index_sync)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from router_service.routing import Router, RouteRequest, WorkerStatus, make_policy
from router_service.routing.block_keys import (
    CHARS_PER_BLOCK,
    DIGEST_BYTES,
    BlockKeys,
    digests_to_key,
    key_to_digests,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
W0, W1 = "http://w0", "http://w1"


def _text(rng: random.Random, n: int) -> str:
    # Mixed planes: ASCII, accented, CJK and an emoji, so units are not just bytes.
    alphabet = "abcdefghij é中文🙂"
    return "".join(rng.choices(alphabet, k=n))


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 128_256) for _ in range(n)]


@pytest.mark.parametrize("block_units", [1, 4, 16, 64])
def test_prefix_property_digests_of_a_prefix_are_a_prefix_of_the_digests(
    block_units: int,
) -> None:
    keys = BlockKeys(block_units)
    rng = random.Random(block_units)
    for _ in range(20):
        full = _text(rng, rng.randrange(0, 400))
        whole = keys.key(full)
        for cut in range(0, len(full) + 1, max(1, len(full) // 7)):
            part = keys.key(full[:cut])
            assert whole.startswith(part)
            assert len(part) == cut // block_units * CHARS_PER_BLOCK


def test_a_changed_block_changes_its_digest_and_every_later_one_not_the_earlier() -> None:
    keys = BlockKeys(8)
    rng = random.Random(1)
    ids = _ids(rng, 80)  # 10 blocks
    base = keys.digests(ids)
    for block in range(10):
        changed = list(ids)
        changed[block * 8 + rng.randrange(8)] += 1
        other = keys.digests(changed)
        pairs = [
            (base[i : i + DIGEST_BYTES], other[i : i + DIGEST_BYTES])
            for i in range(0, len(base), DIGEST_BYTES)
        ]
        assert all(a == b for a, b in pairs[:block])
        assert all(a != b for a, b in pairs[block:])  # chained: the whole prefix counts


def test_matches_are_block_granular_a_trailing_partial_block_is_not_indexed() -> None:
    keys = BlockKeys(16)
    prompt = "x" * 16 * 3 + "tail"
    assert len(keys.key(prompt)) == 3 * CHARS_PER_BLOCK
    assert keys.key(prompt) == keys.key("x" * 48 + "other tail!!")
    assert keys.key("x" * 15) == ""
    # Order within a block matters (position-weighted), not just the multiset of units.
    assert keys.key("ab" + "c" * 14) != keys.key("ba" + "c" * 14)
    # Matched index characters back to prompt units: whole blocks only, capped by the prompt.
    assert keys.units(6, total_units=60) == 48
    assert keys.units(5, total_units=60) == 32  # half a block's characters: that block is out
    assert keys.units(8, total_units=60) == 60
    assert keys.units(0, total_units=60) == 0
    assert keys.index_units(48) == 6
    assert keys.index_units(5) == 1  # a size cap never rounds to zero


def test_text_and_token_ids_with_the_same_units_give_the_same_key() -> None:
    keys = BlockKeys(4)
    text = "hello, wörld 🙂 and more"
    assert keys.key(text) == keys.key([ord(ch) for ch in text])


@pytest.mark.parametrize("block_units", [1, 16])
def test_digests_round_trip_between_wire_bytes_and_index_keys(block_units: int) -> None:
    keys = BlockKeys(block_units)
    rng = random.Random(7)
    for n in (0, 1, 15, 16, 17, 300):
        for key in (_text(rng, n), _ids(rng, n)):
            digests = keys.digests(key)
            assert len(digests) == n // block_units * DIGEST_BYTES
            assert digests_to_key(digests) == keys.key(key)
            assert key_to_digests(keys.key(key)) == digests


def test_extreme_digests_map_to_valid_non_surrogate_code_points() -> None:
    for raw in (b"\x00" * 4, b"\xff" * 4, b"\x00\x00\x0f\xff", b"\xd8\x00\xdf\xff"):
        key = digests_to_key(raw)
        assert len(key) == CHARS_PER_BLOCK
        assert all(0x10000 <= ord(ch) <= 0x10FFFF for ch in key)
        key.encode("utf-8")  # strict: a surrogate would raise
        assert key_to_digests(key) == raw


def test_invalid_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="block_units"):
        BlockKeys(0)


# Digest values pinned: they are a wire format between replicas. If numpy's generator (the
# weights' source) or the mixing ever changes, replicas of different versions would stop
# understanding each other; this test says so before a deployment does.
_GOLDEN = {
    "text": "The quick brown fox jumps over the lazy dog. " * 2,
    "ids": list(range(1000, 1064)),
}


def _golden_digests() -> dict[str, str]:
    keys = BlockKeys(16)
    return {name: keys.digests(key).hex() for name, key in _GOLDEN.items()}


def test_digests_are_the_same_in_another_process() -> None:
    # The module is loaded from its file: importing the routing package would import the
    # residual models (River), seconds of start-up that say nothing about digests.
    code = (
        "import importlib.util, json\n"
        "spec = importlib.util.spec_from_file_location("
        "'block_keys', 'router_service/routing/block_keys.py')\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        f"golden = json.loads({json.dumps(json.dumps(_GOLDEN))})\n"
        "keys = module.BlockKeys(16)\n"
        "print(json.dumps({n: keys.digests(k).hex() for n, k in golden.items()}))\n"
    )
    # A different hash seed too: nothing may depend on Python's per-process str hashing.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(done.stdout) == _golden_digests()


def test_digests_match_the_pinned_wire_values() -> None:
    assert _golden_digests() == {
        "text": "218f9737fb3cb83a12584f4eb5b42d1264ec69ad",
        "ids": "3a5fa9ba0438dc4a24b314501253ec2f",
    }


def test_router_with_block_keys_reports_block_granular_cached_units() -> None:
    router = Router(make_policy("round_robin"), keys=BlockKeys(16))
    both = [WorkerStatus(W0), WorkerStatus(W1)]
    system = "s" * 40  # two full blocks and a partial one
    decision = router.route(RouteRequest("r1", system + "first question"), both, now_ms=0)
    assert decision.chosen == W0
    assert router.index_key(RouteRequest("r9", system + "first question")) == BlockKeys(16).key(
        system + "first question"
    )
    snaps = router.snapshots(RouteRequest("r2", system + "second question"), both)
    assert {s.url: s.cached for s in snaps} == {W0: 32, W1: 0}  # 40 shared -> 2 blocks
    assert router.index_units(W0) == 48  # 54 units routed: 3 full blocks
    # What another replica receives: the digests of the same prompt index the same keys.
    other = Router(make_policy("round_robin"), keys=BlockKeys(16))
    wire = BlockKeys(16).digests(system + "first question")
    other.index.insert(digests_to_key(wire), W0, now_ms=0)
    seen = other.snapshots(RouteRequest("r3", system + "second question"), both)
    assert {s.url: s.cached for s in seen} == {W0: 32, W1: 0}
