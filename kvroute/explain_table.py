"""A routing decision from ``/explain`` as a per-worker text table.

``kvroute cluster`` (and so the demo) and ``examples/explain.py`` print decisions this way;
every field is described in ``docs/explain.md``. The chosen worker is marked ``*``.

>>> decision = {
...     "decision_id": "d1", "policy": "lbgr", "chosen": "w1", "units": 300,
...     "model": {"kind": "ratio", "version": 1},
...     "candidates": [
...         {"worker": "w0", "cached": 0, "uncached": 300, "base_ms": 310.0,
...          "queue_ms": 1.5e-13, "residual_ms": -4.0, "predicted_ms": 306.0,
...          "impact_ms": 90.0, "cost_ms": 396.0, "in_flight": 0, "eligible": True,
...          "reason": None},
...         {"worker": "w1", "cached": 256, "uncached": 44, "base_ms": 60.0,
...          "queue_ms": 20.0, "residual_ms": 1.0, "predicted_ms": 81.0,
...          "impact_ms": 12.0, "cost_ms": 93.0, "in_flight": 1, "eligible": True,
...          "reason": None},
...     ],
... }
>>> print(format_decision(decision, seconds=True, clock="emulated"))
decision d1: policy lbgr, model ratio v1, 300 units -> w1
worker  cached  uncached   base  queue  residual  predicted  impact   cost  in flight  eligible
    w0       0       300  0.310  0.000    -0.004      0.306   0.090  0.396          0  yes
  * w1     256        44  0.060  0.020     0.001      0.081   0.012  0.093          1  yes
times in emulated seconds; what each column means: docs/explain.md
"""

from __future__ import annotations

from typing import Any

__all__ = ["TIME_FIELDS", "format_decision", "format_outcome"]

# The per-candidate times, in the order the table shows them (milliseconds in the JSON).
TIME_FIELDS = (
    ("base", "base_ms"),
    ("queue", "queue_ms"),
    ("residual", "residual_ms"),
    ("predicted", "predicted_ms"),
    ("impact", "impact_ms"),
    ("cost", "cost_ms"),
)


def _time(value_ms: float, seconds: bool) -> str:
    text = f"{value_ms / 1000.0:.3f}" if seconds else f"{value_ms:.1f}"
    return text[1:] if text.startswith("-") and not text.strip("-0.") else text  # no "-0.000"


def _cells(candidate: dict[str, Any], chosen: bool, seconds: bool) -> list[str]:
    def count(key: str) -> str:
        value = candidate.get(key)
        return "-" if value is None else str(value)

    times = [
        "-" if candidate.get(key) is None else _time(float(candidate[key]), seconds)
        for _, key in TIME_FIELDS
    ]
    eligible = "yes" if candidate.get("eligible") else f"no: {candidate.get('reason')}"
    worker = ("* " if chosen else "") + str(candidate.get("worker"))
    return [worker, count("cached"), count("uncached"), *times, count("in_flight"), eligible]


def format_decision(decision: dict[str, Any], *, seconds: bool = False, clock: str = "") -> str:
    """The decision as a text table: one row per worker, the chosen one marked ``*``.

    ``seconds``: times in seconds (3 decimals) instead of milliseconds (1 decimal); ``clock``
    names the clock they are on (``"emulated"`` for workers faster than real time).
    """
    rows = [["worker", "cached", "uncached", *(t for t, _ in TIME_FIELDS), "in flight", "eligible"]]
    for candidate in decision.get("candidates", []):
        rows.append(_cells(candidate, candidate.get("worker") == decision.get("chosen"), seconds))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join([*(cell.rjust(w) for cell, w in zip(row, widths, strict=False)), row[-1]])
        for row in rows
    ]
    model = decision.get("model") or {}
    title = (
        f"decision {decision.get('decision_id')}: policy {decision.get('policy')}"
        + (f", model {model.get('kind')} v{model.get('version')}" if model else "")
        + f", {decision.get('units')} units -> {decision.get('chosen')}"
    )
    unit = "seconds" if seconds else "ms"
    note = f"times in {clock + ' ' if clock else ''}{unit}; what each column means: docs/explain.md"
    return "\n".join([title, *lines, note])


def format_outcome(outcome: dict[str, Any] | None, *, seconds: bool = False) -> str:
    """The outcome of a recorded decision on one line (``_ms`` fields in the table's unit)."""
    if outcome is None:
        return "outcome: not known yet"
    parts = []
    for key, value in outcome.items():
        if value is None:
            continue
        if isinstance(value, int | float) and key.endswith("_ms"):
            name = key[:-3] + ("_s" if seconds else "_ms")
            parts.append(f"{name}={_time(float(value), seconds)}")
        else:
            parts.append(f"{key}={value}")
    return "outcome: " + ", ".join(parts)
