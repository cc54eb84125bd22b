"""A bank of residual models for a fleet: one per worker (or one shared), with online error.

The bank is what a learning policy talks to. It isolates model failures: a model that raises,
or returns NaN or infinity, counts a failure and predicts 0 (no correction) instead of
crashing routing; a failing ``learn_one`` is counted and skipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

from models.base import FadingModel, Features, ResidualModel
from models.online_error import RollingMAE
from models.registry import ModelSpec, make_model, parse_spec

__all__ = ["SHARINGS", "ModelBank"]

SHARINGS = ("per_worker", "shared")
# Models that say they fade (``fades = True``: ``ratio``; the paper's ``ewmean`` stays as the
# paper has it) fade a worker's learned factor toward the fleet's while the worker gets no
# outcomes. A worker taking a fair share of a fleet of n is refreshed about every n outcomes
# of the fleet. One whose factor has gone unrefreshed for half a memory of its own outcomes
# (the model's ``memory``: 10 for ``ratio``; ``STALE_AFTER`` of it, 5 turns, 5 * n outcomes
# of the fleet) starts to fade, and its own factor counts half once a whole memory has gone
# by (``memory * n`` outcomes of the fleet). Before that, a worker avoided because it is
# busy keeps what it learned: its factor is what the estimate misses of its state now.
STALE_AFTER = 0.5
_SHARED_KEY = "*"


class ModelBank:
    """Models of one spec. ``sharing="per_worker"`` keeps one model per worker (the paper's
    choice); ``"shared"`` keeps one model for all workers, with the worker as a one-hot feature.

    The one-hot is dense over the workers the shared model has learned on (``worker=a`` is 1.0
    for a's samples and 0.0 for every other worker's): a sparse one (the key only on its own
    worker's samples) is constant wherever present, and River's ``StandardScaler`` maps a
    constant feature to 0, so ``linear`` and ``tree`` could never tell workers apart.

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
        # Untrained models answer for workers that have not learned yet. They are built now,
        # so a bad spec (the default or a per-worker override) fails here, at swap time, and
        # not inside every later routing decision.
        self._default = make_model(self.spec)
        self._override_protos = {w: make_model(s) for w, s in self.overrides.items()}
        self.needs_features = any(
            getattr(model, "uses_features", True)
            for model in (self._default, *self._override_protos.values())
        )
        self._models: dict[str, ResidualModel] = {}
        self._errors: dict[str, RollingMAE] = {}
        self._one_hot: dict[str, dict[str, float]] = {}  # shared: worker -> its one-hot row
        self.failures = 0
        self.samples = 0
        # The fleet's sample count at each model's last outcome: a residual learned long ago
        # (in outcomes of the fleet) says less now, so that a worker priced out of traffic by
        # a bad start is tried again, and corrected (``STALE_AFTER``, ``_fade``).
        self._last_sample: dict[str, int] = {}
        # (fleet samples, models, sum of weighted log factors, sum of weights): _fleet_log_factor
        self._fleet_log: tuple[int, int, float, float] | None = None
        # ((fleet samples, models), _fleet_stats's answer): made once per fleet outcome
        self._fleet_shrink: tuple[tuple[int, int], tuple[float, float] | None] | None = None

    def spec_for(self, worker: str) -> ModelSpec:
        return self.overrides.get(worker, self.spec)

    def kind_for(self, worker: str) -> str:
        return self.spec_for(worker).kind

    def signed_for(self, worker: str) -> bool:
        """Whether ``worker``'s model learns a signed residual (``ratio``)."""
        model = self._models.get(self._key(worker))
        if model is None:
            model = self._override_protos.get(worker, self._default)
        return bool(getattr(model, "signed", False))

    def _key(self, worker: str) -> str:
        return _SHARED_KEY if self.sharing == "shared" and worker not in self.overrides else worker

    def _shares(self, worker: str) -> bool:
        return self.sharing == "shared" and worker not in self.overrides

    def _features(self, worker: str, x: Features) -> Features:
        if not self._shares(worker):
            return x
        one_hot = self._one_hot.get(worker)
        if one_hot is None:  # not learned on yet: the known columns at 0, its own at 1
            one_hot = {**{f"worker={w}": 0.0 for w in self._one_hot}, f"worker={worker}": 1.0}
        return {**x, **one_hot}

    def _set_shared_workers(self, workers: list[str]) -> None:
        # Build the rows aside and replace the dict in one assignment: a concurrent reader sees
        # the old rows or the new ones.
        self._one_hot = {w: {f"worker={v}": float(v == w) for v in workers} for w in workers}

    def predict(self, worker: str, x: Features) -> float:
        """Predicted residual (ms); 0 when the model fails. Never creates state."""
        key = self._key(worker)
        model = self._models.get(key)
        if model is None:  # not ``or``: a model may define ``__len__`` (a River pipeline does)
            model = self._override_protos.get(worker, self._default)
        try:
            weight = self._fade(key, model)
            own = weight * self._shrink(key, model)
            if own < 1.0:
                fleet = self._fleet_log_factor(key, model, weight)
                value = float(cast(FadingModel, model).predict_faded(x, own, fleet))
            else:
                value = float(model.predict_one(self._features(worker, x)))
        except Exception:  # noqa: BLE001 - a model must never take routing down
            self.failures += 1
            return 0.0
        if not math.isfinite(value):
            self.failures += 1
            return 0.0
        # Residual targets are >= 1 ms by construction (LBGR trains on max(1, ...)), so a
        # negative prediction is never right; letting it through would make a worker look
        # faster than free and draw traffic it cannot serve. A signed model (``ratio``) is
        # trained on the signed residual and may go below zero (LBGR floors the prediction).
        return value if getattr(model, "signed", False) else max(0.0, value)

    def _fade(self, key: str, model: Any) -> float:
        """The weight of ``model``'s own factor (1.0: fresh, or a model that does not fade):
        one half per ``memory * n`` outcomes of the fleet since its last, once it has missed
        ``STALE_AFTER * memory`` turns of a fair share (n: the workers with a model). A worker that
        has learned nothing yet (one just added) counts as the fleet (0.0): on a fleet
        faster than the prior, the prior's factor of 1 would keep it out of traffic."""
        if not getattr(model, "fades", False) or self._shares(key):
            return 1.0
        last = self._last_sample.get(key)
        if last is None:  # no model yet: the fleet's; a model restored without its clock: its own
            return 0.0 if key not in self._models else 1.0
        turn = float(model.memory) * max(1, len(self._models))  # outcomes: a memory of turns
        age = self.samples - last
        if age <= STALE_AFTER * turn:
            return 1.0
        return float(0.5 ** (age / turn))

    def _shrink(self, key: str, model: Any) -> float:
        """How much of ``model``'s own factor to believe over the rest of the fleet's (1.0:
        all of it; a model that does not shrink, a shared one, or a fleet of one). A factor
        learned from ten outcomes is noisy: on a fleet of equal workers each worker's factor
        differs from the others' by that noise alone, and LBGR would route on it. So, as an
        empirical Bayes estimate of one mean per worker, the weight is ``tau2 / (tau2 +
        v)``: ``v`` is this factor's noise (the fleet's pooled variance of one outcome's log
        factor, times the model's ``evidence``), ``tau2`` the spread between the workers'
        factors that their noise does not explain (their variance less their mean noise, at
        least 0). A worker that really is slower stands out of the noise and keeps its
        factor; equal workers share the fleet's."""
        if not getattr(model, "shrink", False) or self._shares(key) or key not in self._models:
            return 1.0
        stats = self._fleet_stats()
        if stats is None:
            return 1.0
        tau2, pooled = stats
        noise = pooled * float(model.evidence)
        if not math.isfinite(noise):
            return 0.0
        return 1.0 if tau2 + noise <= 0.0 else tau2 / (tau2 + noise)

    def _fleet_stats(self) -> tuple[float, float] | None:
        """(tau2, pooled variance of one outcome's log factor) over the fresh shrinking
        models (``_shrink``), or None with fewer than two of them or no variance yet. Made
        once per fleet outcome."""
        cached = self._fleet_shrink
        if cached is not None and cached[0] == self._samples_and_models():
            return cached[1]
        fresh: list[Any] = []
        for k, m in list(self._models.items()):  # a learn on another thread may add a worker
            if getattr(m, "shrink", False) and self._fade(k, m) >= 1.0:
                fresh.append(m)
        stats: tuple[float, float] | None = None
        dispersions = [d for d in (m.dispersion for m in fresh) if d is not None]
        if len(fresh) >= 2 and dispersions:
            pooled = sum(dispersions) / len(dispersions)
            logs = [float(m.log_factor) for m in fresh]
            mean = sum(logs) / len(logs)
            between = sum((v - mean) ** 2 for v in logs) / (len(logs) - 1)
            noise = sum(pooled * min(1.0, float(m.evidence)) for m in fresh) / len(fresh)
            tau2 = max(0.0, between - noise)
            if math.isfinite(tau2) and math.isfinite(pooled):
                stats = (tau2, pooled)
        self._fleet_shrink = (self._samples_and_models(), stats)
        return stats

    def _samples_and_models(self) -> tuple[int, int]:
        return self.samples, len(self._models)

    def _fleet_log_factor(self, key: str, model: Any, weight: float) -> float:
        """The rest of the fleet's log factor, for ``model`` (at ``weight``, its ``_fade``):
        the mean of the other fading models' log factors, each weighted by how fresh it is;
        0.0 (the estimate as it is) without any. The sums are made once per fleet outcome."""
        models = list(self._models.items())  # a learn on another thread may add a worker
        sums = self._fleet_log
        if sums is None or sums[0] != self.samples or sums[1] != len(models):
            total = weights = 0.0
            for k, m in models:
                if getattr(m, "fades", False):
                    w = self._fade(k, m)
                    total += w * float(cast(FadingModel, m).log_factor)
                    weights += w
            sums = self._fleet_log = (self.samples, len(models), total, weights)
        has_model = key in self._models  # else not among the sums
        own = weight * float(model.log_factor) if has_model else 0.0
        others = sums[3] - (weight if has_model else 0.0)
        if others <= 1e-9:
            return 0.0
        value = (sums[2] - own) / others
        return value if math.isfinite(value) else 0.0

    def learn(self, worker: str, x: Features, y: float) -> float:
        """Train on one outcome; returns the absolute error of the prediction made before."""
        key = self._key(worker)
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = make_model(self.spec_for(worker))
        if self._shares(worker) and worker not in self._one_hot:
            self._set_shared_workers([*self._one_hot, worker])
        error = abs(self.predict(worker, x) - y)
        # Stale: the faded factor its predictions showed becomes the learned one, its faded
        # share as uncertain as a new model's (``fade``), so this outcome replaces that share.
        weight = self._fade(key, model)
        if weight < 1.0:
            try:
                cast(FadingModel, model).fade(weight, self._fleet_log_factor(key, model, weight))
            except Exception:  # noqa: BLE001 - isolate, count, keep routing
                self.failures += 1
        tracker = self._errors.get(worker)
        if tracker is None:
            tracker = self._errors[worker] = RollingMAE(self.window)
        tracker.update(error)
        self.samples += 1
        self._last_sample[key] = self.samples
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
        # list() copies the dict in one C call: a learn on another thread may add a worker.
        values = [(t.get(), len(t._errors)) for t in list(self._errors.values())]
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
        models, errors = dict(self._models), dict(self._errors)  # snapshots; see mae()
        models.pop(worker, None)
        errors.pop(worker, None)
        clone._models, clone._errors = models, errors
        clone._last_sample = {k: v for k, v in self._last_sample.items() if k != worker}
        clone._one_hot = self._one_hot
        clone.failures, clone.samples = self.failures, self.samples
        return clone

    def forget(self, worker: str) -> None:
        if worker in self._one_hot:
            self._set_shared_workers([w for w in self._one_hot if w != worker])
        self._models.pop(worker, None)
        self._errors.pop(worker, None)
        self._last_sample.pop(worker, None)
        self.overrides.pop(worker, None)

    def learned(self) -> dict[str, dict[str, float]]:
        """Per worker (``"*"`` for a shared model), what its model reports through
        ``learned()``; models without it, or whose ``learned()`` fails, are left out."""
        out: dict[str, dict[str, float]] = {}
        for worker, model in list(self._models.items()):  # a learn may add a worker meanwhile
            report = getattr(model, "learned", None)
            if not callable(report):
                continue
            try:
                values = {str(k): float(v) for k, v in report().items()}
                if getattr(model, "fades", False) and not self._shares(worker):
                    # What routing prices now: the factor faded toward the fleet's (_fade).
                    weight = self._fade(worker, model)
                    own = weight * self._shrink(worker, model)
                    fleet = self._fleet_log_factor(worker, model, weight) if own < 1 else 0.0
                    values["factor_in_use"] = cast(FadingModel, model).faded_factor(own, fleet)
                    values["own_weight"] = own
            except Exception:  # noqa: BLE001 - a status page must not fail on one model
                continue
            out[worker] = values
        return out

    def status(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "sharing": self.sharing,
            "overrides": {w: s.to_dict() for w, s in list(self.overrides.items())},
            "mae_ms": self.mae(),
            "per_worker_mae_ms": {w: t.get() for w, t in list(self._errors.items())},
            "per_worker_learned": self.learned(),
            "samples": self.samples,
            "failures": self.failures,
        }
