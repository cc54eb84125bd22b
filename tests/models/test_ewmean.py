"""``ewmean`` is the paper's residual model: RLS on a bias feature, forgetting 0.95, P0 = 1e6.

``Rls4`` below is a literal port of ``struct Rls4`` in the paper's router
(``sgl-router/src/router.rs``: a 4x4 covariance, ``phi = [1, 0, 0, 0]``, only the bias
coefficient learns); ``EWMeanResidual`` is its scalar reduction and must agree with it.
"""

from __future__ import annotations

import random

import pytest

from models import EWMeanResidual, ModelSpecError, make_model

PHI_BIAS = (1.0, 0.0, 0.0, 0.0)


class Rls4:
    """The paper code's ``Rls4``, operation for operation (lists instead of arrays)."""

    def __init__(self, lam: float = 0.95, p0: float = 1e6) -> None:
        self.theta = [0.0, 0.0, 0.0, 0.0]
        self.p = [[p0 if i == j else 0.0 for j in range(4)] for i in range(4)]
        self.lam = lam
        self.learn_mask = [True, False, False, False]

    def predict(self, phi: tuple[float, ...]) -> float:
        t = self.theta
        return t[0] * phi[0] + t[1] * phi[1] + t[2] * phi[2] + t[3] * phi[3]

    def update(self, phi: tuple[float, ...], y: float) -> None:
        p = self.p
        pphi = [p[i][0] * phi[0] + p[i][1] * phi[1] + p[i][2] * phi[2] + p[i][3] * phi[3]
                for i in range(4)]  # fmt: skip
        denom = self.lam + sum(phi[i] * pphi[i] for i in range(4))
        k = [pphi[i] / denom for i in range(4)]
        for i in range(4):
            if not self.learn_mask[i]:
                k[i] = 0.0
        err = y - self.predict(phi)
        for i in range(4):
            if self.learn_mask[i]:
                self.theta[i] += k[i] * err
        kphi_p = [[0.0] * 4 for _ in range(4)]
        for i in range(4):
            for j in range(4):
                if self.learn_mask[i]:
                    kphi_p[i][j] = k[i] * (
                        phi[0] * p[0][j] + phi[1] * p[1][j] + phi[2] * p[2][j] + phi[3] * p[3][j]
                    )
        for i in range(4):
            for j in range(4):
                p[i][j] = (p[i][j] - kphi_p[i][j]) / self.lam


def residual_stream(seed: int, n: int) -> list[float]:
    """Residuals as LBGR trains on them: >= 1 ms, heavy-tailed, with a level shift midway."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        level = 80.0 if i < n // 2 else 400.0
        out.append(max(1.0, rng.lognormvariate(0.0, 0.8) * level))
    return out


@pytest.mark.parametrize(("forgetting", "p0"), [(0.95, 1e6), (0.9, 100.0), (0.99, 1e3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_the_paper_rls_on_a_bias_feature(forgetting: float, p0: float, seed: int) -> None:
    ours = make_model({"kind": "ewmean", "params": {"forgetting": forgetting, "p0": p0}})
    paper = Rls4(forgetting, p0)
    rng = random.Random(seed)
    warm_up = 5
    for step, y in enumerate(residual_stream(seed, 2000)):
        x = {"queue_ms": rng.uniform(0, 5000), "uncached_k": rng.uniform(0, 8)}  # ignored
        if step >= warm_up:
            assert ours.predict_one(x) == pytest.approx(paper.predict(PHI_BIAS), abs=1e-6)
        ours.learn_one(x, y)
        paper.update(PHI_BIAS, y)
    assert ours.predict_one({}) == pytest.approx(paper.predict(PHI_BIAS), abs=1e-6)


def test_default_is_the_paper_setting() -> None:
    model = make_model("ewmean")
    assert isinstance(model, EWMeanResidual)
    assert (model.forgetting, model.p0) == (0.95, 1e6)


def test_first_sample_is_taken_almost_whole_then_the_gain_settles_at_five_percent() -> None:
    model = EWMeanResidual()
    model.learn_one({}, 100.0)
    assert model.predict_one({}) == pytest.approx(100.0, rel=1e-6)  # P0 = 1e6: no shrinkage
    for _ in range(400):
        model.learn_one({}, 100.0)
    before = model.predict_one({})
    model.learn_one({}, 200.0)
    assert model.predict_one({}) - before == pytest.approx(0.05 * (200.0 - before), rel=1e-6)


def test_ignores_features() -> None:
    model = EWMeanResidual()
    for y in (10.0, 20.0, 30.0):
        model.learn_one({"queue_ms": y}, y)
    assert model.predict_one({}) == model.predict_one({"queue_ms": 1e9, "in_flight": 3.0})


@pytest.mark.parametrize("params", [{"forgetting": 0.0}, {"forgetting": 1.5}, {"p0": 0.0}])
def test_bad_params_are_spec_errors(params: dict[str, float]) -> None:
    with pytest.raises(ModelSpecError, match="bad params for model kind 'ewmean'"):
        make_model({"kind": "ewmean", "params": params})
