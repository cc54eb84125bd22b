"""A throwaway ``redis-server`` on loopback, for the tests and benchmarks that share a real
Redis between router replicas (``kvroute serve --redis-url``).

No persistence, its own process group; stopped with SIGKILL (what an outage looks like to the
routers, and nothing is lost that a later start would need). It keeps its port, so a test or a
fault run can stop it and start it again where the routers expect it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time

import redis

from sim.local_cluster import free_port

__all__ = ["RedisServer"]


class RedisServer:
    """``redis-server`` on 127.0.0.1:``port`` (default: a free port); ``start()`` it."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start it and wait until it answers PING; raise (and stop it) otherwise."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/ensure_redis.sh)")
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
        self.proc = subprocess.Popen(
            [exe, *args, "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, killed whole on stop
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2) as conn,
            ):
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not answer PING")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def client(self) -> redis.Redis:
        """A client of its own (the caller closes it)."""
        return redis.Redis.from_url(self.url)

    def flush(self) -> None:
        """FLUSHALL: forget every key."""
        client = self.client()
        try:
            client.flushall()
        finally:
            client.close()

    def exists(self, key: str) -> int:
        """EXISTS ``key``."""
        client = self.client()
        try:
            return int(client.exists(key))
        finally:
            client.close()
