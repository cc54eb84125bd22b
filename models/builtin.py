"""The built-in model kinds."""

from __future__ import annotations

from river import base

from models.base import Features
from models.ewmean import EWMeanResidual
from models.ratio import RatioResidual
from models.registry import register_model
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


def register_builtins() -> None:
    register_model("ewmean", EWMeanResidual)
    register_model("none", ZeroResidual)
    register_model("linear", ScaledLinearResidual)
    register_model("tree", AdaptiveTreeResidual)
    register_model("ratio", RatioResidual)
