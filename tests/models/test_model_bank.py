"""ModelBank: failure isolation, per-worker vs shared models, rolling MAE, forget."""

from __future__ import annotations

import math
import pickle
import random
from collections.abc import Iterator

import pytest
from model_support import random_features, scratch_registry

from models import ModelBank, ModelSpec, ModelSpecError, RollingMAE, parse_spec, register_model
from models.base import Features


class Recorder:
    """Predicts ``value`` (or raises), remembers every dict it learned on."""

    def __init__(self, value: float = 7.0, fail_predict: bool = False, fail_learn: bool = False):
        self.value = value
        self.fail_predict = fail_predict
        self.fail_learn = fail_learn
        self.seen: list[Features] = []

    def predict_one(self, x: Features) -> float:
        if self.fail_predict:
            raise RuntimeError("predict exploded")
        return self.value

    def learn_one(self, x: Features, y: float) -> None:
        if self.fail_learn:
            raise ZeroDivisionError("learn exploded")
        self.seen.append(dict(x))


@pytest.fixture
def test_kinds() -> Iterator[None]:
    with scratch_registry():
        register_model("recorder", Recorder)
        register_model("raises_predict", lambda: Recorder(fail_predict=True))
        register_model("raises_learn", lambda: Recorder(fail_learn=True))
        register_model("nan", lambda: Recorder(math.nan))
        register_model("inf", lambda: Recorder(math.inf))
        register_model("negative", lambda: Recorder(-40.0))
        yield


X = {"queue_ms": 120.0, "uncached_k": 2.0}


def test_bad_spec_or_sharing_fails_at_construction() -> None:
    with pytest.raises(ModelSpecError, match="unknown model kind 'nope'"):
        ModelBank("nope")
    with pytest.raises(ValueError, match="unknown sharing 'pooled'; known: per_worker, shared"):
        ModelBank("ewmean", sharing="pooled")
    with pytest.raises(ModelSpecError, match="unknown model kind 'nope'"):
        ModelBank("ewmean", overrides={"w1": ModelSpec("nope")})


@pytest.mark.usefixtures("test_kinds")
def test_a_model_that_raises_in_predict_is_isolated_and_still_learns() -> None:
    bank = ModelBank("raises_predict")
    assert bank.predict("w", X) == 0.0
    assert bank.failures == 1
    for i in range(3):
        error = bank.learn("w", X, 50.0 + i)
        assert error == 50.0 + i  # the failed prediction counts as 0
    assert bank.failures == 4  # one more per learn (its prediction before learning)
    assert bank.samples == 3
    model = bank._models["w"]
    assert isinstance(model, Recorder)
    assert len(model.seen) == 3  # learning went on
    assert bank.mae("w") == pytest.approx(51.0)


@pytest.mark.usefixtures("test_kinds")
def test_a_model_that_raises_in_learn_is_counted_and_skipped() -> None:
    bank = ModelBank("raises_learn")
    for _ in range(5):
        assert bank.learn("w", X, 10.0) == pytest.approx(3.0)  # |7 - 10|
    assert (bank.failures, bank.samples) == (5, 5)
    assert bank.predict("w", X) == 7.0  # still predicts
    assert bank.status()["failures"] == 5


@pytest.mark.usefixtures("test_kinds")
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_non_finite_predictions_become_zero_and_are_counted(kind: str) -> None:
    bank = ModelBank(kind)
    assert bank.predict("w", X) == 0.0
    assert bank.failures == 1
    assert bank.learn("w", X, 5.0) == 5.0
    assert bank.mae() == 5.0


@pytest.mark.usefixtures("test_kinds")
def test_negative_predictions_are_clamped_but_not_failures() -> None:
    bank = ModelBank("negative")
    assert bank.predict("w", X) == 0.0
    assert bank.failures == 0


@pytest.mark.usefixtures("test_kinds")
def test_predict_never_creates_state() -> None:
    bank = ModelBank("recorder")
    assert bank.predict("w1", X) == 7.0
    assert bank._models == {}
    assert bank.mae() is None
    assert bank.mae("w1") is None


@pytest.mark.usefixtures("test_kinds")
def test_per_worker_keeps_one_model_per_worker_without_a_worker_feature() -> None:
    bank = ModelBank("recorder")
    bank.learn("w1", X, 1.0)
    bank.learn("w2", X, 1.0)
    bank.learn("w1", X, 1.0)
    assert sorted(bank._models) == ["w1", "w2"]
    assert [len(bank._models[w].seen) for w in ("w1", "w2")] == [2, 1]
    assert all(seen == X for m in bank._models.values() for seen in m.seen)


