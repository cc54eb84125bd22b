"""Named kinds of residual model, each built from a JSON spec ``{"kind": ..., "params": {...}}``.

Shaped like SGLang's ``mem_cache/registry.py``: ``register_model(kind, factory)`` refuses blank
or duplicate names; an unknown kind or a bad parameter fails with a message that says what is
known and what was wrong. Third parties add kinds through the ``kvroute.models`` entry points.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.registry import Registry
from models.base import ResidualModel

__all__ = [
    "REGISTRY",
    "ModelSpec",
    "ModelSpecError",
    "make_model",
    "model_kinds",
    "parse_spec",
    "register_model",
]

ModelFactory = Callable[..., ResidualModel]


def _builtins(registry: Registry[ModelFactory]) -> None:
    from models.builtin import register_builtins

    register_builtins(registry)


REGISTRY: Registry[ModelFactory] = Registry("model kind", "kvroute.models", _builtins)


class ModelSpecError(ValueError):
    """A model spec names an unknown kind or carries bad parameters."""


@dataclass(frozen=True)
class ModelSpec:
    kind: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": dict(self.params)}

    @property
    def key(self) -> str:
        """A canonical string of the spec (specs hold dicts, so they are not hashable)."""
        return json.dumps(self.to_dict(), sort_keys=True, default=str)


def register_model(kind: str, factory: ModelFactory) -> None:
    REGISTRY.register(kind, factory)


def model_kinds() -> list[str]:
    return REGISTRY.names()


def parse_spec(spec: str | Mapping[str, Any] | ModelSpec) -> ModelSpec:
    """Accept a kind name (``"ewmean"``), a JSON string, a dict or a ModelSpec."""
    if isinstance(spec, ModelSpec):
        return spec
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ModelSpecError(f"model spec is not valid JSON: {exc}") from None
        else:
            return ModelSpec(text)
    if not isinstance(spec, Mapping):
        raise ModelSpecError("model spec must be a kind name or an object {kind, params}")
    unknown = set(spec) - {"kind", "params"}
    if unknown:
        raise ModelSpecError(f"model spec has unknown keys {sorted(unknown)}; use kind and params")
    kind, params = spec.get("kind"), spec.get("params", {})
    if not isinstance(kind, str) or not kind:
        raise ModelSpecError("model spec needs a string 'kind'")
    if not isinstance(params, Mapping):
        raise ModelSpecError("model spec 'params' must be an object")
    return ModelSpec(kind, dict(params))


def make_model(spec: str | Mapping[str, Any] | ModelSpec) -> ResidualModel:
    """Build a fresh model from a spec, or raise ModelSpecError naming the problem."""
    parsed = parse_spec(spec)
    try:
        factory = REGISTRY.get(parsed.kind)
    except ValueError as exc:
        raise ModelSpecError(str(exc)) from None
    accepted = inspect.signature(factory).parameters
    bad = [p for p in parsed.params if p not in accepted]
    if bad:
        raise ModelSpecError(
            f"model kind {parsed.kind!r} has no parameter(s) {bad}; accepted: {sorted(accepted)}"
        )
    try:
        return factory(**parsed.params)
    except (TypeError, ValueError) as exc:
        raise ModelSpecError(f"bad params for model kind {parsed.kind!r}: {exc}") from None
