"""Processes and probes for benchmarks that run a fleet of router replicas (``scale_out``).

An nginx round-robin balancer with a temporary prefix, ``kvroute
serve`` replicas (optionally pinned to CPUs), and the measurements taken from outside: the
replicas' merged index-sync lag histogram, CPU seconds per process group (``/proc``), and the
machine's busy fraction. Every process is started in its own process group and stopped whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.loadgen import default_control_url
from sim.local_cluster import free_port, free_port_pair, wait_healthy

__all__ = [
    "BALANCERS",
    "Balancer",
    "InstantWorkers",
    "KernelBalancer",
    "busy_fraction",
    "children_cpu_s",
    "group_cpu_s",
    "harness_cpu_s",
    "machine_jiffies",
    "post_json",
    "spawn",
    "start_replicas",
    "stop",
    "sync_lag",
]

CPUS = os.cpu_count() or 1


def spawn(args: Sequence[str], cpu: int | None = None, **env: str) -> subprocess.Popen[bytes]:
    pin = ["taskset", "-c", str(cpu)] if cpu is not None and shutil.which("taskset") else []
    return subprocess.Popen(
        [*pin, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}, **env},
    )


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


_NGINX_HEAD = """\
{user}worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
"""

_NGINX_CONF = (
    _NGINX_HEAD
    + """\
    upstream routers {{
{servers}
        keepalive 256;
        keepalive_timeout 2s;  # below uvicorn's 5 s: nginx never reuses a connection it is closing
    }}
    server {{
        listen 127.0.0.1:{port} reuseport backlog=4096;
        client_max_body_size 64m;
        location / {{
            proxy_pass http://routers;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""
)


_INSTANT_CONF = (
    _NGINX_HEAD
    + """\
    keepalive_requests 1000000;
    client_max_body_size 64m;
    default_type application/json;
    server {{
{listen}
        location = /health {{ return 200 ""; }}
        location = /health_generate {{ return 200 ""; }}
        location = /get_model_info {{ return 200 '{info}'; }}
        location = /get_server_info {{ return 200 '{info}'; }}
        location = /v1/models {{ return 200 '{models}'; }}
        location = /generate {{ return 200 '{generate}'; }}
        location = /v1/completions {{ return 200 '{generate}'; }}
        location / {{ return 404 '{{"error": "not found"}}'; }}
    }}
}}
"""
)


class _Nginx:
    """nginx in the foreground with a temporary prefix, configured from ``template``;
    ``urls`` answer /health before the constructor returns."""

    def __init__(self, template: str, urls: Sequence[str], **fields: str) -> None:
        exe = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(exe):
            raise SystemExit("nginx is not installed (apt-get install nginx-light)")
        self.prefix = tempfile.mkdtemp(prefix="kvroute-nginx-")
        conf = Path(self.prefix) / "nginx.conf"
        user = "user root;\n" if os.geteuid() == 0 else ""
        conf.write_text(template.format(user=user, prefix=self.prefix, **fields))
        args = [exe, "-p", self.prefix, "-c", str(conf), "-e", f"{self.prefix}/error.log"]
        self.proc = spawn([*args, "-g", "daemon off;"])
        try:
            for url in urls:
                wait_healthy(url, 30, self.proc)
        except (RuntimeError, TimeoutError):
            self.stop()
            raise

    def errors(self, last: int = 5) -> list[str]:
        """The last lines of nginx's error log (why a request failed: upstream errors)."""
        try:
            lines = (Path(self.prefix) / "error.log").read_text().splitlines()
        except OSError:
            return []
        return lines[-last:]

    def stop(self) -> None:
        stop([self.proc])
        shutil.rmtree(self.prefix, ignore_errors=True)


_INSTANT_GENERATE = {
    "text": "ok",
    "meta_info": {"prompt_tokens": 8, "completion_tokens": 4, "cached_tokens": 0},
}


class InstantWorkers(_Nginx):
    """``count`` workers that answer at once, served by one nginx process on as many ports.

    What ``instant_worker.py`` answers (SGLang's /health, /get_model_info, /get_server_info,
    /v1/models, non-streaming /generate and /v1/completions) as fixed responses, for benchmarks
    that measure the routers' own ceiling: in production the workers are GPU servers on other
    machines, so the less CPU they take from this one, the closer the figure is to what the
    routers alone can do. nginx answers a request in a few microseconds of CPU, where a Python
    server takes a good part of a millisecond.
    """

    def __init__(self, count: int) -> None:
        self.ports = [free_port() for _ in range(count)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        super().__init__(
            _INSTANT_CONF,
            self.urls,
            listen="\n".join(f"        listen 127.0.0.1:{p};" for p in self.ports),
            info=json.dumps({"model_path": "instant", "is_generation": True}),
            models=json.dumps({"object": "list", "data": [{"id": "instant"}]}),
            generate=json.dumps(_INSTANT_GENERATE),
        )


class Balancer(_Nginx):
    """Round robin over ``upstreams`` (keep-alive, no buffering, so SSE streams pass)."""

    def __init__(self, upstreams: Sequence[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # max_fails=0: one failed request must not take a replica out of the rotation for 10 s.
        servers = "\n".join(
            f"        server {u.removeprefix('http://')} max_fails=0;" for u in upstreams
        )
        super().__init__(_NGINX_CONF, [self.url], servers=servers, port=str(self.port))


class KernelBalancer:
    """Round robin over ``upstreams`` in the kernel: an nftables NAT rule on loopback that sends
    each new TCP connection to the next upstream (``numgen inc``), the way a Kubernetes Service
    (kube-proxy in nftables mode) spreads connections over router pods. No balancer process: the
    packet rewriting costs kernel time in the sending processes, a fraction of a user-space
    proxy's, so the 2-core machine's CPU goes to the replicas. Connection-level, so a client
    should open several connections (wrk does). Needs root and ``nft``.
    """

    proc: subprocess.Popen[bytes] | None = None

    def __init__(self, upstreams: Sequence[str]) -> None:
        exe = shutil.which("nft")
        if exe is None or os.geteuid() != 0:
            raise RuntimeError("the kernel balancer needs root and nft (apt-get install nftables)")
        self.exe, self.port = exe, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.table = f"kvroute_bench_{self.port}"
        targets = ", ".join(
            f"{i} : 127.0.0.1 . {u.rsplit(':', 1)[1]}" for i, u in enumerate(upstreams)
        )
        rules = (
            f"table ip {self.table} {{\n"
            "  chain out {\n"
            "    type nat hook output priority -100; policy accept;\n"
            f"    ip daddr 127.0.0.1 tcp dport {self.port} "
            f"dnat to numgen inc mod {len(upstreams)} map {{ {targets} }}\n"
            "  }\n"
            "}\n"
        )
        done = subprocess.run([exe, "-f", "-"], input=rules.encode(), capture_output=True)
        if done.returncode != 0:
            raise RuntimeError(f"nft refused the balancer's rule: {done.stderr.decode().strip()}")
        try:
            wait_healthy(self.url, 30)
        except (RuntimeError, TimeoutError):
            self.stop()
            raise

    def errors(self, last: int = 5) -> list[str]:
        return []  # no log: a failed connection shows in wrk's socket errors

    def stop(self) -> None:
        subprocess.run([self.exe, "delete", "table", "ip", self.table], capture_output=True)


BALANCERS: dict[str, type[Balancer] | type[KernelBalancer]] = {
    "nginx": Balancer,
    "kernel": KernelBalancer,
}


def start_replicas(
    count: int,
    worker_urls: Sequence[str],
    redis_url: str,
    cluster: str,
    *,
    policy: str = "lbgr",
    index_sync: bool = True,
    pin: bool = True,
    load_sync_ms: float | None = None,
) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    """``count`` replicas ``r0``, ``r1``, ... of one cluster; replica i on CPU ``i % CPUS``.
    ``load_sync_ms`` None keeps the service's default."""
    urls, procs = [], []
    env = {} if index_sync else {"KVROUTE_INDEX_SYNC": "false"}
    if load_sync_ms is not None:
        env["KVROUTE_LOAD_SYNC_MS"] = repr(load_sync_ms)
    for i in range(count):
        port = free_port_pair()  # the control listener (/metrics) takes port + 1
        args = [sys.executable, "-m", "kvroute", "serve", "--port", str(port)]
        args += ["--policy", policy, "--redis-url", redis_url, "--cluster", cluster]
        args += ["--replica-id", f"r{i}", "--log-level", "warning", "--worker-urls", *worker_urls]
        procs.append(spawn(args, cpu=i % CPUS if pin else None, **env))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, 90, proc)
    except (RuntimeError, TimeoutError):
        stop(procs)
        raise
    return urls, procs


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def post_json(url: str, body: bytes) -> None:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()


def sync_lag(
    replica_urls: Sequence[str], metric: str = "kvroute_index_sync_lag_seconds"
) -> dict[str, Any]:
    """A histogram merged over the replicas (the index sync lag unless ``metric`` says
    otherwise): count and interpolated p50/p99 (seconds)."""
    pattern = re.compile(rf'^{metric}_bucket\{{le="([^"]+)"\}} (\S+)$', re.M)
    buckets: dict[float, float] = {}
    for url in replica_urls:
        for le, count in pattern.findall(get_text(default_control_url(url) + "/metrics")):
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(count)
    bounds = sorted(buckets)
    total = buckets.get(float("inf"), 0.0)
    out: dict[str, Any] = {"events": int(total)}
    for q in (50, 99):
        out[f"p{q}_s"] = _quantile(bounds, buckets, total, q / 100.0) if total else None
    return out


def _quantile(bounds: list[float], cumulative: dict[float, float], total: float, q: float) -> float:
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower  # beyond the last finite bucket: report its bound
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def machine_jiffies() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
    except OSError:
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def _processes() -> dict[int, tuple[int, int, float]]:
    """pid -> (parent pid, process group, CPU seconds so far) of every live process."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        out[int(entry)] = (
            int(fields[1]),
            int(fields[2]),
            (int(fields[11]) + int(fields[12])) / tick,
        )
    return out


def group_cpu_s(procs: Sequence[subprocess.Popen[bytes]]) -> float:
    """CPU seconds used so far by the process groups of ``procs`` (live processes only)."""
    groups = {p.pid for p in procs}  # every spawn leads its own group
    return sum(cpu for _, pgrp, cpu in _processes().values() if pgrp in groups)


def harness_cpu_s() -> float:
    """CPU seconds of this process (the load generator) and all its live descendants."""
    table, mine, total = _processes(), {os.getpid()}, 0.0
    grew = True
    while grew:  # descendants: parents first, whatever the pid order
        grew = False
        for pid, (ppid, _, cpu) in table.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                total += cpu
                grew = True
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return total + usage.ru_utime + usage.ru_stime


def busy_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] == before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 3)


def children_cpu_s() -> float:
    """CPU seconds of this process's reaped children (a finished ``wrk``)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