@pytest.mark.usefixtures("test_kinds")
def test_shared_keeps_one_model_with_the_worker_one_hot() -> None:
    bank = ModelBank("recorder", sharing="shared")
    bank.learn("w1", X, 1.0)
    bank.learn("w2", X, 1.0)
    assert list(bank._models) == ["*"]
    seen = bank._models["*"].seen
    # Dense over the workers learned on so far: a sparse one-hot would be constant where
    # present, and River's StandardScaler would scale it to 0 (invisible to linear and tree).
    assert seen == [{**X, "worker=w1": 1.0}, {**X, "worker=w1": 0.0, "worker=w2": 1.0}]
    assert bank._features("w1", X) == {**X, "worker=w1": 1.0, "worker=w2": 0.0}
    assert bank._features("w3", X) == {**X, "worker=w1": 0.0, "worker=w2": 0.0, "worker=w3": 1.0}
    bank.forget("w1")
    assert bank._features("w2", X) == {**X, "worker=w2": 1.0}
    assert X == {"queue_ms": 120.0, "uncached_k": 2.0}  # the caller's dict is not mutated


def test_per_worker_models_learn_independently_shared_ones_do_not() -> None:
    per_worker, shared = ModelBank("ewmean"), ModelBank("ewmean", sharing="shared")
    for bank in (per_worker, shared):
        for _ in range(20):
            bank.learn("slow", X, 500.0)
    assert per_worker.predict("slow", X) == pytest.approx(500.0)
    assert per_worker.predict("fast", X) == 0.0
    assert shared.predict("fast", X) == pytest.approx(500.0)  # ewmean ignores the one-hot


@pytest.mark.parametrize("kind", ["linear", "tree"])
def test_shared_learners_tell_workers_apart_through_the_one_hot(kind: str) -> None:
    bank = ModelBank(kind, sharing="shared")
    rng = random.Random(0)
    for _ in range(1500):
        worker = rng.choice(("fast", "slow"))
        x = {"queue_ms": rng.uniform(0, 100), "uncached_k": rng.uniform(0, 4)}
        bank.learn(worker, x, 400.0 if worker == "slow" else 50.0)
    probe = {"queue_ms": 50.0, "uncached_k": 2.0}
    assert bank.predict("slow", probe) == pytest.approx(400.0, rel=0.15)
    assert bank.predict("fast", probe) == pytest.approx(50.0, abs=40.0)


def test_rolling_mae_per_worker_and_fleet() -> None:
    bank = ModelBank("none", window=3)  # predicts 0: every error is the target itself
    for y in (1.0, 2.0, 3.0, 4.0):
        assert bank.learn("a", X, y) == y
    bank.learn("b", X, 10.0)
    assert bank.mae("a") == pytest.approx(3.0)  # the last three: 2, 3, 4
    assert bank.mae("b") == pytest.approx(10.0)
    assert bank.mae() == pytest.approx((2 + 3 + 4 + 10) / 4)  # weighted by samples in window
    assert bank.mae("nobody") is None
    status = bank.status()
    assert status["per_worker_mae_ms"] == {"a": 3.0, "b": 10.0}
    assert status["per_worker_learned"] == {}  # ``none`` has nothing to report
    assert status["mae_ms"] == pytest.approx(4.75)
    assert status["samples"] == 5
    assert status["spec"] == {"kind": "none", "params": {}}
    assert status["sharing"] == "per_worker"


def test_rolling_mae_window() -> None:
    mae = RollingMAE(window=2)
    assert mae.get() is None
    for err in (1.0, 3.0, 5.0, 7.0):
        mae.update(err)
    assert (mae.get(), mae.count) == (6.0, 4)
    with pytest.raises(ValueError, match="window must be >= 1"):
        RollingMAE(0)


def test_learn_returns_the_error_of_the_prediction_made_before() -> None:
    bank = ModelBank("ewmean")
    assert bank.learn("w", X, 100.0) == 100.0  # untrained: predicted 0
    assert bank.learn("w", X, 100.0) == pytest.approx(0.0, abs=1e-3)


@pytest.mark.parametrize("sharing", ["per_worker", "shared"])
def test_forget_drops_a_workers_model_and_error(sharing: str) -> None:
    bank = ModelBank("ewmean", sharing=sharing)
    for worker in ("a", "b"):
        bank.learn(worker, X, 300.0)
    bank.forget("a")
    assert bank.mae("a") is None
    assert bank.mae("b") is not None
    assert bank.predict("b", X) == pytest.approx(300.0)
    if sharing == "per_worker":
        assert bank.predict("a", X) == 0.0  # back to a fresh model
    else:
        assert bank.predict("a", X) == pytest.approx(300.0)  # the shared model stays
    bank.forget("never-seen")  # forgetting an unknown worker is a no-op


