"""Snapshots: round trip, atomic writes, HMAC signatures, refusing garbage."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest
from model_support import random_features, scratch_registry

from models import ModelSlot, SnapshotError, register_model
from models.base import Features
from models.persistence import dumps, load, loads, save

KEY = b"test-key-0123456789"
WORKERS = ("w0", "w1", "w2")


def trained_slot() -> ModelSlot:
    slot = ModelSlot("tree", sharing="per_worker")
    slot.swap("linear", worker="w2")
    slot.start_challenger({"kind": "linear", "params": {"lr": 0.01}}, sharing="shared")
    rng = random.Random(0)
    for i in range(200):
        worker = WORKERS[i % 3]
        slot.learn(worker, random_features(rng), 100.0 * (1 + i % 3) + rng.uniform(0, 20))
    return slot


def same_behaviour(a: ModelSlot, b: ModelSlot) -> None:
    rng = random.Random(1)
    probes = [(WORKERS[i % 3], random_features(rng)) for i in range(30)]
    assert [b.predict(w, x) for w, x in probes] == [a.predict(w, x) for w, x in probes]
    assert b.status() == a.status()
    assert a.challenger is not None
    assert b.challenger is not None
    assert [b.challenger.predict(w, x) for w, x in probes] == [
        a.challenger.predict(w, x) for w, x in probes
    ]


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    slot = trained_slot()
    path = tmp_path / "snapshots" / "models.kvrm"  # parents are created
    save(slot, path)
    loaded = load(path)
    assert loaded.version == slot.version == 2
    assert [loaded.kind_for(w) for w in WORKERS] == ["tree", "tree", "linear"]
    same_behaviour(slot, loaded)
    rng = random.Random(2)  # the learned state goes on learning identically
    for i in range(30):
        x, y = random_features(rng), rng.uniform(0, 300)
        slot.learn(WORKERS[i % 3], x, y)
        loaded.learn(WORKERS[i % 3], x, y)
    same_behaviour(slot, loaded)


def test_signed_round_trip(tmp_path: Path) -> None:
    slot = trained_slot()
    save(slot, tmp_path / "m", key=KEY)
    same_behaviour(slot, load(tmp_path / "m", key=KEY))
    # Without a key the signature is not checked: only trusted places should be read so.
    same_behaviour(slot, load(tmp_path / "m"))


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    slot = trained_slot()
    for _ in range(3):
        save(slot, tmp_path / "m.kvrm")
    assert [p.name for p in tmp_path.iterdir()] == ["m.kvrm"]


def test_a_failed_write_keeps_the_previous_snapshot(tmp_path: Path) -> None:
    class Unpicklable:
        def __init__(self) -> None:
            self.hook = lambda: None  # lambdas do not pickle

        def predict_one(self, x: Features) -> float:
            return 0.0

        def learn_one(self, x: Features, y: float) -> None:
            pass

    good = trained_slot()
    target = tmp_path / "m.kvrm"
    save(good, target)
    before = target.read_bytes()
    with scratch_registry():
        register_model("unpicklable", Unpicklable)
        bad = ModelSlot("unpicklable")
        bad.learn("w0", {}, 1.0)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        save(bad, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.kvrm"]


def test_tampered_snapshot_is_refused() -> None:
    data = bytearray(dumps(trained_slot(), key=KEY))
    data[-10] ^= 0x01  # one bit of the body
    with pytest.raises(SnapshotError, match="signature does not verify"):
        loads(bytes(data), key=KEY)


def test_wrong_key_is_refused(tmp_path: Path) -> None:
    save(trained_slot(), tmp_path / "m", key=KEY)
    with pytest.raises(SnapshotError, match="signature does not verify"):
        load(tmp_path / "m", key=b"another-key")


def test_unsigned_snapshot_is_refused_when_a_key_is_set() -> None:
    with pytest.raises(SnapshotError, match="signature does not verify"):
        loads(dumps(trained_slot()), key=KEY)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "bad header"),
        (b"garbage bytes, not a snapshot", "bad header"),
        (random.Random(0).randbytes(4096), "bad header"),
        (b"KVRM1" + b"\0" * 10, "bad header"),  # truncated signature
        (b"KVRM1" + b"\0" * 32 + b"\x80\x05not a pickle", "corrupt"),
        (b"KVRM1" + b"\0" * 32 + pickle.dumps({"champion": 1}), "holds a dict, not a ModelSlot"),
    ],
)
def test_garbage_is_a_snapshot_error(data: bytes, needle: str) -> None:
    with pytest.raises(SnapshotError, match=needle):
        loads(data)
    assert issubclass(SnapshotError, ValueError)


def test_truncated_snapshot_is_a_snapshot_error() -> None:
    data = dumps(trained_slot())
    with pytest.raises(SnapshotError):
        loads(data[: len(data) // 2])
