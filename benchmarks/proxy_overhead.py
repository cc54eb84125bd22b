"""Proxy overhead on loopback with instant workers: kvroute side by side with sglang-router.

The targets: added p50 <= 2 ms at 200 req/s, and >= 1,000 req/s through one router
process. Two instant workers (``instant_worker.py``) answer at once, so what a client sees
beyond the direct-to-worker latency is the router. For each set-up, measured in one run:

- latency at a fixed rate: an open-loop aiohttp client sends ``--rate`` req/s for
  ``--seconds`` s (non-streaming and streaming, distinct 2k-character prompts sharing a
  prefix); added latency = router percentile - direct percentile;
- max throughput: ``wrk`` (C, closed loop, 64 connections, 2 threads) for ``--seconds`` s.

The router process is pinned to CPU 0 and the workers and clients to CPU 1 (2-core
machine), so neither side starves the other. kvroute runs its own ``kvroute serve`` with
``round_robin`` (pure proxy cost) and ``lbgr`` (plus routing); sglang-router (PyPI 0.3.2)
runs ``round_robin`` and ``cache_aware``.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import base_parser, write_json

from sim.local_cluster import exit_on_sigterm, free_port, free_port_pair, wait_healthy

HERE = Path(__file__).resolve().parent
SETUPS = [
    ("direct", "-"),
    ("kvroute", "round_robin"),
    ("kvroute", "lbgr"),
    ("sglang-router", "round_robin"),
    ("sglang-router", "cache_aware"),
]


def _spawn(args: list[str], cpu: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["taskset", "-c", str(cpu), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_router(kind: str, policy: str, workers: list[str]) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port_pair()  # kvroute's control listener takes port + 1
    if kind == "kvroute":
        args = [
            sys.executable,
            "-m",
            "kvroute",
            "serve",
            "--port",
            str(port),
            "--policy",
            policy,
            "--log-level",
            "warning",
            "--worker-urls",
            *workers,
        ]
    else:
        args = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--port",
            str(port),
            "--policy",
            policy,
            "--worker-urls",
            *workers,
            "--log-level",
            "warn",
            "--prometheus-port",  # its default (29000) may be taken by another router
            str(free_port()),
        ]
    proc = _spawn(args, 0)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60, proc)
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"{kind} {policy} did not start ({exc}); args: {args}") from None
    return url, proc


def prompts(n: int) -> list[str]:
    rng = random.Random(0)
    prefix = "".join(rng.choices("abcdefgh ", k=1024))
    return [prefix + "".join(rng.choices("abcdefgh ", k=1024)) for _ in range(n)]


async def fixed_rate(url: str, rate: float, seconds: float, stream: bool) -> list[float]:
    texts = prompts(int(rate * seconds))
    lat: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def one(i: int, text: str) -> None:
            delay = i / rate - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            start = time.perf_counter()
            body = {"text": text, "stream": stream, "sampling_params": {"max_new_tokens": 4}}
            async with session.post(url + "/generate", json=body) as resp:
                await resp.read()
                if resp.status == 200:
                    lat.append((time.perf_counter() - start) * 1000.0)

        await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
    return sorted(lat)


def wrk_throughput(url: str, seconds: float, stream: bool) -> float:
    script = (
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.body = \'{{"text": "hello world, a short prompt", "stream": '
        f'{"true" if stream else "false"}, "sampling_params": {{"max_new_tokens": 4}}}}\'\n'
    )
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as fh:
        fh.write(script)
    try:
        out = subprocess.run(
            [
                "taskset",
                "-c",
                "1",
                "wrk",
                "-t2",
                "-c64",
                f"-d{int(seconds)}s",
                "-s",
                fh.name,
                url + "/generate",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.unlink(fh.name)
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        print(f"  wrk saw {errors.group(1)} non-2xx responses", file=sys.stderr)
    return float(match.group(1)) if match else 0.0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q / 100.0 * len(values)))]


def measure(url: str, rate: float, seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for stream in (False, True):
        tag = "stream" if stream else "plain"
        lat = asyncio.run(fixed_rate(url, rate, seconds, stream))
        row[f"{tag}_p50_ms"] = pct(lat, 50)
        row[f"{tag}_p99_ms"] = pct(lat, 99)
        row[f"{tag}_ok"] = len(lat)
        row[f"{tag}_max_rps"] = wrk_throughput(url, seconds, stream)
    return row


def main() -> int:
    exit_on_sigterm()  # so the finally blocks stop the processes this started
    parser = base_parser("proxy_overhead", __doc__)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    seconds = 3.0 if args.quick else args.seconds
    ports = [free_port(), free_port()]
    workers = [_spawn([sys.executable, str(HERE / "instant_worker.py"), str(p)], 1) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rows = []
    try:
        for url, proc in zip(urls, workers, strict=True):
            wait_healthy(url, 30, proc)
        for kind, policy in SETUPS:
            print(f"measuring {kind} {policy} ...", file=sys.stderr)
            if kind == "direct":
                rows.append(
                    {"router": kind, "policy": policy, **measure(urls[0], args.rate, seconds)}
                )
                continue
            url, proc = start_router(kind, policy, urls)
            try:
                rows.append({"router": kind, "policy": policy, **measure(url, args.rate, seconds)})
            finally:
                _stop(proc)
    finally:
        for proc in workers:
            _stop(proc)
    report(rows, args.rate, seconds)
    write_json(args.out, "proxy_overhead", {"rows": rows, "rate": args.rate, "seconds": seconds})
    return 0


def report(rows: list[dict[str, Any]], rate: float, seconds: float) -> None:
    base = rows[0]
    print(
        f"## Proxy overhead, instant workers, {rate:g} req/s for {seconds:g} s; "
        "max throughput with wrk (64 connections)\n"
    )
    print(
        "| router | policy | added p50 (ms) | added p99 (ms) | stream added p50 (ms) | "
        "stream added p99 (ms) | max req/s | stream max req/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:

        def added(key: str, r: dict[str, Any] = r) -> str:
            if r is base:
                return f"({r[key]:.2f} direct)"
            return f"{r[key] - base[key]:.2f}" if r[key] is not None else "failed"

        print(
            f"| {r['router']} | {r['policy']} | {added('plain_p50_ms')} | "
            f"{added('plain_p99_ms')} | {added('stream_p50_ms')} | {added('stream_p99_ms')} | "
            f"{r['plain_max_rps']:.0f} | {r['stream_max_rps']:.0f} |"
        )
    ours = [r for r in rows if r["router"] == "kvroute"]
    theirs = [r for r in rows if r["router"] == "sglang-router"]
    if ours and theirs:
        best_theirs = max(r["plain_max_rps"] for r in theirs)
        for r in ours:
            print(
                f"\nkvroute {r['policy']}: max throughput {r['plain_max_rps']:.0f} req/s = "
                f"{r['plain_max_rps'] / best_theirs:.2f}x sglang-router's best "
                f"({best_theirs:.0f}); added p50 "
                f"{(r['plain_p50_ms'] or 0) - base['plain_p50_ms']:.2f} ms "
                f"(target <= 2 ms), >= 1,000 req/s: "
                f"{'met' if r['plain_max_rps'] >= 1000 else 'NOT met'}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
