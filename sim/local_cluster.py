"""Start emulated workers and a router as local processes, and stop them all again.

Used by ``kvroute cluster``, the router comparison benchmark and the end-to-end tests. Every
process runs in its own process group and is terminated (then killed) on ``stop``, on an
exception, on Ctrl-C, and when the process running the cluster is sent SIGTERM (``kill``, a
timeout): the children are in their own sessions, so nothing else would stop them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

__all__ = [
    "LocalCluster",
    "exit_on_sigterm",
    "free_port",
    "free_ports",
    "wait_healthy",
    "wait_registered",
]

_LOWEST_PORT = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


_HANDED_OUT: set[int] = set()  # never the same port twice in a process: it may be unbound yet


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free now, below the kernel's ephemeral range where it has room.

    A port handed to a process that binds it later (a server still starting) must not be one
    the kernel can give meanwhile to an outgoing connection as its local port (every health
    poll makes one): that happens only in the ephemeral range. None is handed out twice in a
    process (an earlier one's server may not have bound it yet). Where the range leaves too
    little below it, the kernel picks (each socket held until all are found, so none repeats).
    """
    low, high = _LOWEST_PORT, _ephemeral_low() - 1
    if high - low + 1 >= 1000:
        ports: list[int] = []
        for port in random.sample(range(low, high + 1), min(high - low + 1, 64 * count)):
            if port not in _HANDED_OUT and _bindable(host, port):
                ports.append(port)
                if len(ports) == count:
                    _HANDED_OUT.update(ports)
                    return ports
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as held:
        ports = []
        while len(ports) < count:
            sock = held.enter_context(socket.socket(family))
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
            if port not in _HANDED_OUT:
                ports.append(port)
        _HANDED_OUT.update(ports)
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (below the ephemeral range where it can be: see ``free_ports``)."""
    return free_ports(1, host)[0]


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A free port whose successor is free too: for ``kvroute serve --port P``, whose control
    listener takes P + 1 by default."""
    for _ in range(64):
        port = free_port(host)
        if port >= 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def wait_healthy(
    url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None, path: str = "/health"
) -> None:
    """Poll ``url + path`` until it answers 200; raise with the process's output otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} exited with status {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + path, timeout=1) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError, TimeoutError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}{path} was not healthy within {timeout_s:.0f} s")


def wait_registered(
    url: str, workers: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll sglang-router's ``/workers`` until it lists ``workers`` healthy workers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/workers", timeout=1) as resp:
                listed = json.loads(resp.read()).get("workers", [])
            if sum(1 for w in listed if w.get("is_healthy", True)) >= workers:
                return
        except (urllib.error.URLError, OSError, TimeoutError, ValueError, AttributeError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not register {workers} workers within {timeout_s:.0f} s")


@dataclass
class LocalCluster:
    """N emulated workers plus at most one router, all on loopback."""

    workers: int = 4
    eviction: str = "rlt"
    capacity_tokens: int | None = None
    profile: str = "llama3.1-8b-l40"
    time_scale: float = 1.0
    host: str = "127.0.0.1"
    log_dir: str | None = None
    worker_urls: list[str] = field(default_factory=list)
    router_url: str | None = None
    # kvroute's control listener (/workers, /policy, /models, /metrics) and its token, made
    # for this cluster (passed in the environment, never on the command line).
    control_url: str | None = None
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    _workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _router: subprocess.Popen[bytes] | None = None
    _sigterm_installed: bool = False

    def _spawn(
        self, args: Sequence[str], name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        environ = {**os.environ, **env} if env else None
        if not self.log_dir:
            return subprocess.Popen(
                list(args),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=environ,
            )
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, f"{name}.log"), "wb") as log:
            return subprocess.Popen(
                list(args),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=environ,
            )

    def start_workers(self, seed: int = 0) -> list[str]:
        for i in range(self.workers):
            port = free_port(self.host)
            args = [
                sys.executable,
                "-m",
                "kvroute",
                "emulate",
                "--host",
                self.host,
                "--port",
                str(port),
                "--eviction",
                self.eviction,
                "--profile",
                self.profile,
                "--time-scale",
                repr(self.time_scale),
                "--seed",
                str(seed + i),
            ]
            if self.capacity_tokens:
                args += ["--capacity-tokens", str(self.capacity_tokens)]
            self._workers.append(self._spawn(args, f"worker-{i}"))
            self.worker_urls.append(f"http://{self.host}:{port}")
        for url, proc in zip(self.worker_urls, self._workers, strict=True):
            wait_healthy(url, 60, proc)
        return self.worker_urls

    def start_router(
        self, kind: str = "kvroute", policy: str = "lbgr", extra: Sequence[str] = ()
    ) -> str:
        """Start ``kvroute serve`` or ``sglang-router`` in front of the workers."""
        self.stop_router()
        port = free_port(self.host)
        env = None
        if kind == "kvroute":
            control_port = free_port(self.host)
            self.control_url = f"http://{self.host}:{control_port}"
            env = {"KVROUTE_ADMIN_TOKEN": self.admin_token}
            args = [
                sys.executable,
                "-m",
                "kvroute",
                "serve",
                "--host",
                self.host,
                "--port",
                str(port),
                "--control-host",
                self.host,
                "--control-port",
                str(control_port),
                "--policy",
                policy,
                "--worker-urls",
                *self.worker_urls,
                *(["--time-scale", repr(self.time_scale)] if self.time_scale != 1.0 else []),
                *extra,
            ]
        elif kind == "sglang-router":
            args = [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                self.host,
                "--port",
                str(port),
                "--policy",
                policy,
                "--worker-urls",
                *self.worker_urls,
                # Its Prometheus exporter binds 0.0.0.0:29000 by default, so a second router on
                # the machine would die at start: give it a free loopback port.
                "--prometheus-host",
                self.host,
                "--prometheus-port",
                str(free_port(self.host)),
                *extra,
            ]
        else:
            raise ValueError(f"unknown router kind {kind!r}; use kvroute or sglang-router")
        self._router = self._spawn(args, f"router-{kind}-{policy}", env)
        self.router_url = f"http://{self.host}:{port}"
        wait_healthy(self.router_url, 60, self._router)
        if kind == "sglang-router":
            # It answers /health before it has registered its workers (in the background);
            # traffic sent then would all go to whichever worker registered first.
            wait_registered(self.router_url, len(self.worker_urls), 60, self._router)
        return self.router_url

    def warm_up(self) -> None:
        """One tiny request through the router, then flush the workers.

        A fresh ``kvroute serve`` spends ~0.1 s of wall time on its first request (the
        upstream session, lazy imports); at a time scale of 10 that is a second of emulated
        latency for every request queued behind it, so runs start warm.
        """
        if self.router_url is None:
            raise RuntimeError("start a router before warming it up")
        body = json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
        req = urllib.request.Request(
            self.router_url + "/generate",
            data=body.encode(),
            headers={"Content-Type": "application/json"},  # sglang-router requires it
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
        self.flush()

    def flush(self) -> None:
        """Empty every worker's cache (between benchmark rows)."""
        for url in self.worker_urls:
            req = urllib.request.Request(url + "/flush_cache", method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{url} refused to flush its cache")

    def stop_router(self) -> None:
        if self._router is not None:
            _terminate(self._router)
            self._router, self.router_url, self.control_url = None, None, None

    def stop(self) -> None:
        self.stop_router()
        for proc in self._workers:
            _terminate(proc)
        self._workers.clear()
        self.worker_urls.clear()

    def __enter__(self) -> LocalCluster:
        self._sigterm_installed = exit_on_sigterm()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.stop()
        finally:
            if self._sigterm_installed:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                self._sigterm_installed = False


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> bool:
    """Make SIGTERM unwind the stack (so ``__exit__`` stops the children); True if installed.

    Python's default for SIGTERM ends the process at once, without running ``finally`` or
    ``__exit__``. Only the main thread may set a handler, and one the program set itself is
    left alone. A benchmark whose ``finally`` stops the processes it started calls it first.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _raise_exit)
    return True


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
