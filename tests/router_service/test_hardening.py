"""Attacks on the router, replayed against real processes on loopback (RELIABILITY.md, *Security*).

Each test is one finding: the attack as it was reproduced, and what the router must do
instead. ``RELIABILITY.md`` (*Security*) lists them with what was observed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis
from fake_worker import FakeWorker
from router_harness import RouterServer, free_port, wait_until


# -- real processes -------------------------------------------------------------------------
@dataclass
class Process:
    """A ``python -m kvroute ...`` process, killed with its group at the end."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: str
    control_url: str = ""

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _up(url: str, path: str) -> bool:
    try:
        with urllib.request.urlopen(url + path, timeout=1) as resp:
            return bool(resp.status < 500)
    except urllib.error.HTTPError:
        return True  # it answers, with an error: it is up
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def spawn(tmp_path: Any) -> Iterator[Callable[..., Process]]:
    """``spawn("serve", "--port", ...)``: a kvroute process; waits until it answers."""
    started: list[Process] = []

    def make(
        *args: str, port: int, env: dict[str, str] | None = None, ready: str = "/health"
    ) -> Process:
        control = ""
        if args[0] == "serve" and "--control-port" not in args:
            control_port = free_port()
            args = (*args, "--control-port", str(control_port))
            control = f"http://127.0.0.1:{control_port}"
        log_path = str(tmp_path / f"{args[0]}-{port}.log")
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvroute", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**clean, **(env or {})},
                start_new_session=True,
            )
        process = Process(proc, f"http://127.0.0.1:{port}", log_path, control)
        started.append(process)
        alive = wait_until(lambda: proc.poll() is not None or _up(process.url, ready), 90, 0.1)
        assert alive, process.log()
        assert proc.poll() is None, process.log()
        return process

    yield make
    for process in reversed(started):
        process.stop()


# -- F1: a permanent outage in 29 requests --------------------------------------------------
SURROGATE = b'{"text":"\\ud800x","sampling_params":{"max_new_tokens":2}}'
HUGE_OUTPUT = {"text": "zz", "sampling_params": {"max_new_tokens": 2147483647}}


@pytest.mark.slow
def test_f1_the_29_request_outage_replayed(spawn: Callable[..., Process]) -> None:
    """The reported attack on ``kvroute serve`` in front of a real emulated worker: 22 lone
    surrogates, the breaker's open window, 7 requests the worker refuses. Before the fix the
    surrogates reached the worker (500s: its circuit opened) and the 4xx trials kept the
    circuit half-open for good; every later request got 503 while /health said "ok"."""
    wport, rport = free_port(), free_port()
    worker = spawn("emulate", "--port", str(wport), "--time-scale", "10", port=wport)
    router = spawn(
        "serve", "--port", str(rport), "--worker-urls", worker.url,
        port=rport,
        env={"KVROUTE_BREAKER_OPEN_S": "0.5", "KVROUTE_HEALTH_INTERVAL_S": "60"},
    )  # fmt: skip
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for _ in range(22):
            resp = client.post("/generate", content=SURROGATE)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == "text"
            assert "surrogate" in error["message"]
        health = client.get("/health").json()
        assert health["status"] == "ok"
        assert health["workers"]["w0"]["circuit"] == "closed"  # workers by label by default
        for _ in range(7):
            resp = client.post("/generate", json=HUGE_OUTPUT)
            assert resp.status_code == 400, resp.text  # the worker's own refusal, relayed
        for i in range(5):
            resp = client.post("/generate", json={"text": f"hello {i}"})
            assert resp.status_code == 200, resp.text
        assert client.get("/health").json()["workers"]["w0"]["circuit"] == "closed"


