"""The built-in model kinds."""

from __future__ import annotations

from typing import Any

from river import base

from kvroute.registry import Registry
from models.base import Features
from models.ewmean import EWMeanResidual
from models.ratio import RatioResidual
from models.river_kinds import AdaptiveTreeResidual, ScaledLinearResidual

__all__ = ["ZeroResidual", "register_builtins"]


class ZeroResidual(base.Regressor):
    """``none``: always 0, i.e. no learning; LBGR then ranks on the service estimate alone."""

    uses_features = False

    def learn_one(self, x: Features, y: float) -> None:
        pass

    def predict_one(self, x: Features) -> float:
        return 0.0

    def state(self) -> dict[str, float]:
        return {}

    def load_state(self, state: dict[str, float]) -> None:
        pass


def register_builtins(registry: Registry[Any]) -> None:
    registry.register("ewmean", EWMeanResidual)
    registry.register("none", ZeroResidual)
    registry.register("linear", ScaledLinearResidual)
    registry.register("tree", AdaptiveTreeResidual)
    registry.register("ratio", RatioResidual)
