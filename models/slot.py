"""Champion and challenger: hot-swappable model banks for a learning policy.

The champion predicts and learns; a challenger, when started, learns on the same outcomes in
shadow and reports its rolling MAE next to the champion's. ``promote`` makes it the champion.
Every change builds the new bank first and then replaces one reference, so a decision sees
either the old bank or the new one, never a half-built state, and nothing waits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.bank import ModelBank
from models.base import Features
from models.registry import ModelSpec, parse_spec

__all__ = ["ModelSlot", "NoChallenger"]

SpecLike = str | Mapping[str, Any] | ModelSpec


class NoChallenger(LookupError):
    """``promote`` was called with no challenger running."""


class ModelSlot:
    """The residual models a policy uses, with a version that moves on every swap."""

    def __init__(
        self, spec: SpecLike = "ewmean", *, sharing: str = "per_worker", window: int = 256
    ) -> None:
        self.champion = ModelBank(spec, sharing=sharing, window=window)
        self.challenger: ModelBank | None = None
        self.version = 1

    def predict(self, worker: str, x: Features) -> float:
        return self.champion.predict(worker, x)

    def learn(self, worker: str, x: Features, y: float) -> float:
        """Train the champion (returning its error) and, in shadow, the challenger."""
        challenger = self.challenger
        if challenger is not None:
            challenger.learn(worker, x, y)
        return self.champion.learn(worker, x, y)

    @property
    def needs_features(self) -> bool:
        """False when every model in use ignores features (``ewmean``, ``none``)."""
        challenger = self.challenger
        return self.champion.needs_features or (
            challenger is not None and challenger.needs_features
        )

    def kind_for(self, worker: str) -> str:
        return self.champion.kind_for(worker)

    def signed_for(self, worker: str) -> bool:
        """Whether the champion's model for ``worker`` learns a signed residual."""
        return self.champion.signed_for(worker)

    def swap(self, spec: SpecLike, worker: str | None = None, sharing: str | None = None) -> None:
        """Replace the champion by fresh models of ``spec``, for every worker or only one."""
        parsed = parse_spec(spec)
        if worker is None:
            new = ModelBank(
                parsed, sharing=sharing or self.champion.sharing, window=self.champion.window
            )
        else:
            new = self.champion.with_override(worker, parsed)
        self.champion = new
        self.version += 1

    def start_challenger(self, spec: SpecLike, sharing: str | None = None) -> None:
        self.challenger = ModelBank(
            spec, sharing=sharing or self.champion.sharing, window=self.champion.window
        )

    def drop_challenger(self) -> None:
        self.challenger = None

    def promote(self) -> None:
        """The challenger, with what it learned in shadow, becomes the champion."""
        challenger = self.challenger
        if challenger is None:
            raise NoChallenger("no challenger is running; start one first")
        self.champion, self.challenger = challenger, None
        self.version += 1

    def forget_worker(self, worker: str) -> None:
        self.champion.forget(worker)
        if self.challenger is not None:
            self.challenger.forget(worker)

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "champion": self.champion.status(),
            "challenger": self.challenger.status() if self.challenger else None,
        }
