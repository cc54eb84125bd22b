"""``ratio``: a worker's latency as a learned multiple of the router's own estimate.

``ewmean`` learns how many milliseconds a worker adds to the estimate, one constant for every
request. A worker that is slower (a smaller GPU, a noisy neighbour, thermal throttling) does
not add a constant: it takes *longer per unit of work*, so its excess grows with the request
and the queue in front of it. ``ratio`` learns that factor. With ``e`` the router's estimate
for the chosen worker (feature ``estimate_ms``: LBGR's ``base + alpha * queue``) and ``y`` the
residual it trained on, the observed factor is ``rho = (y + e) / e`` (the latency over the
estimate); the model keeps an exponentially weighted mean of ``log(rho)`` (an ``ewmean``
inside: the paper's RLS on a bias feature, with forgetting and P0) and predicts the residual
``(exp(mean) - 1) * e``.

Why the log: latencies are heavy-tailed (one request stuck behind a long prefill is 10x its
estimate), and an arithmetic mean of factors would chase those; the geometric mean does not.
On a homogeneous fleet every worker learns about the same factor, which scales every
worker's prediction alike and leaves LBGR's ranking (and its cache stickiness) as the plain
estimate makes it, while ``linear`` and ``tree`` re-price cached against uncached tokens for
the chosen worker only (``benchmarks/residual_models.py``). *About* the same: a factor of ten
outcomes carries their noise (tens of percent between equal workers), and LBGR ranks on it.
``shrink`` (off by default) has ``ModelBank`` shrink each worker's factor toward the fleet's
by how much of the spread between the workers their noise explains (``evidence`` and
``dispersion`` are what it reads): equal workers then share the fleet's factor, a worker that
really is slower keeps its own. On the robustness matrix it trades tail for median (mean p50
over the best baseline's 0.858x -> 0.855x, p95 0.606x -> 0.617x; ``docs/routing.md``, *The
factor's noise*), so the default keeps each worker's own.

What it cannot learn: a constant offset that does not grow with the estimate (that is
``ewmean``'s job). Its check in the shared suite is a constant *factor* instead.

>>> m = RatioResidual()
>>> for e in (100.0, 400.0, 900.0):
...     m.learn_one({"estimate_ms": e}, 2.0 * e)  # latency 3x the estimate
>>> round(m.predict_one({"estimate_ms": 50.0}), 3)
100.0
>>> fast = RatioResidual()
>>> fast.learn_one({"estimate_ms": 400.0}, -300.0)  # latency a quarter of the estimate
>>> round(fast.factor, 3), round(fast.predict_one({"estimate_ms": 80.0}), 3)
(0.25, -60.0)
"""

from __future__ import annotations

import math

from river import base

from models.base import Features
from models.ewmean import EWMeanResidual

__all__ = ["RatioResidual"]

_MAX_STEP_LOG = math.log(16.0)  # what one outcome may say, at most, of a worker's factor
_MIN_RATIO = 1e-3


