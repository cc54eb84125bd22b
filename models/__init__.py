"""Residual latency models on River: a registry of named kinds built from JSON specs."""

from models.base import Features, ResidualModel
from models.ewmean import EWMeanResidual
from models.registry import (
    ModelSpec,
    ModelSpecError,
    make_model,
    model_kinds,
    parse_spec,
    register_model,
)

__all__ = [
    "EWMeanResidual",
    "Features",
    "ModelSpec",
    "ModelSpecError",
    "ResidualModel",
    "make_model",
    "model_kinds",
    "parse_spec",
    "register_model",
]
