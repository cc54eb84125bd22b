"""Rolling mean absolute error of a model's residual predictions, in ms."""

from __future__ import annotations

from collections import deque

__all__ = ["RollingMAE"]


class RollingMAE:
    """MAE over the last ``window`` errors; O(1) per update, picklable.

    >>> mae = RollingMAE(window=2)
    >>> for err in (1.0, 3.0, 5.0):
    ...     mae.update(err)
    >>> mae.get(), mae.count
    (4.0, 3)
    """

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._errors: deque[float] = deque()
        self._sum = 0.0
        self.count = 0  # all errors seen, not only those in the window

    def update(self, abs_error: float) -> None:
        self._errors.append(abs_error)
        self._sum += abs_error
        self.count += 1
        if len(self._errors) > self.window:
            self._sum -= self._errors.popleft()

    def get(self) -> float | None:
        return self._sum / len(self._errors) if self._errors else None
