"""Reliability figures for RELIABILITY.md: fault runs with counts, and a soak.

Fault runs: ``kvroute serve`` (lbgr, default reliability settings unless a run says
otherwise) in front of four ``kvroute emulate`` workers at ``--time-scale`` 10, one of them
behind an in-process fault proxy. An open-loop Poisson client (``--rate`` req/s, 64-token
prompts; 80% plain with 8-48 new tokens, 20% streamed with 100-400) runs ``--fault-s``
seconds per fault:

- ``baseline``: no fault;
- ``worker_sigkill``: SIGKILL one worker at 1/3 of the run, start it again (same port) at
  1/2; this run lasts 30 s longer, so the worker rejoins while the load still runs;
- ``worker_500``: the proxied worker answers 500 from 1/3 to 2/3 (its /health stays 200);
- ``slow_worker``: the proxied worker waits 5 s before answering, from 1/3 to 2/3, with
  ``first_byte_timeout_s`` 1 s;
- ``redis_restart``: two router replicas sharing a redis-server (``--redis-url``), the load
  alternating between them; Redis is SIGKILLed at 1/3 and started again at 1/2.

Counted per run: sent, succeeded (200, and a stream ending with ``[DONE]``), retried (the
answer came from attempt 2+: its decision id is ``<id>-n``), failed (an error status, or a
stream ending with the router's error event), lost (accepted and never answered: no status,
a reset, a client timeout, or a stream cut off without ``[DONE]`` or error event).

Soak: one router (lbgr) over two instant workers (``instant_worker.py``), nothing pinned
(other jobs share the machine; each window records the machine's load and the router's CPU).
First its max throughput, 64 connections closed loop, with ``wrk`` (for reference) and with
the soak's own Python client (the base: its CPU competes with the router's as it will in the
soak), then ``--soak-s`` seconds at ``--soak-load`` (0.8) of it with the open-loop client
(latency counted from each request's scheduled send time, so a stall is not hidden), 4,096
distinct prompts of 1-2k characters over 64 shared prefixes: errors, p99 per minute, router
RSS per minute (``/proc/PID/status``).

Writes ``results/reliability.json`` (``--quick``: ``reliability_quick.json``) and, with
``--markdown PATH``, the generated part of RELIABILITY.md between its markers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, base_parser, write_json

from sim.loadgen import default_control_url
from sim.local_cluster import exit_on_sigterm, free_port, free_port_pair, wait_healthy
from sim.local_redis import RedisServer

ADMIN_TOKEN = "reliability-benchmark-admin-token"  # the routers' control plane, on loopback
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- reliability:begin -->", "<!-- reliability:end -->"


# -- processes ------------------------------------------------------------------------------
def spawn(args: list[str], env: dict[str, str] | None = None, cpu: int | None = None) -> Any:
    prefix = ["taskset", "-c", str(cpu)] if cpu is not None and shutil.which("taskset") else []
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    full_env.update(env or {})
    return subprocess.Popen(
        [*prefix, *args],
        env=full_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def kill(proc: Any, sig: int = signal.SIGKILL) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def emulator(port: int, time_scale: float) -> Any:
    args = [sys.executable, "-m", "kvroute", "emulate", "--port", str(port)]
    return spawn([*args, "--time-scale", str(time_scale), "--seed", str(port)])


def router(
    workers: list[str], env: dict[str, str] | None = None, cpu: int | None = None, **flags: str
) -> tuple[str, Any]:
    port = free_port_pair()  # the control listener takes port + 1
    args = [sys.executable, "-m", "kvroute", "serve", "--port", str(port), "--policy", "lbgr"]
    for name, value in flags.items():
        args += [f"--{name.replace('_', '-')}", value]
    env = {"KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN, **(env or {})}  # /workers: the control plane
    proc = spawn([*args, "--log-level", "warning", "--worker-urls", *workers], env, cpu)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 90, proc)
    return url, proc


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds the process has used."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(match.group(1)) / 1024.0 if match else None


# -- the fault proxy ------------------------------------------------------------------------
class FaultProxy:
    """A worker's stand-in that forwards to it, or answers 500, or stalls: switched at run
    time by the fault schedule. Its /health always forwards (only the data plane fails)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.mode = "pass"  # pass | error500 | slow
        self.port = free_port()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession(auto_decompress=False)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "POST" and self.mode == "error500":
            return web.json_response({"error": {"message": "injected", "type": "x"}}, status=500)
        if request.method == "POST" and self.mode == "slow":
            await asyncio.sleep(5.0)
        assert self._session is not None
        resp = web.StreamResponse()
        with contextlib.suppress(ConnectionResetError):  # the router gave up (its timeout)
            async with self._session.request(
                request.method, self.target + request.path_qs, data=body, headers=_fwd(request)
            ) as upstream:
                resp.set_status(upstream.status)
                if "content-type" in upstream.headers:
                    resp.content_type = upstream.headers["content-type"].split(";")[0]
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
        return resp


