"""The shared check suite, River style: every registered model kind passes the same tests.

Parametrized over ``models.model_kinds()`` at collection time, so a kind added through the
``kvroute.models`` entry points is checked too. The learned-offset check has one exception:
``none`` must *stay* at 0 (it is the no-learning baseline), which is asserted explicitly, and
a multiplicative kind (``ratio``: latency = factor x the router's estimate) learns a constant
*factor* instead, checked with the same tolerance on a stream of its own.

Raw robustness. ``RAW_ROBUST`` lists the kinds whose own ``predict_one`` stays finite on
extreme inputs (features and targets drawn from 1e9, 1e-9 and 0): all five built-ins do
(``ewmean`` averages, ``linear`` standardises features and clips its gradient, ``tree``
standardises and averages in leaves, ``ratio`` bounds its log factor, ``none`` is constant).
A kind not listed is still safe to route with, because ``ModelBank.predict`` turns a failure,
NaN or infinity into 0 and clamps to >= 0; that guarantee is checked for every kind.
"""

from __future__ import annotations

import inspect
import math
import pickle
import random
from typing import Any

import pytest
from model_support import random_features

from models import ModelBank, ResidualModel, make_model, model_kinds
from router_service.routing.features import FEATURE_NAMES

KINDS = model_kinds()
LEARNING_KINDS = [k for k in KINDS if k != "none"]
RAW_ROBUST = frozenset({"ewmean", "linear", "none", "ratio", "tree"})
# Kinds that learn latency as a multiple of the estimate (feature ``estimate_ms``), not an
# added constant: the constant-offset check becomes a constant-factor check for them.
MULTIPLICATIVE = frozenset({"ratio"})
EXTREMES = (1e9, 1e-9, 0.0)


