"""PNG plots of benchmark results (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["plot_rows"]


def plot_rows(
    rows: Sequence[Mapping[str, Any]],
    latencies: Mapping[str, Sequence[float]],
    path: str,
    title: str,
) -> None:
    """Bars of p50/p95 latency and TTFT and of hit rate per row, and latency CDFs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["label"]) for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    ax = axes[0][0]
    for offset, key in ((-0.2, "p50_latency_s"), (0.2, "p95_latency_s")):
        ax.bar(x + offset, [r.get(key) or 0 for r in rows], 0.4, label=key)
    ax.set_title("end-to-end latency (s)")
    ax = axes[0][1]
    for offset, key in ((-0.2, "p50_ttft_s"), (0.2, "p95_ttft_s")):
        ax.bar(x + offset, [r.get(key) or 0 for r in rows], 0.4, label=key)
    ax.set_title("time to first token (s)")
    ax = axes[1][0]
    ax.bar(x, [r.get("hit_rate") or 0 for r in rows], 0.6)
    ax.set_title("cluster hit rate (worker counters)")
    for ax in (axes[0][0], axes[0][1], axes[1][0]):
        ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
        ax.legend(fontsize=8) if ax is not axes[1][0] else None
    ax = axes[1][1]
    for label, values in latencies.items():
        if values:
            data = np.sort(np.asarray(values))
            ax.plot(data, np.arange(1, len(data) + 1) / len(data), label=label)
    ax.set_xscale("log")
    ax.set_title("latency CDF (s)")
    ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
