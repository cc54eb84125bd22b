"""The residual model interface, in River's vocabulary."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["FadingModel", "Features", "ResidualModel"]

# River types features as dict[Hashable, Any]; ``dict[Any, Any]`` fits both River's signatures
# and ours, where features are always ``str`` -> ``float`` (see router_service.routing.features).
Features = dict[Any, Any]


@runtime_checkable
class ResidualModel(Protocol):
    """Predicts the part of a request's latency (ms) that the service estimate misses.

    A model may set ``uses_features = False`` when it ignores ``x`` (a mean of the residual);
    callers then skip building feature dicts on the hot path. A model may also offer
    ``learned() -> dict[str, float]``, a few numbers an operator can read (``ewmean``: the
    residual in ms; ``ratio``: the latency factor); ``ModelBank.status`` reports them. A
    model whose learned state is a few numbers offers ``state() -> dict[str, float]`` and
    ``load_state(state)``: snapshots then store those numbers instead of a pickle.
    """

    def predict_one(self, x: Features) -> float: ...

    def learn_one(self, x: Features, y: float) -> None: ...


class FadingModel(ResidualModel, Protocol):
    """A residual model that says it fades (``fades = True``: ``ratio``): ``ModelBank`` moves
    the factor of a worker that gets no outcomes toward the rest of the fleet's."""

    fades: bool

    @property
    def log_factor(self) -> float:
        """The learned log factor on the estimate (what the bank averages over the fleet)."""
        ...

    @property
    def memory(self) -> float:
        """About how many outcomes the factor remembers."""
        ...

    def faded_factor(self, weight: float, fleet_log_factor: float) -> float: ...

    def predict_faded(self, x: Features, weight: float, fleet_log_factor: float) -> float: ...

    def fade(self, weight: float, fleet_log_factor: float) -> None: ...
