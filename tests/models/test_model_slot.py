"""ModelSlot: champion/challenger in shadow, atomic promote, hot swap for all or one worker."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
from model_support import scratch_registry

from models import (
    SHARINGS,
    ModelBank,
    ModelSlot,
    ModelSpecError,
    NoChallenger,
    register_model,
)
from models.base import Features

X = {"queue_ms": 40.0, "uncached_k": 1.0}
WORKERS = ("w0", "w1", "w2")


def feed(slot: ModelSlot, n: int, seed: int = 0, level: Callable[[str], float] | None = None):
    """``n`` outcomes round-robin over WORKERS; residual ~ level(worker) +- 10%."""
    rng = random.Random(seed)
    for i in range(n):
        worker = WORKERS[i % len(WORKERS)]
        base = level(worker) if level else 200.0
        slot.learn(worker, X, base * rng.uniform(0.9, 1.1))


def test_default_slot_is_ewmean_version_one() -> None:
    slot = ModelSlot()
    assert (slot.kind_for("w0"), slot.version, slot.challenger) == ("ewmean", 1, None)
    assert slot.status()["challenger"] is None


def test_challenger_learns_in_shadow_and_reports_its_mae_next_to_the_champions() -> None:
    slot = ModelSlot("none")
    slot.start_challenger("ewmean")
    feed(slot, 300)
    assert slot.predict("w0", X) == 0.0  # routing still sees the champion only
    status = slot.status()
    champion, challenger = status["champion"], status["challenger"]
    assert champion["spec"]["kind"] == "none"
    assert challenger["spec"]["kind"] == "ewmean"
    assert champion["samples"] == challenger["samples"] == 300  # the same stream
    assert champion["mae_ms"] == pytest.approx(200.0, rel=0.05)
    assert challenger["mae_ms"] < 20.0 < champion["mae_ms"]
    assert set(challenger["per_worker_mae_ms"]) == set(WORKERS)
    assert status["version"] == 1  # shadow learning is not a swap


def test_promote_swaps_in_the_trained_challenger_atomically() -> None:
    slot = ModelSlot("none")
    slot.start_challenger({"kind": "ewmean", "params": {"forgetting": 0.9}})
    feed(slot, 60)
    trained = slot.challenger
    expected = trained.predict("w1", X) if trained else None
    slot.promote()
    assert slot.champion is trained
    assert slot.challenger is None
    assert slot.version == 2
    assert slot.kind_for("w1") == "ewmean"
    assert slot.predict("w1", X) == expected
    assert expected == pytest.approx(200.0, rel=0.1)


def test_promote_without_a_challenger_raises() -> None:
    slot = ModelSlot()
    with pytest.raises(NoChallenger, match="no challenger is running"):
        slot.promote()
    slot.start_challenger("linear")
    slot.drop_challenger()
    with pytest.raises(LookupError):
        slot.promote()
    assert slot.version == 1


def test_a_failing_challenger_never_disturbs_the_champion() -> None:
    with scratch_registry():

        class Broken:
            def predict_one(self, x: Features) -> float:
                raise RuntimeError("boom")

            def learn_one(self, x: Features, y: float) -> None:
                raise RuntimeError("boom")

        register_model("broken", Broken)
        slot = ModelSlot("ewmean")
        slot.start_challenger("broken")
        feed(slot, 30)
        assert slot.champion.failures == 0
        assert slot.challenger is not None
        assert slot.challenger.failures == 60  # 30 predictions and 30 learns
        assert slot.predict("w0", X) == pytest.approx(200.0, rel=0.1)


def test_swap_for_all_workers_starts_fresh_models_and_moves_the_version() -> None:
    slot = ModelSlot("ewmean")
    feed(slot, 30)
    slot.swap('{"kind": "linear", "params": {"lr": 0.01}}')
    assert slot.version == 2
    assert all(slot.kind_for(w) == "linear" for w in WORKERS)
    assert slot.champion.spec.params == {"lr": 0.01}
    assert slot.predict("w0", X) == 0.0  # fresh
    assert slot.champion.mae() is None
    slot.swap("ewmean", sharing="shared")
    assert (slot.champion.sharing, slot.version) == ("shared", 3)


def test_swap_for_one_worker_keeps_the_others_trained_models() -> None:
    slot = ModelSlot("ewmean")
    feed(slot, 90, level=lambda w: {"w0": 100.0, "w1": 300.0, "w2": 500.0}[w])
    before = {w: slot.predict(w, X) for w in WORKERS}
    mae_before = {w: slot.champion.mae(w) for w in WORKERS}
    slot.swap("linear", worker="w1")
    assert slot.version == 2
    assert [slot.kind_for(w) for w in WORKERS] == ["ewmean", "linear", "ewmean"]
    assert slot.predict("w1", X) == 0.0  # fresh linear
    assert slot.champion.mae("w1") is None
    for w in ("w0", "w2"):
        assert slot.predict(w, X) == before[w]
        assert slot.champion.mae(w) == mae_before[w]
    feed(slot, 90, seed=1, level=lambda w: {"w0": 100.0, "w1": 300.0, "w2": 500.0}[w])
    assert slot.predict("w1", X) == pytest.approx(300.0, rel=0.2)  # the new model learns


@pytest.mark.parametrize("worker", [None, "w1"])
def test_a_bad_swap_is_refused_and_leaves_the_champion_in_place(worker: str | None) -> None:
    slot = ModelSlot("ewmean")
    feed(slot, 30)
    champion = slot.champion
    with pytest.raises(ModelSpecError, match="unknown model kind 'nope'"):
        slot.swap("nope", worker=worker)
    with pytest.raises(ModelSpecError, match="has no parameter"):
        slot.swap({"kind": "linear", "params": {"rate": 1}}, worker=worker)
    assert slot.champion is champion
    assert slot.version == 1
    assert slot.predict("w1", X) == pytest.approx(200.0, rel=0.1)


def test_forget_worker_reaches_champion_and_challenger() -> None:
    slot = ModelSlot("ewmean")
    slot.start_challenger("ewmean")
    feed(slot, 30)
    slot.forget_worker("w0")
    assert slot.champion.mae("w0") is None
    assert slot.challenger is not None
    assert slot.challenger.mae("w0") is None
    assert slot.predict("w0", X) == 0.0
    assert slot.predict("w1", X) > 0.0


# -- swaps during a stream of predictions ------------------------------------------------------
class Interrupting:
    """A model whose ``predict_one`` runs a pending action (a swap) before it returns.

    This is the worst interleaving a swap can hit: the champion is replaced while one of its
    models is in the middle of a prediction.
    """

    pending: ClassVar[list[Callable[[], None]]] = []

    def __init__(self, value: float = 1.0) -> None:
        self.value = value
        self.n = 0

    def predict_one(self, x: Features) -> float:
        if Interrupting.pending:
            Interrupting.pending.pop()()
        return self.value + self.n

    def learn_one(self, x: Features, y: float) -> None:
        self.n += 1


@pytest.fixture
def interrupting() -> Iterator[type[Interrupting]]:
    with scratch_registry():
        register_model("interrupting", Interrupting)
        Interrupting.pending = []
        yield Interrupting
        Interrupting.pending = []


def test_a_swap_inside_a_prediction_completes_on_the_old_champion(interrupting: Any) -> None:
    slot = ModelSlot("interrupting")
    feed(slot, 6)  # two samples per worker: predicts 1 + 2
    interrupting.pending.append(lambda: slot.swap("ewmean"))
    assert slot.predict("w0", X) == 3.0  # the old champion's answer
    assert slot.version == 2
    assert slot.predict("w0", X) == 0.0  # then the new, fresh ewmean


def test_every_prediction_comes_from_the_old_or_the_new_champion(interrupting: Any) -> None:
    """Interleave predictions, learning and every kind of swap; swaps land mid-prediction."""
    rng = random.Random(7)
    slot = ModelSlot({"kind": "interrupting", "params": {"value": 1000.0}})
    specs = [{"kind": "interrupting", "params": {"value": v}} for v in (2000.0, 3000.0)]
    actions: list[Callable[[], None]] = [
        lambda: slot.swap(rng.choice(specs)),
        lambda: slot.swap(rng.choice(specs), worker=rng.choice(WORKERS)),
        lambda: slot.start_challenger(rng.choice(specs)),
        lambda: slot.promote() if slot.challenger is not None else None,
    ]
    swaps_mid_prediction = 0
    for _ in range(2000):
        worker = rng.choice(WORKERS)
        if rng.random() < 0.1:
            interrupting.pending.append(rng.choice(actions))
            swaps_mid_prediction += 1
        old = slot.champion
        expected_old = old.predict(worker, X) if not interrupting.pending else None
        if expected_old is None:  # the action fires inside this prediction
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(interrupting, "pending", [])
                expected_old = old.predict(worker, X)
        value = slot.predict(worker, X)
        new = slot.champion
        assert value in {expected_old, new.predict(worker, X)}
        assert value == expected_old  # a prediction already running finishes on its bank
        if rng.random() < 0.5:
            slot.learn(worker, X, 1.0)
    assert swaps_mid_prediction > 100
    assert slot.version > 50


def test_swaps_from_another_thread_never_break_routing() -> None:
    """Routing threads predict, learn and read status while the main thread swaps."""
    slot = ModelSlot("linear")
    errors: list[BaseException] = []
    stop = threading.Event()

    def route() -> None:
        rng = random.Random(1)
        try:
            while not stop.is_set():
                worker = f"w{rng.randrange(8)}"
                x = {"queue_ms": rng.uniform(0, 500), "uncached_k": rng.uniform(0, 4)}
                value = slot.predict(worker, x)
                assert value >= 0.0
                slot.learn(worker, x, rng.uniform(1, 300))
                slot.status()
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    def operate() -> None:
        rng = random.Random(2)
        try:
            for i in range(300):
                op = i % 4
                if op == 0:
                    slot.swap(rng.choice(("linear", "ewmean")), sharing=rng.choice(SHARINGS))
                elif op == 1:
                    slot.swap("ewmean", worker=f"w{rng.randrange(8)}")
                elif op == 2:
                    slot.start_challenger(rng.choice(("linear", "ewmean")))
                else:
                    slot.promote()
                slot.forget_worker(f"w{rng.randrange(8)}")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=route) for _ in range(2)]
    for t in threads:
        t.start()
    operate()
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert errors == []
    assert slot.version > 200


def test_bank_is_unchanged_by_a_swap_so_old_references_stay_valid() -> None:
    slot = ModelSlot("ewmean")
    feed(slot, 30)
    old: ModelBank = slot.champion
    value = old.predict("w0", X)
    slot.swap("linear", worker="w0")
    assert old.predict("w0", X) == value
    assert old.kind_for("w0") == "ewmean"