def test_forget_drops_a_per_worker_override() -> None:
    bank = ModelBank("ewmean").with_override("a", parse_spec("none"))
    assert bank.kind_for("a") == "none"
    bank.forget("a")
    assert bank.kind_for("a") == "ewmean"


@pytest.mark.usefixtures("test_kinds")
def test_an_override_in_a_shared_bank_gets_its_own_model_without_the_one_hot() -> None:
    bank = ModelBank("recorder", sharing="shared").with_override("w2", parse_spec("recorder"))
    bank.learn("w1", X, 1.0)
    bank.learn("w2", X, 1.0)
    assert sorted(bank._models) == ["*", "w2"]
    assert bank._models["w2"].seen == [X]


def test_bank_pickles_with_its_models_and_errors() -> None:
    bank = ModelBank("linear", sharing="shared")
    rng = random.Random(3)
    for _ in range(100):
        bank.learn(rng.choice("ab"), random_features(rng), rng.uniform(0, 500))
    copy = pickle.loads(pickle.dumps(bank))
    probe = random_features(rng)
    assert copy.predict("a", probe) == bank.predict("a", probe)
    assert copy.status() == bank.status()


def test_status_reports_what_each_workers_model_learned() -> None:
    """``ewmean`` reports its residual, ``ratio`` its factor (as learned, and as routing
    prices it now); a failing report is left out."""
    bank = ModelBank("ewmean")
    for _ in range(50):
        bank.learn("a", X, 120.0)
        bank.learn("b", X, 30.0)
    learned = bank.status()["per_worker_learned"]
    assert learned.keys() == {"a", "b"}
    assert learned["a"]["residual_ms"] == pytest.approx(120.0)
    assert learned["b"]["residual_ms"] == pytest.approx(30.0)

    ratio = ModelBank("ratio")
    for estimate in (100.0, 1000.0, 5000.0) * 20:
        ratio.learn("slow", {"estimate_ms": estimate}, 1.5 * estimate)  # 2.5x the estimate
    # ``factor_in_use``: what routing prices now (the same while the worker is fresh and
    # alone); ``own_weight``: how much of its own factor that is.
    assert ratio.status()["per_worker_learned"] == {
        "slow": {
            "factor": pytest.approx(2.5),
            "factor_in_use": pytest.approx(2.5),
            "own_weight": pytest.approx(1.0),
        }
    }

    class Broken:
        def predict_one(self, x: dict) -> float:
            return 0.0

        def learn_one(self, x: dict, y: float) -> None:
            pass

        def learned(self) -> dict[str, float]:
            raise RuntimeError("boom")

    ratio._models["broken"] = Broken()
    assert set(ratio.learned()) == {"slow"}


def test_a_ratio_fades_toward_the_fleets_while_its_worker_gets_no_outcomes() -> None:
    """A worker priced out of traffic by a bad start (a cold first request) must be tried
    again: while it gets no outcomes its learned factor (``ratio``) fades toward the fleet's,
    by half per ``memory`` (10) of its fair share of the fleet's outcomes; a worker that
    keeps getting outcomes is not affected."""
    from models.bank import STALE_AFTER

    x = {"estimate_ms": 100.0}
    bank = ModelBank("ratio")
    bank.learn("cold", x, 900.0)  # one slow start: 10x the estimate
    assert bank.predict("cold", x) == pytest.approx(900.0, rel=1e-4)
    fresh = int(STALE_AFTER * 10 * 2)  # two workers: fresh for half a memory of turns
    for _ in range(fresh):
        bank.learn("busy", x, 0.0)  # at the estimate: factor 1
    assert bank.predict("cold", x) == pytest.approx(900.0, rel=1e-4)
    for _ in range(20 - fresh):  # 20 outcomes since its last: a memory (10) x 2 workers
        bank.learn("busy", x, 0.0)
    assert bank.predict("busy", x) == pytest.approx(0.0, abs=1e-6)  # refreshed every outcome
    # Half its log factor, half the fleet's: sqrt(10) x the estimate.
    assert bank.predict("cold", x) == pytest.approx((10**0.5 - 1) * 100.0, rel=0.02)
    # Operators see the factor learned and the one routing prices now.
    learned = bank.status()["per_worker_learned"]
    assert learned["cold"]["factor"] == pytest.approx(10.0, rel=1e-3)
    assert learned["cold"]["factor_in_use"] == pytest.approx(10**0.5, rel=0.02)
    assert learned["busy"]["factor_in_use"] == pytest.approx(learned["busy"]["factor"])
    for _ in range(20):
        bank.learn("busy", x, 0.0)
    assert bank.predict("cold", x) == pytest.approx((10**0.25 - 1) * 100.0, rel=0.02)
    faded = bank.predict("cold", x)
    # Tried again at the fleet's speed: it learns on from the faded factor, not from 10x.
    bank.learn("cold", x, 0.0)
    assert bank.predict("cold", x) < faded

    # The paper's ewmean is left as the paper has it.
    paper = ModelBank("ewmean")
    paper.learn("cold", X, 5000.0)
    for _ in range(400):
        paper.learn("busy", X, 50.0)
    assert paper.predict("cold", X) == pytest.approx(5000.0)