@pytest.mark.slow
def test_f1_client_errors_during_half_open_never_lock_a_worker_out(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    """The breaker half of F1: a worker's 500s open its circuit; once the window is over the
    trial requests get 4xx answers (the client's fault). They must free their trial slots
    and count for nothing, so later requests are trials too, and successes close it."""
    worker = workers("w")
    worker.fail_status = 500
    router = routers(
        worker_urls=[worker.url],
        policy="round_robin",
        breaker_failures=3,
        breaker_successes=2,
        breaker_open_s=0.3,
        health_interval_s=60,
    )
    client = router.client
    assert [client.post("/generate", json={"text": "x"}).status_code for _ in range(3)] == [500] * 3
    health = client.get("/health")
    assert health.status_code == 503  # no worker can take a request: /health says so
    body = health.json()
    assert body["status"] == "unavailable"
    assert (body["healthy_workers"], body["routable_workers"]) == (1, 0)
    assert body["workers"][worker.url]["circuit"] == "open"
    assert "circuit open" in body["workers"][worker.url]["reason"]
    assert client.post("/generate", json={"text": "x"}).status_code == 503

    assert wait_until(lambda: client.get("/health").json()["routable_workers"] == 1, 5)
    worker.fail_status = 400
    statuses = [client.post("/generate", json={"text": "x"}).status_code for _ in range(10)]
    assert statuses == [400] * 10  # every one reached the worker: no slot was lost
    assert client.get("/health").json()["workers"][worker.url]["circuit"] == "half_open"
    worker.fail_status = None
    statuses = [client.post("/generate", json={"text": "x"}).status_code for _ in range(5)]
    assert statuses == [200] * 5
    health = client.get("/health").json()
    assert health["status"] == "ok"
    assert health["workers"][worker.url]["circuit"] == "closed"


def test_lone_surrogates_are_refused_wherever_they_are_and_pairs_pass(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("w")
    router = routers(worker_urls=[worker.url])
    bad = [
        ("/generate", b'{"text": "ok \\uDFFF"}', "text"),
        ("/v1/completions", b'{"prompt": ["fine", "\\ud83d"]}', "prompt[1]"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a\\udc00b"}]}',
            "messages[0].content",
        ),
        (
            "/generate",
            b'{"text": "x", "sampling_params": {"stop": ["\\ud800"]}}',
            "sampling_params.stop[0]",
        ),
        ("/explain", b'{"text": "\\ud800"}', "text"),
    ]  # fmt: skip
    for path, raw, field in bad:
        resp = router.client.post(path, content=raw)
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"]["param"] == field
    assert worker.served() == 0
    pair = b'{"text": "smile \\ud83d\\ude00"}'  # a valid pair: one character
    assert router.client.post("/generate", content=pair).status_code == 200
    assert worker.received[-1].body["text"] == "smile \U0001f600"


# -- F2: code execution from a planted model snapshot ---------------------------------------
SNAPSHOT_KEY = "hardening-snapshot-key-0123456789"


class _Plant:
    """What an attacker writes where a snapshot is read: a pickle that runs a command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _planted(marker: Any) -> bytes:
    return b"KVRM1" + b"\0" * 32 + pickle.dumps(_Plant(str(marker)))


ADMIN = "hardening-admin-token"


def _models(process: Process) -> dict[str, Any]:
    """GET /models on the control listener (the process runs with ``ADMIN`` as its token)."""
    auth = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=process.control_url, timeout=10, headers=auth) as client:
        body: dict[str, Any] = client.get("/models").json()
        return body


@pytest.mark.slow
def test_f2_a_pickle_planted_in_redis_never_runs(
    spawn: Callable[..., Process], redis_server: Any, cluster_name: str, tmp_path: Any
) -> None:
    marker = tmp_path / "pwned"
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.set(f"kvroute:{{{cluster_name}}}:models:latest", _planted(marker))
    finally:
        client.close()
    worker = FakeWorker("w").start()
    try:
        common = ["serve", "--worker-urls", worker.url, "--redis-url", redis_server.url]
        common += ["--cluster", cluster_name]
        # No key: snapshots are off, loudly, and nothing is read.
        port = free_port()
        router = spawn(*common, "--port", str(port), port=port, env={"KVROUTE_ADMIN_TOKEN": ADMIN})
        snapshots = _models(router)["snapshots"]
        assert (snapshots["enabled"], snapshots["loaded_from"]) == (False, None)
        assert "model snapshots are OFF" in router.log()
        assert "KVROUTE_MODEL_SNAPSHOT_KEY" in router.log()
        # With a key: the planted pickle is refused before anything is unpickled.
        port = free_port()
        keyed = spawn(
            *common, "--port", str(port), port=port,
            env={"KVROUTE_MODEL_SNAPSHOT_KEY": SNAPSHOT_KEY, "KVROUTE_ADMIN_TOKEN": ADMIN},
        )  # fmt: skip
        snapshots = _models(keyed)["snapshots"]
        assert (snapshots["enabled"], snapshots["refused"]) == (True, 1)
        assert snapshots["loaded_from"] is None
        assert "old pickle format" in keyed.log()
        with httpx.Client(base_url=keyed.url, timeout=10) as http:
            assert http.post("/generate", json={"text": "still serving"}).status_code == 200
    finally:
        worker.stop()
    assert not marker.exists()


@pytest.mark.slow
def test_f2_a_snapshot_file_needs_a_key_and_a_planted_one_never_runs(
    spawn: Callable[..., Process], tmp_path: Any
) -> None:
    marker, path = tmp_path / "pwned", tmp_path / "models.kvrm"
    path.write_bytes(_planted(marker))
    worker = FakeWorker("w").start()
    try:
        args = ["serve", "--worker-urls", worker.url, "--model-snapshot-path", str(path)]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
        refused = subprocess.run(
            [sys.executable, "-m", "kvroute", *args, "--port", str(free_port())],
            env=clean,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert refused.returncode == 2, refused.stderr
        assert "model_snapshot_path needs a key" in refused.stderr
        assert "KVROUTE_MODEL_SNAPSHOT_KEY" in refused.stderr
        assert "Traceback" not in refused.stderr

        key_file = tmp_path / "snapshot.key"
        key_file.write_text(SNAPSHOT_KEY + "\n")
        port = free_port()
        keyed = [*args, "--model-snapshot-key-file", str(key_file), "--port", str(port)]
        router = spawn(*keyed, port=port, env={"KVROUTE_ADMIN_TOKEN": ADMIN})
        snapshots = _models(router)["snapshots"]
        assert (snapshots["refused"], snapshots["loaded_from"]) == (1, None)
        with httpx.Client(base_url=router.url, timeout=10) as http:
            for i in range(3):
                assert http.post("/generate", json={"text": f"learn {i}"}).status_code == 200
        router.proc.send_signal(signal.SIGTERM)  # a clean stop writes a signed snapshot
        # uvicorn re-raises the signal once it has shut down: the exit status says SIGTERM.
        assert router.proc.wait(30) in (0, -signal.SIGTERM)
        assert path.read_bytes().startswith(b"KVRM2\n")
        port = free_port()
        again = spawn(*keyed[:-1], str(port), port=port, env={"KVROUTE_ADMIN_TOKEN": ADMIN})
        answer = _models(again)
        assert answer["snapshots"]["loaded_from"] == str(path)
        assert answer["models"]["champion"]["samples"] == 3
    finally:
        worker.stop()
    assert not marker.exists()


def test_the_snapshot_key_must_be_long_and_not_the_admin_token() -> None:
    from router_harness import service_settings

    from router_service.settings import Settings

    with pytest.raises(ValueError, match="at least 16 bytes"):
        service_settings(model_snapshot_key="short")
    with pytest.raises(ValueError, match="must not be the admin token"):
        service_settings(admin_token=SNAPSHOT_KEY, model_snapshot_key=SNAPSHOT_KEY)
    settings: Settings = service_settings(model_snapshot_key=SNAPSHOT_KEY)
    assert settings.snapshot_key() == SNAPSHOT_KEY.encode()
    assert SNAPSHOT_KEY not in str(settings.redacted())


# -- F4: the Redis index stream is not trusted ------------------------------------------------
def _xadd(redis_url: str, stream: str, fields: dict[str, Any]) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        client.xadd(stream, fields)
    finally:
        client.close()


def test_f4_workers_from_the_index_stream_pass_the_allow_list_and_bad_entries_are_skipped(
    routers: Callable[..., RouterServer],
    workers: Callable[..., FakeWorker],
    redis_server: Any,
    cluster_name: str,
) -> None:
    """Before: an XADD with a worker URL added a worker that POST /workers refuses (and a
    gopher:// one that could not be removed); a non-numeric field killed the sync task for
    good while /health said "ok"."""
    good = workers("good")
    router = routers(worker_urls=[good.url], redis_url=redis_server.url, cluster=cluster_name)
    stream = f"kvroute:{{{cluster_name}}}:index"
    planted = [
        {"r": "evil", "o": "a", "w": "http://169.254.169.254:80", "d": b"", "t": "1"},
        {"r": "evil", "o": "a", "w": "gopher://127.0.0.1:6379/_FLUSHALL", "d": b"", "t": "1"},
        {"r": "evil", "o": "a", "w": f"http://127.0.0.1:{redis_server.port}", "d": b"", "t": "1"},
        {"r": "evil", "o": "a", "w": "http://127.0.0.1:31999", "d": b"", "t": "not a number"},
        {"r": "evil", "o": "b", "ops": "a", "w": "x", "i": b"\x05", "t": b"", "n": b"", "d": b""},
    ]
    for fields in planted:
        _xadd(redis_server.url, stream, fields)
    # The sync task survived all of it: a legitimate registration still arrives.
    ok = workers("ok")
    _xadd(redis_server.url, stream, {"r": "other", "o": "a", "w": ok.url, "d": b"", "t": "1"})

    def listed() -> set[str]:
        return {w["url"] for w in router.control.get("/workers").json()["workers"]}

    assert wait_until(lambda: ok.url in listed(), 5), listed()
    assert listed() == {good.url, ok.url}
    sync = router.client.get("/health").json()["index_sync"]
    assert sync["state"] == "running"
    assert sync["refused"] == 3  # metadata, gopher, Redis' own port
    assert sync["malformed"] == 2  # the non-numeric time and the broken batch
    assert router.client.get("/health").json()["status"] == "ok"


# -- F5 / F8: heads that are too large or too slow ----------------------------------------------
def _raw(port: int, payload: bytes, *, read_timeout_s: float = 5.0) -> bytes:
    """Send ``payload`` on a fresh connection; what comes back until the router closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout_s) as sock:
        with contextlib.suppress(OSError):  # the router may close while we still send
            sock.sendall(payload)
        out = b""
        with contextlib.suppress(TimeoutError, OSError):
            while chunk := sock.recv(65536):
                out += chunk
        return out


def test_f5_an_oversized_head_is_refused_at_once_and_others_are_served(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("w")
    router = routers(worker_urls=[worker.url], max_header_bytes=16 * 1024, max_headers=50)
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (8 * 1024 * 1024)
    started = time.monotonic()
    answer = _raw(router.port, big)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert time.monotonic() - started < 3.0  # refused, not read
    many = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(60))
    assert _raw(router.port, many + b"\r\n").startswith(b"HTTP/1.1 431 ")
    assert router.client.post("/generate", json={"text": "fine"}).status_code == 200


def test_f8_slow_heads_and_idle_connections_are_closed_with_408(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("w")
    router = routers(worker_urls=[worker.url], header_timeout_s=0.5)
    started = time.monotonic()
    assert _raw(router.port, b"").startswith(b"HTTP/1.1 408 ")  # opened, never a byte
    assert _raw(router.port, b"GET /health HTTP/1.1\r\nHost").startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - started < 4.0
    assert router.client.get("/health").status_code == 200


def test_f8_a_slow_body_times_out_and_never_holds_a_slot(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    """Before: the admission slot was taken before the body was read, so slow bodies shut
    everyone out. Now the slot is taken once the body is in."""
    worker = workers("w")
    router = routers(worker_urls=[worker.url], max_in_flight=2, body_timeout_s=1.0)
    head = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    slow = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(6)]
    try:
        for sock in slow:
            sock.sendall(head)
        for i in range(4):  # more than the cap, one after another: every one has a slot
            resp = router.client.post("/generate", json={"text": f"meanwhile {i}"})
            assert resp.status_code == 200, resp.text
        slow[0].settimeout(5)
        answer = slow[0].recv(65536)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b"did not arrive" in answer
    finally:
        for sock in slow:
            sock.close()


# -- F6: bodies in flight, and /explain under admission --------------------------------------
def test_f6_bodies_in_flight_have_a_memory_budget(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("w", delay_s=0.5)
    router = routers(
        worker_urls=[worker.url], max_body_bytes_in_flight=1024 * 1024, max_body_bytes=2**20
    )
    body = {"text": "x" * 600_000}
    results: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=router.url, timeout=30) as client:
            results.append(client.post("/generate", json=body).status_code)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(results).count(200) >= 1
    assert 503 in results  # the budget holds one 600 kB body at a time
    admission = router.control.get("/health").json()
    assert admission["status"] == "ok"
    assert router.client.post("/generate", json={"text": "small"}).status_code == 200


def test_f6_f7_explain_is_rate_limited_per_client_without_the_token(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("w")
    router = routers(worker_urls=[worker.url], explain_rate_limit_rps=2.0)
    statuses = [
        router.client.post("/explain", json={"text": "probe"}).status_code for _ in range(6)
    ]
    assert statuses[:2] == [200, 200]
    assert 429 in statuses[2:]
    resp = router.client.post("/explain", json={"text": "probe"})
    assert resp.status_code == 429
    assert int(resp.headers["Retry-After"]) >= 1
    # The operator, with the token, is not limited, and sees every figure.
    for _ in range(6):
        answer = router.admin.post("/explain", json={"text": "probe"})
        assert answer.status_code == 200
    assert answer.json()["candidates"][0]["cached"] is not None
    assert answer.json()["candidates"][0]["index_cached"] is not None
    # Without it: workers by label (unless configured), no cache figures.
    shown = routers(worker_urls=[worker.url], expose_worker_urls=False)
    public = shown.client.post("/explain", json={"text": "probe"}).json()
    assert public["chosen"] == "w0"
    for figure in ("cached", "index_cached", "predicted_ms", "evict_ms"):
        assert public["candidates"][0][figure] is None, figure


# -- per-client limits and the default overload cap -------------------------------------------
def test_the_rate_limit_is_per_client(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    """Before: one global bucket, so one client starved the others."""
    worker = workers("w")
    router = routers(
        worker_urls=[worker.url],
        rate_limit_rps=1.0,
        rate_limit_burst=3,
        trusted_proxies=["127.0.0.1/32"],
    )

    def send(client: str) -> int:
        headers = {"X-Forwarded-For": client}
        return router.client.post("/generate", json={"text": "hi"}, headers=headers).status_code

    greedy = [send("10.0.0.1") for _ in range(10)]
    assert greedy[:3] == [200, 200, 200]
    assert greedy.count(429) >= 6
    assert [send("10.0.0.2") for _ in range(3)] == [200, 200, 200]  # another client is fine


def test_the_default_in_flight_cap_sheds_with_retry_after(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    """Before: no cap by default; at 4,000 clients nothing was shed, p99 23 s, then breakers
    opened. Now the default cap is per_worker_in_flight x the workers."""
    pool = [workers("a", delay_s=1.0), workers("b", delay_s=1.0)]
    router = routers(worker_urls=[w.url for w in pool], per_worker_in_flight=32)
    assert router.settings.max_in_flight is None
    results: list[httpx.Response] = []

    async def burst() -> None:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:
            answers = await asyncio.gather(
                *(client.post("/generate", json={"text": f"r{i}"}) for i in range(100))
            )
            results.extend(answers)

    asyncio.run(burst())
    codes = [r.status_code for r in results]
    assert codes.count(200) == 64  # 32 per worker
    shed = [r for r in results if r.status_code == 503]
    assert len(shed) == 36
    assert all(r.headers["Retry-After"] == "1" for r in shed)
    assert all(r.json()["error"]["type"] == "overloaded" for r in shed)


# -- lower: headers, encodings, bad numbers -----------------------------------------------------
def test_hop_by_hop_headers_and_those_connection_names_stay_on_their_side(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("w")
    worker.reply_headers = {"Connection": "X-Worker-Hop", "X-Worker-Hop": "internal"}
    router = routers(worker_urls=[worker.url])
    resp = router.client.post(
        "/generate",
        json={"text": "hi"},
        headers={
            "Connection": "keep-alive, X-Client-Hop",
            "X-Client-Hop": "secret",
            "Keep-Alive": "timeout=5",
            "Trailer": "X-Checksum",
            "X-End-To-End": "kept",
        },
    )
    assert resp.status_code == 200
    seen = {k.lower() for k in worker.received[-1].headers}
    assert not seen & {"x-client-hop", "keep-alive", "trailer"}
    assert "x-end-to-end" in seen
    assert "x-worker-hop" not in {k.lower() for k in resp.headers}


def test_an_encoding_is_never_stripped_from_bytes_the_router_did_not_decode(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    """Before: the router's HTTP client asked the worker for gzip whatever the client said,
    and the compressed bytes went back without their Content-Encoding."""
    worker = workers("w")
    worker.gzip = True
    router = routers(worker_urls=[worker.url])
    plain = router.client.post(
        "/generate", json={"text": "hi"}, headers={"Accept-Encoding": "identity"}
    )
    assert worker.received[-1].headers["Accept-Encoding"] == "identity"
    assert "content-encoding" not in plain.headers
    assert plain.json()["text"]  # readable as sent
    zipped = router.client.post(
        "/generate", json={"text": "hi"}, headers={"Accept-Encoding": "gzip"}
    )
    assert zipped.headers["content-encoding"] == "gzip"
    assert zipped.json()["text"]  # httpx decodes it: the header came along
    bare = httpx.post(
        router.url + "/generate", json={"text": "hi"}, headers={"Accept-Encoding": ""}
    )
    assert bare.status_code == 200
    assert "content-encoding" not in bare.headers


@pytest.mark.parametrize(
    "raw",
    [
        b'{"name": "lbgr", "params": {"alpha": NaN}}',
        b'{"name": "lbgr", "params": {"margin_ms": Infinity}}',
    ],
)
def test_put_policy_refuses_numbers_that_are_not_finite(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker], raw: bytes
) -> None:
    """Before: PUT /policy took alpha NaN, and GET /policy answered 500 from then on."""
    router = routers(worker_urls=[workers("w").url])
    resp = router.control.put("/policy", content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert "finite" in resp.json()["error"]["message"]
    assert router.control.get("/policy").status_code == 200
    spec = b'{"spec": {"kind": "ewmean", "params": {"p0": Infinity}}}'
    json_header = {"Content-Type": "application/json"}
    assert router.control.put("/models", content=spec, headers=json_header).status_code == 400
