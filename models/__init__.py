"""Residual latency models on River: a registry of named kinds built from JSON specs, banks
of per-worker models with online error, champion/challenger slots and snapshots."""

from models.bank import SHARINGS, ModelBank
from models.base import Features, ResidualModel
from models.builtin import ZeroResidual
from models.ewmean import EWMeanResidual
from models.online_error import RollingMAE
from models.persistence import SnapshotError
from models.ratio import RatioResidual
from models.registry import (
    ModelSpec,
    ModelSpecError,
    make_model,
    model_kinds,
    parse_spec,
    register_model,
)
from models.river_kinds import AdaptiveTreeResidual, ScaledLinearResidual
from models.slot import ModelSlot, NoChallenger

__all__ = [
    "SHARINGS",
    "AdaptiveTreeResidual",
    "EWMeanResidual",
    "Features",
    "ModelBank",
    "ModelSlot",
    "ModelSpec",
    "ModelSpecError",
    "NoChallenger",
    "RatioResidual",
    "ResidualModel",
    "RollingMAE",
    "ScaledLinearResidual",
    "SnapshotError",
    "ZeroResidual",
    "make_model",
    "model_kinds",
    "parse_spec",
    "register_model",
]