def test_a_stale_factor_fades_toward_a_fleet_faster_than_the_prior() -> None:
    """On a fleet faster than the estimate's prior every fresh factor is below 1 (here 0.5):
    a stale worker's factor fades toward that, not toward 1, which would keep it 2x dearer
    than its peers, priced out for good."""
    x = {"estimate_ms": 100.0}
    bank = ModelBank("ratio")
    bank.learn("cold", x, 300.0)  # one slow start: 4x the estimate
    for _ in range(400):
        for worker in ("a", "b", "c"):
            bank.learn(worker, x, -50.0)  # half the estimate
    assert bank.predict("a", x) == pytest.approx(-50.0, abs=1e-6)
    assert bank.predict("cold", x) == pytest.approx(-50.0, abs=1.0)


def test_a_worker_that_keeps_its_share_never_fades() -> None:
    """Workers taking turns (a fleet of 4 refreshing each worker every 4 outcomes) keep the
    factor they learned, different factors included (a slower worker stays slower)."""
    x = {"estimate_ms": 100.0}
    bank = ModelBank("ratio")
    for _ in range(200):
        for worker, y in (("slow", 100.0), ("a", 0.0), ("b", 0.0), ("c", 0.0)):
            bank.learn(worker, x, y)
    assert bank.predict("slow", x) == pytest.approx(100.0, rel=1e-3)  # 2x, not faded
    assert bank.predict("a", x) == pytest.approx(0.0, abs=1e-6)


def test_a_worker_added_to_a_fast_fleet_starts_at_the_fleets_factor() -> None:
    """A worker that has learned nothing yet (scaled out into a running fleet) is priced at
    the fleet's factor, not the prior's 1: on a fleet at half the estimate that 1 would make
    it look twice as slow, and it would get no traffic to learn from."""
    x = {"estimate_ms": 100.0}
    bank = ModelBank("ratio")
    assert bank.predict("new", x) == 0.0  # an empty fleet: the estimate as it is
    for _ in range(50):
        for worker in ("a", "b"):
            bank.learn(worker, x, -50.0)
    assert bank.predict("new", x) == pytest.approx(-50.0, abs=1e-6)
    bank.learn("new", x, 100.0)  # its own first outcome (2x the estimate) counts whole
    assert bank.predict("new", x) == pytest.approx(100.0, rel=1e-3)


def test_a_stale_worker_that_is_still_slow_is_priced_out_again_at_once() -> None:
    """The faded share of a factor is a guess: the worker's next outcome replaces it whole
    (and moves the rest at the usual gain), so one still slow is not priced half-way to the
    fleet for several more outcomes, and one that recovered is priced by what it does now."""
    x = {"estimate_ms": 100.0}
    bank = ModelBank("ratio")
    bank.learn("slow", x, 900.0)  # 10x the estimate
    for _ in range(40):  # two workers: 40 outcomes since its last, its own factor at 1/4
        bank.learn("busy", x, 0.0)
    assert bank.predict("slow", x) == pytest.approx((10**0.25 - 1) * 100.0, rel=0.02)
    bank.learn("slow", x, 900.0)  # still 10x
    # Its gain is 1 - 1/4 x (1 - 1/1.9) = 0.88, not the usual 1/1.9 after one outcome: log
    # factor 0.58 -> 0.58 + 0.88 x (2.30 - 0.58) = 2.10, 8.2x (from the faded one: 4.4x).
    assert bank.status()["per_worker_learned"]["slow"]["factor"] == pytest.approx(8.2, rel=0.02)
    bank.learn("slow", x, 0.0)  # recovered: at the estimate, the factor falls at the usual gain
    assert bank.status()["per_worker_learned"]["slow"]["factor"] < 8.2


SHRINK = {"kind": "ratio", "params": {"shrink": True}}


