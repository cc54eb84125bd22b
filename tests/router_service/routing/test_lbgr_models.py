"""LBGR with the residual model registry, driven through the Router as the service drives it."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from models import AdaptiveTreeResidual, ModelSpecError, ScaledLinearResidual
from models import registry as model_registry
from models.base import Features
from router_service.routing import (
    Decision,
    LBGRPolicy,
    ModelInfo,
    Outcome,
    Router,
    RouteRequest,
    WorkerStatus,
    make_policy,
)

URLS = ("http://a", "http://b", "http://c")
SLOW = "http://a"
EXTRA_MS = {"http://a": 400.0, "http://b": 20.0, "http://c": 20.0}  # what base + queue miss


def lbgr(**params: object) -> LBGRPolicy:
    """LBGR on the paper's estimate: these tests are about the residual models, and the
    paper's estimate is the simplest one to reason about (latency = base + queue + extra)."""
    params.setdefault("estimate", "paper")
    policy = make_policy("lbgr", random.Random(0), **params)
    assert isinstance(policy, LBGRPolicy)
    return policy


def additive(worker: str, estimate: float, rng: random.Random) -> float:
    """The default fleet: latency = estimate + the worker's fixed extra + a little noise."""
    return estimate + EXTRA_MS[worker] + rng.uniform(0, 5)