class RatioResidual(base.Regressor):
    """Per worker: geometric mean (exponentially weighted) of latency / estimate.

    ``forgetting`` plays ``ewmean``'s role (0.9: an effective memory of about the worker's
    last 10 outcomes); ``p0`` is the RLS prior. On a fleet of equal workers the factor is the
    worker's recent state that the router's estimate misses (answers longer than the mean it
    expects, a prefill it priced short): a memory of ~100 outcomes kept a worker's factor high
    for minutes after its slow requests had left, which priced it out of traffic it could
    serve (robustness matrix, ``docs/routing.md``: Azure conversation's p50 at 90% load 1.08x
    with 0.99, 1.03-1.04x with 0.9; long documents 1.11x -> 1.01x with lru). A worker that is
    slower for good still shows in every outcome. One outcome counts as at most 16x (or
    1/16x) the estimate, so a single stalled request cannot set a factor of 1,000. An
    ``estimate_ms`` that is missing, not a number or below 1 ms counts as 1 ms. (A factor
    learned from a slow start, on a worker that then gets no traffic to correct it, fades
    toward the fleet's factor as the fleet's outcomes go by: ``ModelBank``'s staleness,
    ``log_factor`` and ``predict_faded``.)

    The residual is *signed* (``signed = True``): LBGR trains it on ``latency - estimate``
    itself, not floored at 1 ms, and it may predict a negative residual. A fleet faster than
    the estimate's prior (an H100 where the prior is an L40) then learns factors below 1, and
    a slow worker among fast ones still stands out.
    """

    signed = True
    fades = True  # ModelBank fades a factor its worker has not refreshed (``predict_faded``)

    def __init__(self, forgetting: float = 0.9, p0: float = 1e6, shrink: bool = False) -> None:
        if not isinstance(shrink, bool):
            raise ValueError(f"shrink must be true or false, got {shrink!r}")
        self.forgetting = forgetting
        self.p0 = p0
        self.shrink = shrink  # ModelBank shrinks the factor toward the fleet's (``_shrink``)
        self._log_mean = EWMeanResidual(forgetting, p0)  # validates both; the same recursion
        # The outcomes' weights (lambda^age: their sum and the sum of their squares) and the
        # weighted mean and sum of squared deviations of their log factors (West's update):
        # how much a factor's own noise is, for the bank's shrinkage.
        self._w1 = self._w2 = self._mean = self._spread = 0.0

    @staticmethod
    def _estimate(x: Features) -> float:
        value = x.get("estimate_ms", 1.0)
        try:
            value = float(value)
        except (TypeError, ValueError):
            return 1.0
        return value if math.isfinite(value) and value > 1.0 else 1.0

    @property
    def factor(self) -> float:
        """Latency over estimate, as learned so far (1.0 before any outcome)."""
        return math.exp(self._log_mean.predict_one({}))

    @property
    def log_factor(self) -> float:
        """``log(factor)``: what the bank averages over the fleet (a geometric mean)."""
        return self._log_mean.predict_one({})

    @property
    def memory(self) -> float:
        """Outcomes the factor effectively remembers (10 at forgetting 0.9)."""
        return 1.0 / max(1e-9, 1.0 - self.forgetting)

    def learn_one(self, x: Features, y: float) -> None:
        if not math.isfinite(y):
            return
        # y is latency - estimate: the factor is (y + e) / e, below 1 for a worker faster
        # than the estimate (kept above 1e-3: a latency is never quite zero).
        ratio = max(_MIN_RATIO, 1.0 + y / self._estimate(x))
        value = max(-_MAX_STEP_LOG, min(math.log(ratio), _MAX_STEP_LOG))
        self._log_mean.learn_one({}, value)
        lam = self.forgetting
        self._w1 = lam * self._w1 + 1.0
        self._w2 = lam * lam * self._w2 + 1.0
        delta = value - self._mean
        self._mean += delta / self._w1
        self._spread = lam * self._spread + delta * (value - self._mean)

    @property
    def evidence(self) -> float:
        """The variance of the learned log factor over one outcome's (``sum w^2 / (sum w)^2``
        of the outcomes' weights): 1 after one outcome, ``(1 - f) / (1 + f)`` (0.053 at
        forgetting 0.9) after many; infinite before any."""
        return self._w2 / (self._w1 * self._w1) if self._w1 > 0.0 else math.inf

    @property
    def dispersion(self) -> float | None:
        """The variance of one outcome's log factor (weighted, unbiased), or None before
        two outcomes."""
        if self._w1 <= 0.0:
            return None
        denominator = self._w1 - self._w2 / self._w1
        return self._spread / denominator if denominator > 1e-9 else None

    def predict_one(self, x: Features) -> float:
        return math.expm1(self._log_mean.predict_one({})) * self._estimate(x)

    def _faded_log(self, weight: float, fleet_log_factor: float) -> float:
        return weight * self.log_factor + (1.0 - weight) * fleet_log_factor

    def faded_factor(self, weight: float, fleet_log_factor: float) -> float:
        """The factor faded toward the fleet's (``predict_faded``), for operators."""
        return math.exp(self._faded_log(weight, fleet_log_factor))

    def predict_faded(self, x: Features, weight: float, fleet_log_factor: float) -> float:
        """The residual with the factor faded toward the fleet's: ``weight`` of this
        worker's log factor, the rest the fleet's (``ModelBank``, for a worker whose factor
        is old). Toward the fleet's, not toward 1: on a fleet faster than the prior (factors
        near 0.5) a factor faded to 1 would still price its worker out."""
        return math.expm1(self._faded_log(weight, fleet_log_factor)) * self._estimate(x)

    def fade(self, weight: float, fleet_log_factor: float) -> None:
        """Keep the faded factor (``predict_faded``) as the learned one, and as uncertain as
        it is faded: the bank calls this before a stale worker's next outcome, which then
        counts for the faded share (``1 - weight``) whole and for the rest as any outcome
        does. So a worker that recovered from a stall is priced by what it does now, and one
        that is still slow is priced out again at once, not from a factor half-way to the
        fleet's."""
        state = self._log_mean.state()
        faded = self._faded_log(weight, fleet_log_factor)  # state["theta"] is log_factor
        lam, p = self.forgetting, state["p"]
        gain = 1.0 - weight * lam / (lam + p)  # the next outcome's weight (k = p / (lam + p))
        p = self.p0 if gain >= 1.0 else min(self.p0, gain * lam / (1.0 - gain))
        self._log_mean.load_state({"theta": faded, "p": max(p, state["p"])})
        # The faded share is the fleet's, not this worker's: its own outcomes weigh less
        # against the next one, as if fewer (``evidence`` grows by 1 / weight).
        self._w1 *= weight
        self._w2 *= weight * weight
        self._spread *= weight
        self._mean = faded

    def learned(self) -> dict[str, float]:
        """What the model holds, for operators: "worker X runs at 2.1x the estimate"."""
        return {"factor": self.factor}

    def state(self) -> dict[str, float]:
        """The learned state as plain numbers (model snapshots store these, not a pickle)."""
        return {
            **self._log_mean.state(),
            "w1": self._w1,
            "w2": self._w2,
            "mean": self._mean,
            "spread": self._spread,
        }

    def load_state(self, state: dict[str, float]) -> None:
        self._log_mean.load_state(state)
        if "w1" not in state:  # a snapshot from before the shrinkage: RLS's p is 1 / sum w
            lam = self.forgetting
            w1 = min(1e6, 1.0 / self._log_mean.state()["p"])
            steady = w1 * w1 * (1.0 - lam) / (1.0 + lam)  # sum w^2 of that many outcomes
            w2 = min(w1, max(1.0, steady)) if w1 >= 1.0 else w1 * w1
            extra = {"w1": w1, "w2": w2, "mean": self.log_factor, "spread": 0.0}
        else:
            extra = {k: float(state[k]) for k in ("w1", "w2", "mean", "spread")}
        w1, w2, mean, spread = extra["w1"], extra["w2"], extra["mean"], extra["spread"]
        if not all(math.isfinite(v) for v in (w1, w2, mean, spread)) or min(w1, w2, spread) < 0:
            raise ValueError(f"ratio state must be finite and non-negative, got {state}")
        self._w1, self._w2, self._mean, self._spread = w1, w2, mean, spread