def _noisy_fleet(bank: ModelBank, factors: dict[str, float], rounds: int, seed: int) -> None:
    """Outcomes whose latency is ``factor`` x the estimate times a log-normal noise (sd 0.5
    in log), one per worker in turn, as a fleet sharing the traffic evenly."""
    rng = random.Random(seed)
    for _ in range(rounds):
        for worker, factor in factors.items():
            estimate = rng.uniform(100.0, 5000.0)
            latency = factor * estimate * rng.lognormvariate(0.0, 0.5)
            bank.learn(worker, {"estimate_ms": estimate}, latency - estimate)


def test_equal_workers_share_the_fleets_factor_instead_of_their_noise() -> None:
    """Ten outcomes of noise make four equal workers' factors differ by tens of percent; the
    bank with ``shrink`` prices each near the fleet's, so LBGR does not route on that noise.
    Without it (the default) each keeps its own."""
    spreads, raw_spreads = [], []
    for seed in range(20):
        bank = ModelBank(SHRINK)
        _noisy_fleet(bank, dict.fromkeys("abcd", 1.0), rounds=60, seed=seed)
        learned = bank.learned()
        in_use = [math.log(v["factor_in_use"]) for v in learned.values()]
        raw = [math.log(v["factor"]) for v in learned.values()]
        spreads.append(max(in_use) - min(in_use))
        raw_spreads.append(max(raw) - min(raw))
    assert sum(raw_spreads) / 20 > 0.2  # the noise: over 20% apart
    assert sum(spreads) / 20 < 0.4 * sum(raw_spreads) / 20

    plain = ModelBank("ratio")
    _noisy_fleet(plain, dict.fromkeys("abcd", 1.0), rounds=60, seed=0)
    for values in plain.learned().values():
        assert values["factor_in_use"] == pytest.approx(values["factor"])
        assert values["own_weight"] == 1.0


def test_a_worker_that_really_is_slower_keeps_its_factor() -> None:
    """A worker at half speed (factor 2) stands out of the same noise: it keeps most of its
    own factor, and is priced about twice its peers (over 10 fleets; its ten-outcome factor
    is itself noisy, so one fleet may see it at 1.7x peers at 1.2x)."""
    weights, prices = [], []
    for seed in range(10):
        bank = ModelBank(SHRINK)
        _noisy_fleet(bank, {"a": 1.0, "b": 1.0, "c": 1.0, "slow": 2.0}, rounds=60, seed=seed)
        learned = bank.learned()
        weights.append(learned["slow"]["own_weight"])
        peers = sum(math.log(learned[w]["factor_in_use"]) for w in "abc") / 3
        prices.append(math.exp(math.log(learned["slow"]["factor_in_use"]) - peers))
        x = {"estimate_ms": 1000.0}
        assert bank.predict("slow", x) > bank.predict("a", x)
    assert sorted(weights)[5] > 0.85
    assert 1.7 < sum(prices) / 10 < 2.3


def test_ratio_reports_its_noise_and_keeps_it_in_its_state() -> None:
    """``evidence``: the variance of the factor over one outcome's (1 after one outcome,
    (1 - f) / (1 + f) after many); ``dispersion``: one outcome's variance of the log factor.
    Both survive ``state`` / ``load_state``; a state from before them loads as a memory of
    outcomes."""
    from models import RatioResidual

    model = RatioResidual()
    assert model.evidence == math.inf
    assert model.dispersion is None
    model.learn_one({"estimate_ms": 100.0}, 0.0)
    assert model.evidence == pytest.approx(1.0)
    assert model.dispersion is None
    rng = random.Random(3)
    for _ in range(400):
        model.learn_one({"estimate_ms": 100.0}, 100.0 * rng.lognormvariate(0.0, 0.5) - 100.0)
    assert model.evidence == pytest.approx(0.1 / 1.9, rel=1e-6)
    assert 0.12 < model.dispersion < 0.45  # sd 0.5: variance 0.25, ten outcomes' worth
    copy = RatioResidual()
    copy.load_state(model.state())
    assert copy.state() == model.state()
    legacy = RatioResidual()
    legacy.load_state({"theta": 0.3, "p": 0.1})  # a snapshot of the steady state, 0.1 = 1 - f
    assert legacy.factor == pytest.approx(math.exp(0.3))
    assert legacy.evidence == pytest.approx(0.1 / 1.9, rel=1e-6)
    with pytest.raises(ValueError, match="finite"):
        legacy.load_state({"theta": 0.3, "p": 0.1, "w1": -1, "w2": 1, "mean": 0, "spread": 0})