def drive(
    router: Router,
    n: int,
    seed: int = 0,
    latency_of: Callable[[str, float, random.Random], float] = additive,
    max_chars: int = 200,
) -> list[Decision]:
    """``n`` requests, each completed before the next, with ``latency_of(worker, base + queue)``."""
    rng = random.Random(seed)
    decisions = []
    for i in range(n):
        prompt = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(20, max_chars)))
        request = RouteRequest(f"r{seed}-{i}", prompt, prompt_tokens=len(prompt) // 4)
        statuses = [WorkerStatus(u, queue_ms=rng.uniform(0, 50)) for u in URLS]
        decision = router.route(request, statuses, now_ms=float(i))
        cand = decision.candidate(decision.chosen)
        assert cand.base_ms is not None
        assert cand.queue_ms is not None
        latency = latency_of(decision.chosen, cand.base_ms + cand.queue_ms, rng)
        learned = router.complete(decision, Outcome(True, latency, latency / 2))
        assert learned is not None
        decisions.append(decision)
    return decisions


@pytest.mark.parametrize(
    ("spec", "kind", "model_type"),
    [
        ("tree", "tree", AdaptiveTreeResidual),
        ('{"kind": "tree", "params": {"max_depth": 3}}', "tree", AdaptiveTreeResidual),
        ({"kind": "linear", "params": {"lr": 0.01}}, "linear", ScaledLinearResidual),
    ],
)
def test_lbgr_decides_and_learns_with_a_registry_model(
    spec: object, kind: str, model_type: type
) -> None:
    policy = lbgr(model=spec)
    router = Router(policy)
    decisions = drive(router, 150)
    assert all(d.model == ModelInfo(kind, 1) for d in decisions)
    assert decisions[0].to_dict()["model"] == {"kind": kind, "version": 1}
    champion = policy.models.champion
    assert champion.samples == 150
    assert champion.failures == 0
    models = champion._models
    assert models
    assert all(isinstance(m, model_type) for m in models.values())
    if isinstance(spec, str) and spec.startswith("{"):
        assert all(m.max_depth == 3 for m in models.values())
    # It learned that the slow worker's latency is under-estimated, and routes away from it.
    last = decisions[-1]
    slow = last.candidate(SLOW).residual_ms
    fast = min(last.candidate(u).residual_ms or 0.0 for u in URLS if u != SLOW)
    assert slow is not None
    # (what the slow worker learned fades while it gets no traffic: ModelBank's staleness)
    assert slow > fast + 50.0
    late = [d.chosen for d in decisions[-50:]]
    assert late.count(SLOW) < 5


def test_learning_beats_no_learning_on_a_slow_worker() -> None:
    def slow_share(spec: str) -> int:
        decisions = drive(Router(lbgr(model=spec)), 150, seed=3)
        return sum(d.chosen == SLOW for d in decisions[50:])

    assert slow_share("none") > 3 * slow_share("ewmean")


def test_shared_sharing_reaches_the_bank() -> None:
    policy = lbgr(model="linear", sharing="shared")
    drive(Router(policy), 60)
    assert policy.models.champion.sharing == "shared"
    assert list(policy.models.champion._models) == ["*"]


def test_swap_moves_the_version_in_decisions() -> None:
    policy = lbgr(model="ewmean")
    router = Router(policy)
    assert drive(router, 5)[-1].model == ModelInfo("ewmean", 1)
    policy.models.swap("tree")
    assert drive(router, 5, seed=1)[-1].model == ModelInfo("tree", 2)
    policy.models.start_challenger("linear")
    drive(router, 5, seed=2)
    policy.models.promote()
    assert drive(router, 5, seed=4)[-1].model == ModelInfo("linear", 3)


def test_swap_for_one_worker_shows_in_that_workers_decisions() -> None:
    policy = lbgr(model="ewmean")
    router = Router(policy)
    drive(router, 30)
    policy.models.swap("none", worker=SLOW)
    kinds = {d.chosen: d.model for d in drive(router, 100, seed=5)}
    assert kinds[SLOW] == ModelInfo("none", 2)  # residual 0 again, so it is chosen again
    assert kinds["http://b"] == ModelInfo("ewmean", 2)


def test_a_decision_completing_after_a_swap_trains_the_new_champion() -> None:
    policy = lbgr(model="ewmean")
    router = Router(policy)
    request = RouteRequest("r", "hello world", prompt_tokens=3)
    decision = router.route(request, [WorkerStatus(u) for u in URLS], now_ms=0.0)
    policy.models.swap("linear")
    learned = router.complete(decision, Outcome(True, 500.0, 100.0))
    assert learned is not None
    assert policy.models.champion.samples == 1


class Exploding:
    def predict_one(self, x: Features) -> float:
        raise RuntimeError("predict exploded")

    def learn_one(self, x: Features, y: float) -> None:
        raise RuntimeError("learn exploded")


def test_a_model_raising_in_predict_does_not_stop_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    model_registry.model_kinds()
    monkeypatch.setattr(
        model_registry.REGISTRY, "_factories", dict(model_registry.REGISTRY._factories)
    )
    model_registry.register_model("exploding", Exploding)
    policy = lbgr(model="exploding")
    router = Router(policy)
    decisions = drive(router, 20)
    for d in decisions:
        assert d.model == ModelInfo("exploding", 1)
        assert all(c.residual_ms == 0.0 for c in d.candidates)  # routing-safe fallback
    bank = policy.models.champion
    assert bank.samples == 20
    assert bank.failures == 20 * len(URLS) + 20 * 2  # every predict; each learn's predict + learn


def test_an_unknown_model_fails_when_the_policy_is_built() -> None:
    with pytest.raises(ModelSpecError, match="unknown model kind 'nope'; known: "):
        lbgr(model="nope")
    with pytest.raises(ValueError, match="unknown sharing"):
        lbgr(sharing="pooled")


def test_ratio_learns_each_workers_factor_from_the_estimate_lbgr_passes() -> None:
    """A worker that runs 3x slower than the estimate, whatever the request's size: ``ratio``
    learns the factor (``ewmean``'s one constant cannot), from ``estimate_ms`` = base + queue."""
    factors = {"http://a": 3.0, "http://b": 1.0, "http://c": 1.0}
    policy = lbgr(model="ratio")
    decisions = drive(
        Router(policy), 300, seed=5, latency_of=lambda w, e, _: factors[w] * e, max_chars=2000
    )
    for decision in decisions:
        cand = decision.candidate(decision.chosen)
        assert cand.base_ms is not None
        assert cand.queue_ms is not None
        assert decision.features is not None
        assert decision.features["estimate_ms"] == cand.base_ms + cand.queue_ms
    models = policy.models.champion._models
    # Within 5%, not exactly: it was last tried after its factor had faded toward the fleet's
    # (1.0) while it got no outcomes, and one outcome takes the faded share back whole and the
    # rest at the model's usual gain (``RatioResidual.fade``).
    assert models[SLOW].factor == pytest.approx(3.0, rel=0.05)
    fast = [models[u] for u in URLS if u != SLOW and u in models]
    assert fast
    assert all(m.factor == pytest.approx(1.0, abs=0.02) for m in fast)
    assert [d.chosen for d in decisions[:60]].count(SLOW) > 0  # it had its share, then lost it
    assert [d.chosen for d in decisions[-100:]].count(SLOW) < 5