def stream(seed: int, n: int, target: float | None = None) -> list[tuple[dict, float]]:
    """``n`` (features, residual ms) pairs; the residual depends on the features by default."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        x = random_features(rng)
        y = target if target is not None else 50.0 + 0.2 * x["queue_ms"] + 30.0 * x["uncached_k"]
        out.append((x, y + (rng.gauss(0.0, 5.0) if target is None else 0.0)))
    return out


def trained(kind: str, pairs: list[tuple[dict, float]]) -> Any:
    model = make_model(kind)
    for x, y in pairs:
        model.learn_one(x, y)
    return model


def test_the_suite_covers_the_builtins_and_real_feature_names() -> None:
    assert {"ewmean", "linear", "ratio", "tree", "none"} <= set(KINDS)
    assert set(KINDS) >= MULTIPLICATIVE
    assert set(random_features(random.Random(0))) == set(FEATURE_NAMES)
    assert set(KINDS) >= RAW_ROBUST


@pytest.mark.parametrize("kind", KINDS)
def test_follows_the_protocol_and_stores_params_under_their_own_names(kind: str) -> None:
    model = make_model(kind)
    assert isinstance(model, ResidualModel)
    for name in inspect.signature(type(model)).parameters:
        assert hasattr(model, name), f"{kind}: parameter {name!r} is not stored as .{name}"


@pytest.mark.parametrize("kind", KINDS)
def test_pickle_round_trip_predicts_and_learns_identically(kind: str) -> None:
    pairs = stream(1, 150)
    model = trained(kind, pairs)
    copy = pickle.loads(pickle.dumps(model))
    probes = [x for x, _ in stream(2, 30)]
    assert [copy.predict_one(x) for x in probes] == [model.predict_one(x) for x in probes]
    for x, y in stream(3, 50):  # the learned state, not only the output, survived
        model.learn_one(x, y)
        copy.learn_one(x, y)
    assert [copy.predict_one(x) for x in probes] == [model.predict_one(x) for x in probes]


@pytest.mark.parametrize("kind", KINDS)
def test_clone_is_fresh_unfitted_with_the_same_params(kind: str) -> None:
    model = make_model(kind)
    pairs = stream(4, 150)
    for x, y in pairs:
        model.learn_one(x, y)
    clone = model.clone()
    assert type(clone) is type(model)
    assert clone._get_params() == model._get_params()
    probes = [x for x, _ in stream(5, 20)]
    fresh = make_model(kind)
    assert [clone.predict_one(x) for x in probes] == [fresh.predict_one(x) for x in probes]
    if kind != "none":
        assert [clone.predict_one(x) for x in probes] != [model.predict_one(x) for x in probes]
    before = [model.predict_one(x) for x in probes]
    for x, y in pairs[:50]:  # the clone shares no state with the original
        clone.learn_one(x, y)
    assert [model.predict_one(x) for x in probes] == before


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_given_seed(kind: str) -> None:
    pairs = stream(6, 200)
    a, b = make_model(kind), make_model(kind)
    out_a, out_b = [], []
    for x, y in pairs:
        out_a.append(a.predict_one(x))
        out_b.append(b.predict_one(x))
        a.learn_one(x, y)
        b.learn_one(x, y)
    assert out_a == out_b


@pytest.mark.parametrize("offset_ms", [5.0, 250.0, 3000.0])
@pytest.mark.parametrize("kind", KINDS)
def test_learns_a_constant_offset(kind: str, offset_ms: float) -> None:
    model = trained(kind, stream(7, 300, target=offset_ms))
    preds = [model.predict_one(x) for x, _ in stream(8, 50)]
    if kind == "none":
        assert preds == [0.0] * len(preds)  # the no-learning baseline never moves
        return
    if kind in MULTIPLICATIVE:
        # It cannot represent an added constant (that is ewmean's job; the constant-factor
        # check below is its analogue): it learns one factor, so its residual is positive and
        # grows with the probe's estimate.
        probes = sorted(stream(8, 50), key=lambda pair: pair[0]["estimate_ms"])
        ordered = [model.predict_one(x) for x, _ in probes]
        assert ordered[0] > 0.0
        assert ordered == sorted(ordered)
        assert ordered[-1] > ordered[0]
        return
    assert all(p == pytest.approx(offset_ms, rel=0.01) for p in preds), (min(preds), max(preds))


@pytest.mark.parametrize("factor", [1.05, 2.0, 10.0])
@pytest.mark.parametrize("kind", sorted(MULTIPLICATIVE))
def test_multiplicative_kinds_learn_a_constant_factor(kind: str, factor: float) -> None:
    """Their analogue of the constant offset: latency = factor x estimate, for any estimate."""
    pairs = [(x, (factor - 1.0) * x["estimate_ms"]) for x, _ in stream(7, 300)]
    model = trained(kind, pairs)
    for x, _ in stream(8, 50):
        expected = (factor - 1.0) * x["estimate_ms"]
        assert model.predict_one(x) == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("kind", KINDS)
def test_handles_missing_features(kind: str) -> None:
    model = trained(kind, stream(9, 150))
    rng = random.Random(10)
    partial = {k: v for k, v in random_features(rng).items() if k in ("queue_ms", "prompt_k")}
    unknown = {"never_seen": 3.0}
    for x in ({}, partial, unknown):
        value = model.predict_one(x)
        assert isinstance(value, float)
        assert math.isfinite(value)


def extreme_stream(seed: int, n: int) -> list[tuple[dict, float]]:
    rng = random.Random(seed)
    return [
        ({name: rng.choice(EXTREMES) for name in FEATURE_NAMES}, rng.choice(EXTREMES))
        for _ in range(n)
    ]


@pytest.mark.parametrize("sharing", ["per_worker", "shared"])
@pytest.mark.parametrize("kind", KINDS)
def test_bank_predictions_stay_finite_and_non_negative_on_extremes(kind: str, sharing: str) -> None:
    bank = ModelBank(kind, sharing=sharing)
    for i, (x, y) in enumerate(extreme_stream(11, 200)):
        worker = f"w{i % 2}"
        for probe in (x, {}):
            value = bank.predict(worker, probe)
            assert math.isfinite(value)
            assert value >= 0.0
        error = bank.learn(worker, x, y)
        assert math.isfinite(error)
    mae = bank.mae()
    assert mae is not None
    assert math.isfinite(mae)


@pytest.mark.parametrize("kind", KINDS)
def test_raw_predictions_stay_finite_on_extremes(kind: str) -> None:
    if kind not in RAW_ROBUST:
        pytest.skip(f"{kind!r} is not documented raw-robust; ModelBank guards it")
    for seed in (12, 13):
        model = make_model(kind)
        for x, y in extreme_stream(seed, 200):
            model.learn_one(x, y)
            assert math.isfinite(model.predict_one(x))
        assert math.isfinite(model.predict_one({}))
        for value in EXTREMES:  # a constant extreme fleet, then every feature at one extreme
            assert math.isfinite(model.predict_one(dict.fromkeys(FEATURE_NAMES, value)))