def _fwd(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}


# -- the open-loop client -------------------------------------------------------------------
@dataclass
class Tally:
    sent: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    streams: int = 0
    streams_broken: int = 0
    statuses: dict[str, int] = field(default_factory=dict)

    def count(self, status: str) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float
) -> tuple[str, bool]:
    """('ok' | 'failed:<why>' | 'lost:<why>', retried)."""
    stream = bool(body.get("stream"))
    try:
        async with session.post(
            url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            retried = "-" in resp.headers.get("X-KVRoute-Decision-Id", "")
            data = await resp.read()
            if resp.status != 200:
                return f"failed:http_{resp.status}", retried
            if not stream:
                return "ok", retried
            tail = data.rstrip().rsplit(b"\n", 1)[-1]
            if tail == b"data: [DONE]":
                return "ok", retried
            if b'"upstream_broken"' in tail:
                return "failed:stream_error_event", retried
            return "lost:stream_cut", retried
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return f"lost:{type(exc).__name__}", False


def fault_body(rng: random.Random, i: int) -> dict[str, Any]:
    """64-token prompts; plain answers of 8-48 tokens, streams of 100-400 (0.3-1.2 s at time
    scale 10), so that some streams are under way whenever a fault strikes."""
    ids = [rng.randrange(50_000) for _ in range(64)]
    stream = rng.random() < 0.2
    tokens = rng.randint(100, 400) if stream else rng.randint(8, 48)
    params = {"max_new_tokens": tokens, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": params, "stream": stream}


async def open_loop(
    urls: list[str],
    rate: float,
    seconds: float,
    make_body: Callable[[random.Random, int], dict[str, Any]],
    on_result: Callable[[float, float, str, bool, bool], None],
    timeout_s: float = 120.0,
    seed: int = 0,
) -> float:
    """Poisson arrivals for ``seconds``; ``on_result(sched_s, latency_s, outcome, retried,
    stream)`` per answer; latency from the scheduled send time. Returns the wall time."""
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=512)
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        sched, i = 0.0, 0

        async def fire(at: float, body: dict[str, Any], url: str) -> None:
            outcome, retried = await one_request(session, url, body, timeout_s)
            done = time.perf_counter() - t0
            on_result(at, done - at, outcome, retried, bool(body.get("stream")))

        while True:
            sched += rng.expovariate(rate)
            if sched >= seconds:
                break
            delay = sched - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(fire(sched, make_body(rng, i), urls[i % len(urls)]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if tasks:
            await asyncio.gather(*tasks)
        return time.perf_counter() - t0


# -- fault runs -----------------------------------------------------------------------------
@dataclass
class Fleet:
    ports: list[int]
    procs: list[Any]
    proxy: FaultProxy
    time_scale: float

    @property
    def router_workers(self) -> list[str]:
        """What the router sees: worker 0 through the fault proxy, the others direct."""
        return [self.proxy.url] + [f"http://127.0.0.1:{p}" for p in self.ports[1:]]

    def restart(self, index: int) -> None:
        self.procs[index] = emulator(self.ports[index], self.time_scale)


async def poll_workers(url: str, victim: str, out: list[tuple[float, bool, str]]) -> None:
    """(t, healthy, circuit) of ``victim`` every 0.2 s, until cancelled."""
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(headers=ADMIN) as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
                async with session.get(default_control_url(url) + "/workers") as resp:
                    listed = (await resp.json())["workers"]
                w = next(x for x in listed if x["url"] == victim)
                out.append((time.perf_counter() - t0, w["healthy"], w["circuit"]))
            await asyncio.sleep(0.2)


def _ejected(row: tuple[float, bool, str]) -> bool:
    return not row[1] or row[2] == "open"


async def fault_run(
    name: str,
    fleet: Fleet,
    seconds: float,
    rate: float,
    schedule: Callable[[], Awaitable[dict[str, Any]]] | None,
    routers: list[str],
    victim: str | None = None,
) -> dict[str, Any]:
    tally = Tally()
    latencies: list[float] = []

    def on_result(at: float, lat: float, outcome: str, retried: bool, stream: bool) -> None:
        tally.sent += 1
        tally.streams += stream
        tally.retried += retried
        tally.count(outcome)
        if outcome == "ok":
            tally.succeeded += 1
            latencies.append(lat)
        elif outcome.startswith("failed"):
            tally.failed += 1
            tally.streams_broken += outcome == "failed:stream_error_event"
        else:
            tally.lost += 1

    polled: list[tuple[float, bool, str]] = []
    poller = asyncio.create_task(poll_workers(routers[0], victim, polled)) if victim else None
    load = asyncio.create_task(open_loop(routers, rate, seconds, fault_body, on_result))
    notes = await schedule() if schedule is not None else {}
    await load
    if poller is not None:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
    if polled and "fault_at_s" in notes:
        at = notes["fault_at_s"]
        eject = next((t for t, *rest in polled if t >= at and _ejected((t, *rest))), None)
        notes["ejected_after_s"] = round(eject - at, 2) if eject is not None else None
        back_at = notes.get("recovered_at_s")
        if back_at is not None and eject is not None:
            rejoin = next(
                (t for t, *rest in polled if t >= back_at and not _ejected((t, *rest))), None
            )
            notes["rejoined_after_s"] = round(rejoin - back_at, 2) if rejoin else None
    latencies.sort()
    return {
        "run": name,
        "seconds": seconds,
        **asdict(tally),
        "p50_s": _pct(latencies, 50),
        "p99_s": _pct(latencies, 99),
        **notes,
    }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q / 100.0 * len(values)))], 4)


