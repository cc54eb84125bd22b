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
from importlib.metadata import entry_points
from typing import Any

from models.base import ResidualModel

__all__ = [
    "ModelSpec",
    "ModelSpecError",
    "make_model",
    "model_kinds",
    "parse_spec",
    "register_model",
]

ModelFactory = Callable[..., ResidualModel]
_REGISTRY: dict[str, ModelFactory] = {}
_ENTRY_POINT_GROUP = "kvroute.models"
_LOADED = False  # built-ins and entry points registered (not "the registry is non-empty")


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
    # Load the built-ins first: a kind registered before the first lookup must not hide them.
    _ensure_loaded()
    if not kind or not kind.strip():
        raise ValueError("model kind must not be blank")
    if kind in _REGISTRY:
        raise ValueError(f"model kind {kind!r} is already registered")
    _REGISTRY[kind] = factory


def _ensure_loaded() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True  # first: the registrations below come back through register_model
    from models.builtin import register_builtins

    register_builtins()
    for ep in entry_points(group=_ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            register_model(ep.name, ep.load())


def model_kinds() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


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
    _ensure_loaded()
    parsed = parse_spec(spec)
    factory = _REGISTRY.get(parsed.kind)
    if factory is None:
        raise ModelSpecError(
            f"unknown model kind {parsed.kind!r}; known: {', '.join(sorted(_REGISTRY))}"
        )
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
