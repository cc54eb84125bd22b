"""Redis beyond one node for the router's tests: a real Redis Cluster (three
``redis-server --cluster-enabled yes`` processes on loopback, joined with ``redis-cli
--cluster create``) and a real Sentinel set-up (a primary, a replica and one Sentinel), each
started and stopped by the test that uses it. Every process runs in its own process group,
killed whole on stop."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis
from router_harness import port_outside_ephemeral_range, wait_until

SENTINEL_SERVICE = "kvroute-primary"


def require_redis_tools() -> None:
    missing = [t for t in ("redis-server", "redis-cli") if shutil.which(t) is None]
    if not missing:
        return
    if os.geteuid() == 0:
        pytest.fail(
            f"{' and '.join(missing)} not installed; scripts/test.sh installs them "
            "(apt-get install redis-server, which brings redis-tools) when run as root"
        )
    pytest.skip(f"{' and '.join(missing)} not installed and we are not root to install it")


class _Processes:
    """redis-server processes of one topology, in a scratch directory of their own."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvroute-redis-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, port: int, *args: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        log = open(self.dir / f"{port}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs[port] = subprocess.Popen(
            [exe, *args],
            cwd=self.dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()  # the child holds its own descriptor
        if not wait_until(lambda: self._pong(port), 10):
            raise RuntimeError(f"redis-server on {port} did not answer PING: {self.log(port)}")

    def log(self, port: int) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / f"{port}.log").read_text()[-2000:]
        return ""

    def _pong(self, port: int) -> bool:
        proc = self.procs[port]
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on {port} exited: {self.log(port)}")
        client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port, None)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)


def _server_args(port: int) -> list[str]:
    return [
        "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "no",
        "--save", "", "--appendonly", "no",
    ]  # fmt: skip


class RedisClusterNodes:
    """Three primaries (no replicas) sharing the 16,384 slots."""

    def __init__(self) -> None:
        self.ports = [port_outside_ephemeral_range() for _ in range(3)]
        # Each node's cluster bus too: by default it is the port + 10000, which may lie in
        # the ephemeral range, where an outgoing connection once took it (bind: Address
        # already in use).
        self.bus_ports = [port_outside_ephemeral_range() for _ in range(3)]
        self.processes = _Processes()

    @property
    def url(self) -> str:
        """Two of the three as startup nodes: the client finds the third itself."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])

    def start(self) -> RedisClusterNodes:
        try:
            for port, bus in zip(self.ports, self.bus_ports, strict=True):
                self.processes.spawn(
                    port,
                    *_server_args(port),
                    "--cluster-enabled", "yes",
                    "--cluster-port", str(bus),
                    "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", "2000",
                )  # fmt: skip
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *nodes,
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            if not wait_until(self._ok, 20, 0.1):
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
        except BaseException:
            self.stop()
            raise
        return self

    def _ok(self) -> bool:
        for port in self.ports:
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                info = client.cluster("INFO")  # parsed into a dict by redis-py
            finally:
                client.close()
            if info.get("cluster_state") != "ok":
                return False
        return True

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.ports[0])

    def keys(self, pattern: str) -> list[bytes]:
        """Every node's keys matching ``pattern``."""
        found: list[bytes] = []
        for port in self.ports:
            with redis.Redis(port=port, socket_timeout=2) as node:
                found += node.keys(pattern)
        return found

    def stop(self) -> None:
        self.processes.stop()


class SentinelSet:
    """A primary, its replica and one Sentinel watching them (quorum 1, the primary declared
    down after 500 ms without an answer)."""

    def __init__(self) -> None:
        self.primary_port = port_outside_ephemeral_range()
        self.replica_port = port_outside_ephemeral_range()
        self.sentinel_port = port_outside_ephemeral_range()
        self.processes = _Processes()

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SENTINEL_SERVICE}"

    def start(self) -> SentinelSet:
        try:
            self.processes.spawn(self.primary_port, *_server_args(self.primary_port))
            self.processes.spawn(
                self.replica_port,
                *_server_args(self.replica_port),
                "--replicaof", "127.0.0.1", str(self.primary_port),
            )  # fmt: skip
            if not wait_until(self._replica_linked, 10, 0.05):
                raise RuntimeError("the replica did not link to the primary")
            config = self.processes.dir / "sentinel.conf"  # Sentinel rewrites it: a copy
            config.write_text(
                f"port {self.sentinel_port}\nbind 127.0.0.1\nprotected-mode no\n"
                f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {self.primary_port} 1\n"
                f"sentinel down-after-milliseconds {SENTINEL_SERVICE} 500\n"
                f"sentinel failover-timeout {SENTINEL_SERVICE} 5000\n"
            )
            self.processes.spawn(self.sentinel_port, str(config), "--sentinel")
            if not wait_until(self._sentinel_sees_replica, 10, 0.05):
                raise RuntimeError("the Sentinel did not find the replica")
        except BaseException:
            self.stop()
            raise
        return self

    def _replica_linked(self) -> bool:
        client = redis.Redis(port=self.replica_port, socket_timeout=1)
        try:
            return bool(client.info("replication").get("master_link_status") == "up")
        finally:
            client.close()

    def _sentinel(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_port, socket_timeout=1, decode_responses=True)

    def _sentinel_sees_replica(self) -> bool:
        with self._sentinel() as client:
            replicas = client.execute_command("SENTINEL", "REPLICAS", SENTINEL_SERVICE)
        # Parsed by redis-py into one dict per replica; linked: ready to be promoted.
        return any(
            r.get("port") == str(self.replica_port) and r.get("master-link-status") == "ok"
            for r in replicas or []
        )

    def primary(self) -> int:
        """The port the Sentinel names as the primary now."""
        with self._sentinel() as client:
            host_port = client.execute_command(
                "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_SERVICE
            )
        return int(host_port[1])

    def kill_primary(self) -> float:
        """SIGKILL the primary; the monotonic time it died."""
        self.processes.kill(self.primary_port)
        return time.monotonic()

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2)

    def stop(self) -> None:
        self.processes.stop()