async def fault_runs(args: Any) -> list[dict[str, Any]]:
    scale = 10.0
    ports = [free_port() for _ in range(4)]
    procs = [emulator(p, scale) for p in ports]
    proxy = FaultProxy(f"http://127.0.0.1:{ports[0]}")
    fleet = Fleet(ports, procs, proxy, scale)
    rows: list[dict[str, Any]] = []
    try:
        for port, proc in zip(ports, procs, strict=True):
            await asyncio.to_thread(wait_healthy, f"http://127.0.0.1:{port}", 120, proc)
        await proxy.start()
        d = args.fault_s
        for name in args.faults:
            print(f"fault run {name} ({d:g} s at {args.rate:g} req/s) ...", file=sys.stderr)
            rows.append(await _one_fault(name, fleet, d, args.rate))
            print(f"  {rows[-1]}", file=sys.stderr)
    finally:
        await proxy.stop()
        for proc in fleet.procs:
            kill(proc)
    return rows


async def _one_fault(name: str, fleet: Fleet, d: float, rate: float) -> dict[str, Any]:
    env: dict[str, str] = {}
    if name == "slow_worker":
        env["KVROUTE_FIRST_BYTE_TIMEOUT_S"] = "1.0"
    if name == "redis_restart":
        return await _redis_fault(fleet, d, rate)
    url, proc = await asyncio.to_thread(router, fleet.router_workers, env)
    try:
        await _warm(url)
        t0 = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - t0

        victim_index = 1 if name == "worker_sigkill" else 0
        victim = fleet.router_workers[victim_index]

        async def schedule() -> dict[str, Any]:
            if name == "baseline":
                return {}
            await asyncio.sleep(d / 3)
            at = now()
            if name == "worker_sigkill":
                kill(fleet.procs[victim_index])
                await asyncio.sleep(d / 6)
                fleet.restart(victim_index)
                port = fleet.ports[victim_index]
                await asyncio.to_thread(
                    wait_healthy, f"http://127.0.0.1:{port}", 120, fleet.procs[victim_index]
                )
                return {"fault_at_s": round(at, 2), "recovered_at_s": round(now(), 2)}
            fleet.proxy.mode = "error500" if name == "worker_500" else "slow"
            await asyncio.sleep(d / 3)
            fleet.proxy.mode = "pass"
            return {"fault_at_s": round(at, 2), "recovered_at_s": round(now(), 2)}

        # A restarted emulator needs 10-20 s to import and bind on this machine: the kill run
        # goes on long enough to see the worker rejoin under traffic.
        seconds = d + 30.0 if name == "worker_sigkill" else d
        row = await fault_run(name, fleet, seconds, rate, schedule, [url], victim)
        row["circuit_opens"] = await _circuit_opens(url, victim)
        return row
    finally:
        kill(proc, signal.SIGTERM)


