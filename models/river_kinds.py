"""``linear`` and ``tree``: River learners on the residual, in seconds.

Residual targets are milliseconds and span 1 to 10^4; both learners see them divided by
``target_scale_ms`` (default 1000, i.e. seconds), which keeps SGD steps and leaf models in a
comfortable range without a running target scaler on the hot path.
"""

from __future__ import annotations

from typing import Any

from river import base, linear_model, optim, preprocessing, tree

from models.base import Features

__all__ = ["AdaptiveTreeResidual", "ScaledLinearResidual"]


class _ScaledTarget(base.Regressor):
    """Shared plumbing: a River estimator ``self.model`` that learns ``y / target_scale_ms``."""

    model: Any
    target_scale_ms: float

    def learn_one(self, x: Features, y: float) -> None:
        self.model.learn_one(x, y / self.target_scale_ms)

    def predict_one(self, x: Features) -> float:
        return float(self.model.predict_one(x)) * self.target_scale_ms


class ScaledLinearResidual(_ScaledTarget):
    """``StandardScaler | LinearRegression`` (SGD), River's online linear regression."""

    def __init__(
        self,
        lr: float = 0.02,
        intercept_lr: float = 0.05,
        l2: float = 0.0,
        clip_gradient: float = 10.0,
        target_scale_ms: float = 1000.0,
    ) -> None:
        for name, value in (
            ("lr", lr),
            ("intercept_lr", intercept_lr),
            ("target_scale_ms", target_scale_ms),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if l2 < 0:
            raise ValueError(f"l2 must be >= 0, got {l2}")
        self.lr = lr
        self.intercept_lr = intercept_lr
        self.l2 = l2
        self.clip_gradient = clip_gradient
        self.target_scale_ms = target_scale_ms
        # Latency targets are heavy-tailed (a queue can add tens of seconds at once); clipping
        # the gradient (in target units, i.e. seconds) keeps one outlier from blowing SGD up.
        self.model = preprocessing.StandardScaler() | linear_model.LinearRegression(
            optimizer=optim.SGD(lr), intercept_lr=intercept_lr, l2=l2, clip_gradient=clip_gradient
        )


class AdaptiveTreeResidual(_ScaledTarget):
    """River's Hoeffding adaptive tree regressor: splits on the features, adapts to drift."""

    def __init__(
        self,
        grace_period: int = 50,
        max_depth: int = 6,
        model_selector_decay: float = 0.95,
        target_scale_ms: float = 1000.0,
        seed: int = 42,
    ) -> None:
        if grace_period < 1 or max_depth < 1:
            raise ValueError("grace_period and max_depth must be >= 1")
        if not target_scale_ms > 0:
            raise ValueError(f"target_scale_ms must be > 0, got {target_scale_ms}")
        self.grace_period = grace_period
        self.max_depth = max_depth
        self.model_selector_decay = model_selector_decay
        self.target_scale_ms = target_scale_ms
        self.seed = seed
        self.model = preprocessing.StandardScaler() | tree.HoeffdingAdaptiveTreeRegressor(
            grace_period=grace_period,
            max_depth=max_depth,
            model_selector_decay=model_selector_decay,
            seed=seed,
        )
