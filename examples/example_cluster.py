"""What the examples share: a router to talk to, and small HTTP calls to it.

Every example runs with one command against an emulated cluster it starts itself
(``sim.local_cluster.LocalCluster``: emulated SGLang workers plus a ``kvroute serve``, all on
loopback, stopped on exit or Ctrl-C), or against a router you already run (``--url``, with
``--token`` or ``$KVROUTE_ADMIN_TOKEN`` for the control plane, which listens on its own port:
``--control-url``, by default the data port + 1). In the docker compose stack the balancer
(http://localhost:8000) serves the data plane and ``/explain``; control-plane calls go to one
replica's control listener (http://127.0.0.1:8001), since each replica has its own models.

Standard library only, apart from kvroute itself, so a copy works anywhere kvroute is
installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sim.loadgen import default_control_url
from sim.local_cluster import LocalCluster

__all__ = ["Router", "add_cluster_arguments", "open_router"]


@dataclass
class Router:
    """A router URL, its admin token, and the cluster behind it when we started one."""

    url: str
    token: str | None = None
    cluster: LocalCluster | None = None
    control_url: str | None = None  # the control listener (default: the data port + 1)

    def call(
        self, method: str, path: str, body: Any = None, timeout_s: float = 60.0
    ) -> tuple[int, dict[str, str], Any]:
        """One JSON request: (status, headers with lower-case names, JSON body or text).
        The control plane (/workers, /policy, /models, /metrics) goes to the control URL."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        base = self.url
        if path.startswith(("/workers", "/policy", "/models", "/metrics")):
            base = self.control_url or default_control_url(self.url)
        req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                status, raw, got = resp.status, resp.read(), _lower(resp.headers.items())
        except urllib.error.HTTPError as exc:
            status, raw, got = exc.code, exc.read(), _lower(exc.headers.items())
        try:
            return status, got, json.loads(raw) if raw else None
        except ValueError:
            return status, got, raw.decode(errors="replace")

    def json(self, method: str, path: str, body: Any = None) -> Any:
        """Like ``call``, but an error status ends the example with the router's message."""
        status, _, answer = self.call(method, path, body)
        if status >= 400:
            raise SystemExit(f"{method} {path} answered {status}: {answer}")
        return answer


def _lower(items: Any) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in items}


def add_cluster_arguments(
    parser: argparse.ArgumentParser, *, workers: int = 4, time_scale: float = 10.0
) -> None:
    g = parser.add_argument_group("cluster (ignored with --url)")
    g.add_argument(
        "--url",
        default=None,
        help="an existing kvroute router (default: start emulated workers and a router here)",
    )
    g.add_argument(
        "--token",
        default=os.environ.get("KVROUTE_ADMIN_TOKEN"),
        help="the router's admin token (default: $KVROUTE_ADMIN_TOKEN)",
    )
    g.add_argument(
        "--control-url",
        default=None,
        help="the router's control listener (default: the --url port + 1)",
    )
    g.add_argument("--workers", type=int, default=workers, help="emulated workers to start")
    g.add_argument(
        "--eviction", choices=["lru", "rlt"], default="rlt", help="eviction of the workers we start"
    )
    g.add_argument("--policy", default="lbgr", help="routing policy of the router we start")
    g.add_argument(
        "--time-scale",
        type=float,
        default=time_scale,
        help="emulated GPU time runs this many times faster than real time",
    )
    g.add_argument("--log-dir", default=None, help="keep the worker and router logs here")


@contextmanager
def open_router(args: argparse.Namespace) -> Iterator[Router]:
    """The router at ``--url``, or a fresh emulated cluster that is stopped on exit."""
    if args.url:
        yield Router(args.url.rstrip("/"), args.token, None, args.control_url)
        return
    with LocalCluster(
        workers=args.workers,
        eviction=args.eviction,
        time_scale=args.time_scale,
        log_dir=args.log_dir,
    ) as cluster:
        started = time.perf_counter()
        print(
            f"starting {args.workers} emulated workers ({args.eviction}, time scale "
            f"{args.time_scale:g}x) and a kvroute router ({args.policy})...",
            file=sys.stderr,
        )
        cluster.start_workers()
        url = cluster.start_router("kvroute", args.policy)
        cluster.warm_up()
        print(f"ready in {time.perf_counter() - started:.1f} s: {url}", file=sys.stderr)
        yield Router(url, cluster.admin_token, cluster, cluster.control_url)
