"""Snapshots: signed JSON round trips, atomic writes, and nothing planted ever runs."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
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


def trained_slot(spec: str = "tree") -> ModelSlot:
    slot = ModelSlot(spec, sharing="per_worker")
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


def _body(data: bytes) -> dict[str, object]:
    """The JSON inside a snapshot (after the header and the signature)."""
    body: dict[str, object] = json.loads(data[len(b"KVRM2\n") + 32 :])
    return body


def _signed(body: bytes, key: bytes = KEY) -> bytes:
    return b"KVRM2\n" + hmac.new(key, body, hashlib.sha256).digest() + body


@pytest.mark.parametrize("spec", ["tree", "ewmean", "ratio", "none"])
def test_save_and_load_round_trip(tmp_path: Path, spec: str) -> None:
    slot = trained_slot(spec)
    path = tmp_path / "snapshots" / "models.kvrm"  # parents are created
    save(slot, path, KEY)
    loaded = load(path, KEY)
    assert loaded.version == slot.version == 2
    assert [loaded.kind_for(w) for w in WORKERS] == [spec, spec, "linear"]
    same_behaviour(slot, loaded)
    rng = random.Random(2)  # the learned state goes on learning identically
    for i in range(30):
        x, y = random_features(rng), rng.uniform(0, 300)
        slot.learn(WORKERS[i % 3], x, y)
        loaded.learn(WORKERS[i % 3], x, y)
    same_behaviour(slot, loaded)


def test_the_default_kinds_are_stored_as_numbers_not_pickles() -> None:
    slot = ModelSlot("ewmean")
    slot.start_challenger("ratio")
    for i in range(20):
        slot.learn(WORKERS[i % 3], {"estimate_ms": 100.0}, 50.0 + i)
    body = _body(dumps(slot, KEY))
    text = json.dumps(body)
    assert "pickle" not in text
    champion = body["champion"]
    assert isinstance(champion, dict)
    assert set(champion["models"]) == set(WORKERS)
    assert set(champion["models"]["w0"]["state"]) == {"theta", "p"}


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    slot = trained_slot()
    for _ in range(3):
        save(slot, tmp_path / "m.kvrm", KEY)
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
    save(good, target, KEY)
    before = target.read_bytes()
    with scratch_registry():
        register_model("unpicklable", Unpicklable)
        bad = ModelSlot("unpicklable")
        bad.learn("w0", {}, 1.0)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        save(bad, target, KEY)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.kvrm"]


def test_tampered_snapshot_is_refused() -> None:
    data = bytearray(dumps(trained_slot(), KEY))
    data[-10] ^= 0x01  # one bit of the body
    with pytest.raises(SnapshotError, match="signature does not verify"):
        loads(bytes(data), KEY)


def test_wrong_key_is_refused(tmp_path: Path) -> None:
    save(trained_slot(), tmp_path / "m", KEY)
    with pytest.raises(SnapshotError, match="signature does not verify"):
        load(tmp_path / "m", b"another-key-0123456789")


@pytest.mark.parametrize("key", [b"", b"short", None])
def test_there_is_no_snapshot_without_a_real_key(key: bytes | None) -> None:
    with pytest.raises(SnapshotError, match="at least 16 bytes"):
        dumps(ModelSlot(), key)  # type: ignore[arg-type]
    data = dumps(ModelSlot(), KEY)
    with pytest.raises(SnapshotError, match="at least 16 bytes"):
        loads(data, key)  # type: ignore[arg-type]


def _planted_pickle(marker: Path) -> bytes:
    """A pickle that, once loaded, creates ``marker`` (what an attacker would run)."""

    class Plant:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    return pickle.dumps(Plant())


def test_an_old_format_pickle_is_never_unpickled(tmp_path: Path) -> None:
    """A replayed attack: a pickle planted where a snapshot is read."""
    marker = tmp_path / "pwned"
    planted = b"KVRM1" + b"\0" * 32 + _planted_pickle(marker)
    with pytest.raises(SnapshotError, match="old pickle format"):
        loads(planted, KEY)
    assert not marker.exists()


def test_a_signed_snapshot_still_builds_nothing_but_models(tmp_path: Path) -> None:
    """Defence in depth: even a correctly signed snapshot (a leaked key) cannot make the
    unpickler of River's learners call a function."""
    marker = tmp_path / "pwned"
    body = _body(dumps(trained_slot("linear"), KEY))
    champion = body["champion"]
    assert isinstance(champion, dict)
    champion["models"]["w0"] = {"pickle": base64.b64encode(_planted_pickle(marker)).decode()}
    with pytest.raises(SnapshotError, match="not a model"):
        loads(_signed(json.dumps(body).encode()), KEY)
    assert not marker.exists()