async def _redis_fault(fleet: Fleet, d: float, rate: float) -> dict[str, Any]:
    redis = RedisServer().start()
    redis_url = redis.url
    replicas = []
    try:
        for i in range(2):
            flags = {"redis_url": redis_url, "replica_id": f"r{i}", "cluster": "reliability"}
            replicas.append(await asyncio.to_thread(router, fleet.router_workers, None, **flags))
        for url, _ in replicas:
            await _warm(url)
        t0 = time.perf_counter()

        async def schedule() -> dict[str, Any]:
            await asyncio.sleep(d / 3)
            at = time.perf_counter() - t0
            redis.stop()
            await asyncio.sleep(d / 6)
            await asyncio.to_thread(redis.start)
            return {
                "fault_at_s": round(at, 2),
                "recovered_at_s": round(time.perf_counter() - t0, 2),
            }

        row = await fault_run("redis_restart", fleet, d, rate, schedule, [u for u, _ in replicas])
        row["replicas"] = 2
        row["store"] = [await _store(u) for u, _ in replicas]
        return row
    finally:
        for _, proc in replicas:
            kill(proc, signal.SIGTERM)
        redis.stop()


async def _warm(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for i in range(8):
            body = {"input_ids": [1, 2, 3, i], "sampling_params": {"max_new_tokens": 1}}
            async with session.post(url + "/generate", json=body) as resp:
                await resp.read()


async def _circuit_opens(url: str, worker: str) -> int | None:
    async with (
        aiohttp.ClientSession(headers=ADMIN) as session,
        session.get(default_control_url(url) + "/workers") as resp,
    ):
        listed = (await resp.json())["workers"]
    return next((w["circuit_opens"] for w in listed if w["url"] == worker), None)


async def _store(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
        store: dict[str, Any] = (await resp.json())["store"]
    return {k: store.get(k) for k in ("mode", "outages", "fallback_operations")}


# -- soak -----------------------------------------------------------------------------------
# 64 shared prefixes x 64 suffixes: 4,096 distinct prompts of 1-2k characters. Bounded on
# purpose: the prefix index and the decision ring buffer fill up in the warm-up, so growth
# after it is a leak, not a cache filling (see RELIABILITY.md for unbounded prompts).
_PREFIXES = ["".join(random.Random(i).choices("abcdefgh ", k=1024)) for i in range(64)]
_SUFFIXES = [
    "".join(random.Random(-i).choices("abcdefgh ", k=random.Random(i).randint(1, 1024)))
    for i in range(1, 65)
]


def soak_body(rng: random.Random, i: int) -> dict[str, Any]:
    text = rng.choice(_PREFIXES) + rng.choice(_SUFFIXES)
    return {"text": text, "sampling_params": {"max_new_tokens": 4}, "stream": rng.random() < 0.1}


_WRK_LUA = """
math.randomseed(7)
local prefixes = {}
for i = 1, 64 do
  local t = {}
  for j = 1, 1024 do t[j] = string.char(97 + math.random(0, 7)) end
  prefixes[i] = table.concat(t)
end
local suffixes = {}
for i = 1, 64 do
  local t = {}
  for j = 1, math.random(1, 1024) do t[j] = string.char(97 + math.random(0, 7)) end
  suffixes[i] = table.concat(t)
end
request = function()
  local body = '{"text": "' .. prefixes[math.random(1, 64)] .. suffixes[math.random(1, 64)] ..
    '", "sampling_params": {"max_new_tokens": 4}}'
  return wrk.format("POST", nil, {["Content-Type"] = "application/json"}, body)
end
"""


def wrk_max_rps(url: str, seconds: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as fh:
        fh.write(_WRK_LUA)
    try:
        args = ["wrk", "-t2", "-c64", f"-d{int(seconds)}s", "-s", fh.name, url + "/generate"]
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(fh.name)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {
        "max_rps": float(rps.group(1)) if rps else 0.0,
        "non_2xx": int(bad.group(1)) if bad else 0,
        "socket_errors": errors.group(1) if errors else None,
    }


async def closed_loop_max_rps(url: str, seconds: float, connections: int = 64) -> float:
    """Max throughput as the soak's own client drives it: ``connections`` loops sending back
    to back. The client's CPU counts against the machine as it will in the soak."""
    rng = random.Random(2)
    done = 0
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        stop = time.perf_counter() + seconds

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                outcome, _ = await one_request(session, url, soak_body(rng, 0), 60.0)
                done += outcome == "ok"

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(connections)))
        return done / (time.perf_counter() - t0)


async def soak(args: Any) -> dict[str, Any]:
    ports = [free_port(), free_port()]
    workers = [spawn([sys.executable, str(HERE / "instant_worker.py"), str(p)]) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    proc = None
    try:
        for url, w in zip(urls, workers, strict=True):
            await asyncio.to_thread(wait_healthy, url, 30, w)
        url, proc = await asyncio.to_thread(router, urls)
        print("soak: measuring max throughput with wrk ...", file=sys.stderr)
        wrk = await asyncio.to_thread(wrk_max_rps, url, args.wrk_s)
        print(f"soak: wrk {wrk}; now the soak's client, closed loop ...", file=sys.stderr)
        wrk["client_max_rps"] = round(await closed_loop_max_rps(url, args.wrk_s), 1)
        rate = args.soak_load * wrk["client_max_rps"]
        print(f"soak: {wrk}; now {args.soak_s:g} s at {rate:.0f} req/s", file=sys.stderr)
        minutes = await _soak_at(url, proc.pid, rate, args.soak_s, args.soak_window_s)
    finally:
        kill(proc, signal.SIGTERM)
        for w in workers:
            kill(w, signal.SIGTERM)
    return {"wrk": wrk, "load": args.soak_load, "rate": rate, **_soak_summary(minutes, args)}


async def _soak_at(
    url: str, pid: int, rate: float, seconds: float, window_s: float
) -> list[dict[str, Any]]:
    windows: dict[int, dict[str, Any]] = {}

    def window(t: float) -> dict[str, Any]:
        k = int(t // window_s)
        return windows.setdefault(k, {"lat": [], "sent": 0, "errors": 0, "lost": 0, "rss": []})

    def on_result(at: float, lat: float, outcome: str, retried: bool, stream: bool) -> None:
        w = window(at)
        w["sent"] += 1
        if outcome == "ok":
            w["lat"].append(lat)
        elif outcome.startswith("failed"):
            w["errors"] += 1
        else:
            w["lost"] += 1

    async def sample_rss() -> None:
        t0 = time.perf_counter()
        while True:
            w = window(time.perf_counter() - t0)
            w["rss"].append(rss_mib(pid))
            w["load1"] = os.getloadavg()[0]
            w["cpu_s"] = cpu_s(pid)
            await asyncio.sleep(min(5.0, window_s / 4))

    sampler = asyncio.create_task(sample_rss())
    wall = await open_loop([url], rate, seconds, soak_body, on_result, timeout_s=600.0, seed=1)
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler
    out = []
    cpu_before = 0.0
    for k in sorted(windows):
        w = windows[k]
        if not w["sent"]:
            continue
        lat = sorted(w["lat"])
        rss = [r for r in w["rss"] if r is not None]
        cpu = w.get("cpu_s")
        out.append(
            {
                "window": k + 1,
                "sent": w["sent"],
                "rps": round(w["sent"] / window_s, 1),
                "errors": w["errors"],
                "lost": w["lost"],
                "p50_ms": _ms(_pct(lat, 50)),
                "p99_ms": _ms(_pct(lat, 99)),
                "rss_mib": round(rss[-1], 1) if rss else None,
                "router_cpu": round((cpu - cpu_before) / window_s, 2) if cpu else None,
                "load1": round(w["load1"], 2) if "load1" in w else None,
            }
        )
        cpu_before = cpu or cpu_before
    out[-1]["wall_s"] = round(wall, 1)
    return out


def _ms(value: float | None) -> float | None:
    return round(value * 1000.0, 2) if value is not None else None


def _soak_summary(minutes: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    warm = minutes[1:] if len(minutes) > 1 else minutes  # the first window is the warm-up
    rss0, rss1 = warm[0]["rss_mib"], warm[-1]["rss_mib"]
    p99 = [m["p99_ms"] for m in warm if m["p99_ms"] is not None]
    return {
        "seconds": args.soak_s,
        "window_s": args.soak_window_s,
        "windows": minutes,
        "sent": sum(m["sent"] for m in minutes),
        "errors": sum(m["errors"] for m in minutes),
        "lost": sum(m["lost"] for m in minutes),
        "rss_after_warmup_mib": rss0,
        "rss_end_mib": rss1,
        "rss_growth_after_warmup": round((rss1 - rss0) / rss0, 4) if rss0 and rss1 else None,
        "p99_first_ms": p99[0] if p99 else None,
        "p99_last_ms": p99[-1] if p99 else None,
        "p99_max_ms": max(p99) if p99 else None,
    }


# -- report ---------------------------------------------------------------------------------
def render(result: dict[str, Any]) -> str:
    lines = []
    faults = result.get("faults")
    if faults:
        lines += [
            (
                f"### Fault runs: {result['fault_s']:g} s each at {result['rate']:g} req/s "
                "(open loop, 20% streamed), 4 emulated workers at time scale 10"
            ),
            "",
            (
                "| run | s | sent | succeeded | retried | failed | lost | streams broken "
                "| p50 (s) | p99 (s) | ejected after (s) | rejoined after (s) | circuit opens |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in faults:
            lines.append(
                f"| {r['run']} | {r['seconds']:g} | {r['sent']} | {r['succeeded']} | "
                f"{r['retried']} | "
                f"{r['failed']} | {r['lost']} | {r['streams_broken']} | {_f(r['p50_s'])} | "
                f"{_f(r['p99_s'])} | {_f(r.get('ejected_after_s'))} | "
                f"{_f(r.get('rejoined_after_s'))} | {_f(r.get('circuit_opens'))} |"
            )
        lines.append("")
        for r in faults:
            others = {k: v for k, v in r["statuses"].items() if k != "ok"}
            if others:
                lines.append(f"- {r['run']}: outcomes other than ok: {others}")
        lines.append("")
    s = result.get("soak")
    if s:
        lines += [
            (
                f"### Soak: {s['seconds']:g} s at {s['load']:.0%} of max throughput "
                f"({s['rate']:.0f} of {s['wrk']['client_max_rps']:.0f} req/s)"
            ),
            "",
            (
                f"Max throughput, 64 connections closed loop: {s['wrk']['client_max_rps']:.0f} "
                f"req/s with the soak's own Python client (the base of the soak's rate), "
                f"{s['wrk']['max_rps']:.0f} req/s with wrk."
            ),
            "",
            (
                f"Sent {s['sent']}, errors {s['errors']}, lost {s['lost']}; router RSS "
                f"{_f(s['rss_after_warmup_mib'])} MiB after the warm-up window, "
                f"{_f(s['rss_end_mib'])} MiB at the end "
                f"({_pct_text(s['rss_growth_after_warmup'])}); p99 {_f(s['p99_first_ms'])} ms "
                f"in the first window after warm-up, {_f(s['p99_last_ms'])} ms in the last, "
                f"{_f(s['p99_max_ms'])} ms at worst."
            ),
            "",
            (
                f"| window ({s['window_s']:g} s) | sent | req/s | errors | lost | p50 (ms) "
                "| p99 (ms) | router RSS (MiB) | router CPU (cores) | machine load (1 min) |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in s["windows"]:
            lines.append(
                f"| {m['window']} | {m['sent']} | {m['rps']} | {m['errors']} | {m['lost']} | "
                f"{_f(m['p50_ms'])} | {_f(m['p99_ms'])} | {_f(m['rss_mib'])} | "
                f"{_f(m['router_cpu'])} | {_f(m['load1'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def _f(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _pct_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1%}"


def write_markdown(path: Path, text: str, command: str) -> None:
    block = f"{BEGIN}\n_Generated by `{command}`._\n\n{text}\n{END}"
    if path.exists() and BEGIN in (old := path.read_text()) and END in old:
        head, rest = old.split(BEGIN, 1)
        path.write_text(head + block + rest.split(END, 1)[1])
    else:
        path.write_text(f"# Reliability\n\n{block}\n")


def main() -> int:
    exit_on_sigterm()  # so the finally blocks stop the processes this started
    parser = base_parser("reliability", __doc__)
    parser.add_argument("--rate", type=float, default=40.0, help="fault runs' req/s")
    parser.add_argument("--fault-s", type=float, default=30.0)
    parser.add_argument(
        "--faults",
        nargs="+",
        default=["baseline", "worker_sigkill", "worker_500", "slow_worker", "redis_restart"],
    )
    parser.add_argument("--soak-s", type=float, default=600.0)
    parser.add_argument("--soak-window-s", type=float, default=60.0)
    parser.add_argument("--soak-load", type=float, default=0.8)
    parser.add_argument("--wrk-s", type=float, default=10.0)
    parser.add_argument("--only", choices=["faults", "soak"], default=None)
    parser.add_argument("--markdown", type=Path, default=None, help="e.g. RELIABILITY.md")
    args = parser.parse_args()
    if args.quick:
        args.fault_s, args.soak_s, args.soak_window_s, args.wrk_s = 15.0, 60.0, 10.0, 5.0
        if args.out == REPO_ROOT / "results" / "reliability.json":
            args.out = REPO_ROOT / "results" / "reliability_quick.json"
    result: dict[str, Any] = {"rate": args.rate, "fault_s": args.fault_s}
    uvloop.install()  # the client's own CPU cost halves: less noise on a shared machine
    if args.only in (None, "faults"):
        result["faults"] = asyncio.run(fault_runs(args))
    if args.only in (None, "soak"):
        result["soak"] = asyncio.run(soak(args))
    text = render(result)
    print(text)
    write_json(args.out, "reliability", result)
    if args.markdown is not None:
        command = "python " + " ".join(["benchmarks/reliability.py", *sys.argv[1:]])
        write_markdown(args.markdown, text, command)
    print(json.dumps({"out": str(args.out)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
