"""A bank of residual models for a fleet: one per worker (or one shared), with online error.

The bank is what a learning policy talks to. It isolates model failures: a model that raises,
or returns NaN or infinity, counts a failure and predicts 0 (no correction) instead of
crashing routing; a failing ``learn_one`` is counted and skipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from models.base import Features, ResidualModel
from models.online_error import RollingMAE
from models.registry import ModelSpec, make_model, parse_spec

__all__ = ["SHARINGS", "ModelBank"]

SHARINGS = ("per_worker", "shared")
_SHARED_KEY = "*"


class ModelBank:
    """Models of one spec. ``sharing="per_worker"`` keeps one model per worker (the paper's
    choice); ``"shared"`` keeps one model for all workers, with the worker as a one-hot feature.

    ``overrides`` maps a worker to its own spec (per-worker hot swap).
    """

    def __init__(
        self,
        spec: str | Mapping[str, Any] | ModelSpec,
        *,
        sharing: str = "per_worker",
        window: int = 256,
        overrides: Mapping[str, ModelSpec] | None = None,
    ) -> None:
        if sharing not in SHARINGS:
            raise ValueError(f"unknown sharing {sharing!r}; known: {', '.join(SHARINGS)}")
        self.spec = parse_spec(spec)
        self.sharing = sharing
        self.window = window
        self.overrides: dict[str, ModelSpec] = dict(overrides or {})
        self._prototypes: dict[str, ResidualModel] = {}
        self._prototype(self.spec)  # build once now: a bad spec fails here, not on first use
        self._models: dict[str, ResidualModel] = {}
        self._errors: dict[str, RollingMAE] = {}
        self.failures = 0
        self.samples = 0

    def _prototype(self, spec: ModelSpec) -> ResidualModel:
        proto = self._prototypes.get(spec.key)
        if proto is None:
            proto = self._prototypes[spec.key] = make_model(spec)
        return proto

    def spec_for(self, worker: str) -> ModelSpec:
        return self.overrides.get(worker, self.spec)

    def kind_for(self, worker: str) -> str:
        return self.spec_for(worker).kind

    def _key(self, worker: str) -> str:
        return _SHARED_KEY if self.sharing == "shared" and worker not in self.overrides else worker

    def _features(self, worker: str, x: Features) -> Features:
        if self.sharing == "shared" and worker not in self.overrides:
            return {**x, f"worker={worker}": 1.0}
        return x

    def predict(self, worker: str, x: Features) -> float:
        """Predicted residual (ms); 0 when the model fails. Never creates state."""
        model = self._models.get(self._key(worker)) or self._prototype(self.spec_for(worker))
        try:
            value = float(model.predict_one(self._features(worker, x)))
        except Exception:  # noqa: BLE001 - a model must never take routing down
            self.failures += 1
            return 0.0
        if not math.isfinite(value):
            self.failures += 1
            return 0.0
        # Residual targets are >= 1 ms by construction (LBGR trains on max(1, ...)), so a
        # negative prediction is never right; letting it through would make a worker look
        # faster than free and draw traffic it cannot serve.
        return max(0.0, value)

    def learn(self, worker: str, x: Features, y: float) -> float:
        """Train on one outcome; returns the absolute error of the prediction made before."""
        key = self._key(worker)
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = make_model(self.spec_for(worker))
        error = abs(self.predict(worker, x) - y)
        tracker = self._errors.get(worker)
        if tracker is None:
            tracker = self._errors[worker] = RollingMAE(self.window)
        tracker.update(error)
        self.samples += 1
        try:
            model.learn_one(self._features(worker, x), y)
        except Exception:  # noqa: BLE001 - isolate, count, keep routing
            self.failures += 1
        return error

    def mae(self, worker: str | None = None) -> float | None:
        """Rolling MAE (ms) of one worker's predictions, or the sample-weighted fleet MAE."""
        if worker is not None:
            tracker = self._errors.get(worker)
            return tracker.get() if tracker else None
        values = [(t.get(), len(t._errors)) for t in self._errors.values()]
        weight = sum(n for v, n in values if v is not None)
        if not weight:
            return None
        return sum(v * n for v, n in values if v is not None) / weight

    def with_override(self, worker: str, spec: ModelSpec) -> ModelBank:
        """A copy where ``worker`` gets a fresh model of ``spec``; the others keep theirs."""
        clone = ModelBank(
            self.spec,
            sharing=self.sharing,
            window=self.window,
            overrides={**self.overrides, worker: spec},
        )
        clone._models = {k: m for k, m in self._models.items() if k != worker}
        clone._errors = {k: e for k, e in self._errors.items() if k != worker}
        clone.failures, clone.samples = self.failures, self.samples
        return clone

    def forget(self, worker: str) -> None:
        self._models.pop(worker, None)
        self._errors.pop(worker, None)
        self.overrides.pop(worker, None)

    def status(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "sharing": self.sharing,
            "overrides": {w: s.to_dict() for w, s in self.overrides.items()},
            "mae_ms": self.mae(),
            "per_worker_mae_ms": {w: t.get() for w, t in self._errors.items()},
            "samples": self.samples,
            "failures": self.failures,
        }
