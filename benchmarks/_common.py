"""Helpers shared by the benchmark scripts: command line, run metadata, JSON output, ratios.

Every benchmark writes one JSON object: ``{"benchmark": NAME, "metadata": {...}, ...figures}``,
where the metadata says when, on what commit and on what machine the figures were measured,
so a number quoted in an issue can be traced back to its run. JSON is written strictly (no
``Infinity``/``NaN``): a ratio with a zero denominator is stored as ``null`` next to its text.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

__all__ = [
    "DATA_DIR",
    "REPO_ROOT",
    "base_parser",
    "format_ratio",
    "metadata",
    "parallel_map",
    "ratio",
    "write_json",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
# Public workload data (traces, datasets), read in place and never copied into the project;
# absent in a fresh clone, where the benchmarks that need it skip those parts.
DATA_DIR = REPO_ROOT.parent / "shared" / "data"


def base_parser(name: str, description: str | None) -> argparse.ArgumentParser:
    """The flags every benchmark takes: ``--out`` (default ``results/NAME.json``), ``--quick``."""
    parser = argparse.ArgumentParser(
        prog=f"benchmarks/{name}.py",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT / "results" / f"{name}.json",
        help="where to write the JSON figures (default: results/%(prog)s.json)",
    )
    parser.add_argument("--quick", action="store_true", help="a small, fast smoke run")
    return parser


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def metadata() -> dict[str, Any]:
    """When, where and how this run was made."""
    status = _git("status", "--porcelain")
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }


def write_json(path: Path, benchmark: str, figures: Mapping[str, Any]) -> Path:
    """Write ``figures`` with the run's metadata to ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"benchmark": benchmark, "metadata": metadata(), **figures}
    path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    return path


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def format_ratio(numerator: float | None, denominator: float | None) -> str:
    """The ratio as table text: ``6.92x``; ``inf`` for x/0 with x > 0; ``n/a`` for 0/0."""
    if numerator is None or denominator is None:
        return "n/a"
    if denominator == 0:
        return "inf" if numerator > 0 else "n/a"
    value = numerator / denominator
    return "inf" if math.isinf(value) else f"{value:.2f}x"


def add_gsp_fleet_args(parser: argparse.ArgumentParser) -> None:
    """The emulated-fleet GSP options that ``compare_routers`` and ``scale_out`` share."""
    parser.add_argument("--groups", type=int, default=None, help="GSP groups (default 128)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per group (32)")
    parser.add_argument("--rate", type=float, default=12.0, help="requests/s, emulated")
    parser.add_argument("--time-scale", type=float, default=2.0, help="emulated/real speed")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)


def check_gsp_fleet_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the GSP size defaults (32x8 with ``--quick``) and refuse non-positive values."""
    args.groups = args.groups or (32 if args.quick else 128)
    args.prompts = args.prompts or (8 if args.quick else 32)
    if min(args.groups, args.prompts, args.workers) < 1 or args.rate <= 0 or args.time_scale <= 0:
        parser.error("--groups, --prompts, --workers, --rate and --time-scale must be positive")


def parallel_map(
    function: Callable[[Any], Any],
    jobs: Sequence[Any],
    processes: int,
    desc: str,
    progress: bool = True,
) -> list[Any]:
    """``[function(job) for job in jobs]`` on a process pool, in the jobs' order, with a tqdm
    bar on stderr (shown on a terminal unless ``progress`` is false). With ``processes`` <= 1
    they run in this process, in order, which is easier to debug."""
    from tqdm import tqdm

    bar = tqdm(total=len(jobs), desc=desc, file=sys.stderr, disable=None if progress else True)
    try:
        if processes <= 1:
            results = []
            for job in jobs:
                results.append(function(job))
                bar.update(1)
            return results
        with ProcessPoolExecutor(max_workers=processes) as pool:
            futures = [pool.submit(function, job) for job in jobs]
            for _ in as_completed(futures):
                bar.update(1)
            return [future.result() for future in futures]
    finally:
        bar.close()