def test_a_signed_snapshot_of_the_wrong_model_class_is_refused() -> None:
    body = _body(dumps(trained_slot("linear"), KEY))
    tree = _body(dumps(trained_slot("tree"), KEY))
    champion, other = body["champion"], tree["champion"]
    assert isinstance(champion, dict)
    assert isinstance(other, dict)
    champion["models"]["w0"] = other["models"]["w0"]  # a tree where linear is configured
    with pytest.raises(SnapshotError, match="where 'linear' builds"):
        loads(_signed(json.dumps(body).encode()), KEY)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "bad header"),
        (b"garbage bytes, not a snapshot", "bad header"),
        (random.Random(0).randbytes(4096), "bad header"),
        (b"KVRM2\n" + b"\0" * 10, "bad header"),  # truncated signature
        (_signed(b"{not json"), "corrupt"),
        (_signed(b'{"format": "other"}'), "not in the kvroute-models/2 format"),
        (_signed(b"[1, 2]"), "not in the kvroute-models/2 format"),
    ],
)
def test_garbage_is_a_snapshot_error(data: bytes, needle: str) -> None:
    with pytest.raises(SnapshotError, match=needle):
        loads(data, KEY)
    assert issubclass(SnapshotError, ValueError)


def test_signed_nonsense_values_are_refused() -> None:
    body = _body(dumps(trained_slot("ewmean"), KEY))
    champion = body["champion"]
    assert isinstance(champion, dict)
    champion["models"]["w0"] = {"state": {"theta": 1.0, "p": -1.0}}
    with pytest.raises(SnapshotError, match="corrupt"):
        loads(_signed(json.dumps(body).encode()), KEY)
    body = _body(dumps(trained_slot("ewmean"), KEY))
    champion = body["champion"]
    assert isinstance(champion, dict)
    champion["spec"] = {"kind": "no-such-kind", "params": {}}
    with pytest.raises(SnapshotError, match="cannot build"):
        loads(_signed(json.dumps(body).encode()), KEY)


def test_truncated_snapshot_is_a_snapshot_error() -> None:
    data = dumps(trained_slot(), KEY)
    with pytest.raises(SnapshotError):
        loads(data[: len(data) // 2], KEY)


def test_a_snapshot_without_the_fade_clock_keeps_each_workers_factor() -> None:
    """A snapshot written before the bank stored when each worker last learned
    (``last_sample``) loads with every ``ratio`` factor in use as learned, not faded to the
    fleet's as for a worker with no model."""
    slot = ModelSlot("ratio", sharing="per_worker")
    for i in range(60):
        worker = WORKERS[i % 3]
        estimate = 100.0
        # residuals of 1x, 2x, 3x the estimate: factors 2, 3, 4
        slot.learn(worker, {"estimate_ms": estimate}, estimate * (1 + i % 3))
    body = _body(dumps(slot, KEY))
    champion = body["champion"]
    assert isinstance(champion, dict)
    del champion["last_sample"]
    loaded = loads(_signed(json.dumps(body).encode()), KEY)
    x = {"estimate_ms": 100.0}
    assert [loaded.predict(w, x) for w in WORKERS] == pytest.approx(
        [slot.predict(w, x) for w in WORKERS]
    )
    assert loaded.predict("w2", x) == pytest.approx(300.0, rel=0.01)
