"""``ewmean``: the paper's residual model, an exponentially weighted mean of the residual.

The paper's router fits a recursive least squares model on a bias feature with forgetting
factor 0.95 and P0 = 1e6 (``Rls4`` in ``sgl-router/src/router.rs``). With a single constant
feature RLS reduces to the scalar recursion below, which is an exponentially weighted mean
whose early gains are bias-corrected by the large prior P0: the first observation is taken
almost whole, then the gain settles at 1 - forgetting (0.05).
"""

from __future__ import annotations

import math

from river import base

from models.base import Features

__all__ = ["EWMeanResidual"]


class EWMeanResidual(base.Regressor):
    """Scalar RLS on a bias feature: ``theta += k (y - theta)``, ``k = P / (forgetting + P)``.

    >>> m = EWMeanResidual()
    >>> for y in (10.0, 20.0, 30.0):
    ...     m.learn_one({}, y)
    >>> round(m.predict_one({}), 3)
    20.342
    """

    uses_features = False  # a mean of the residual: callers may skip building features

    def __init__(self, forgetting: float = 0.95, p0: float = 1e6) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if p0 <= 0.0:
            raise ValueError(f"p0 must be > 0, got {p0}")
        self.forgetting = forgetting
        self.p0 = p0
        self._theta = 0.0
        self._p = p0

    def learn_one(self, x: Features, y: float) -> None:
        gain = self._p / (self.forgetting + self._p)
        self._theta += gain * (y - self._theta)
        self._p = self._p / (self.forgetting + self._p)

    def predict_one(self, x: Features) -> float:
        return self._theta

    def learned(self) -> dict[str, float]:
        """What the model holds, for operators (``/models``, metrics)."""
        return {"residual_ms": self._theta}

    def state(self) -> dict[str, float]:
        """The learned state as plain numbers (model snapshots store these, not a pickle)."""
        return {"theta": self._theta, "p": self._p}

    def load_state(self, state: dict[str, float]) -> None:
        theta, p = float(state["theta"]), float(state["p"])
        if not (math.isfinite(theta) and math.isfinite(p) and p > 0.0):
            raise ValueError(f"ewmean state must be finite with p > 0, got {state}")
        self._theta, self._p = theta, p
