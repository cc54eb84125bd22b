"""Who may do what: bearer auth on the control plane, the worker allow-list (no SSRF through
POST /workers), secrets never echoed, prompts never logged unless asked for."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
from fake_worker import FakeWorker
from router_harness import (
    ADMIN_TOKEN,
    RouterServer,
    free_port,
    require_redis_server,
    wait_until,
)

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
REDIS_PASSWORD = "hunter2-redis-pass"


@pytest.fixture
def secured(
    routers: Callable[..., RouterServer], two_workers: tuple[FakeWorker, FakeWorker]
) -> RouterServer:
    return routers(worker_urls=[w.url for w in two_workers], admin_token=ADMIN_TOKEN)


def _urls(router: RouterServer) -> list[str]:
    return [w["url"] for w in router.control.get("/workers", headers=AUTH).json()["workers"]]


# -- bearer auth ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        f"Bearer {ADMIN_TOKEN[:-1]}",
        f"Bearer {ADMIN_TOKEN}{ADMIN_TOKEN}",
        f"Token {ADMIN_TOKEN}",
        f"Basic {ADMIN_TOKEN}",
        f"{ADMIN_TOKEN}",
        "Bearer " + "x" * 10_000,
    ],
)
def test_missing_or_wrong_token_is_401_and_changes_nothing(
    secured: RouterServer, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    attempts = [
        ("POST", "/workers", {"url": "http://127.0.0.1:9"}),
        ("PUT", "/policy", {"name": "round_robin"}),
        ("PUT", "/models", {"spec": "linear"}),
        ("DELETE", "/workers?url=" + _urls(secured)[0], None),
        ("GET", "/workers", None),
    ]
    for method, path, body in attempts:
        resp = secured.control_public.request(method, path, json=body, headers=headers)
        assert resp.status_code == 401, (method, path, resp.text)
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        error = resp.json()["error"]
        assert error["type"] == "unauthorized"
        assert "Bearer" in error["message"]
        assert ADMIN_TOKEN not in resp.text
    assert len(_urls(secured)) == 2
    assert secured.control.get("/policy", headers=AUTH).json()["name"] == "lbgr"


def test_the_scheme_is_case_insensitive_and_the_data_plane_needs_no_token(
    secured: RouterServer,
) -> None:
    lower = {"Authorization": f"bearer {ADMIN_TOKEN}"}
    assert secured.control.get("/workers", headers=lower).status_code == 200
    assert secured.client.post("/generate", json={"text": "open"}).status_code == 200
    assert secured.client.get("/health").status_code == 200


# -- SSRF through worker registration -------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "status"),
    [
        ("http://169.254.169.254", 403),  # cloud metadata
        ("http://169.254.169.254/latest/meta-data/", 403),
        ("http://10.0.0.5:80", 403),
        ("http://192.168.1.1:8080", 403),
        ("http://0.0.0.0:80", 403),
        ("http://[::ffff:169.254.169.254]:80", 403),
        ("http://2130706433:80", 403),  # 127.0.0.1 as an integer: a name, never resolved
        ("http://127.1:80", 403),
        ("http://localhost.attacker.example:80", 403),
        ("http://metadata.google.internal", 403),
        ("HTTP://169.254.169.254", 403),
        ("file:///etc/passwd", 400),
        ("gopher://127.0.0.1:6379/_FLUSHALL", 400),
        ("ftp://127.0.0.1:21", 400),
        ("http://user:pass@127.0.0.1:9", 400),
        ("http://127.0.0.1:9@169.254.169.254", 400),
        ("http://169.254.169.254#@127.0.0.1:9", 400),
        ("http://127.0.0.1:9?next=http://169.254.169.254", 400),
        ("http://127.0.0.1:9\r\nHost: evil", 400),
        ("http://127.0.0.1:9\x00.evil", 400),
        ("http://127.0.0.1:99999", 400),
        ("http://127.0.0.1:0", 400),
        ("//169.254.169.254", 400),
        ("", 400),
    ],
)
def test_worker_urls_off_the_allow_list_are_refused(
    secured: RouterServer, url: str, status: int
) -> None:
    resp = secured.control.post("/workers", json={"url": url}, headers=AUTH)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == "url"
    assert error["message"].startswith("url: ")
    if status == 403:
        assert error["type"] == "forbidden"
        assert "KVROUTE_ALLOWED_WORKER_NETWORKS" in error["message"]
    assert "pass@" not in resp.text  # credentials are not repeated back
    assert len(_urls(secured)) == 2


@pytest.mark.parametrize("port", [22, 5432, 6379])
def test_well_known_service_ports_and_the_routers_own_are_refused_on_allowed_hosts(
    routers: Callable[..., RouterServer], two_workers: tuple[FakeWorker, FakeWorker], port: int
) -> None:
    """The default allow-list admits loopback (the configured workers' host); before, that
    meant any port on it, Redis's included."""
    router = routers(worker_urls=[w.url for w in two_workers], admin_token=ADMIN_TOKEN)
    for url in (
        f"http://127.0.0.1:{port}",
        f"http://127.0.0.1:{router.port}",
        f"http://127.0.0.1:{router.control_port}",
    ):
        resp = router.control.post("/workers", json={"url": url})
        assert resp.status_code == 403, (url, resp.text)
    assert len(_urls(router)) == 2


def test_the_allow_list_admits_configured_networks_and_hosts(
    routers: Callable[..., RouterServer], two_workers: tuple[FakeWorker, FakeWorker]
) -> None:
    router = routers(
        worker_urls=[w.url for w in two_workers],
        allowed_worker_networks=["192.0.2.0/24"],  # TEST-NET-1: nothing answers there
        allowed_worker_hosts=["worker.invalid"],
        health_timeout_s=0.3,
    )
    for url in ("http://192.0.2.7:30001", "http://worker.invalid:30001"):
        resp = router.control.post("/workers", json={"url": url})
        assert resp.status_code == 201, resp.text
        assert resp.json()["healthy"] is False
    # Loopback is no longer on the list, but the configured workers' hosts always are.
    assert router.control.post("/workers", json={"url": "http://127.0.0.1:9"}).status_code == 201
    refused = router.control.post("/workers", json={"url": "http://[::1]:9"})
    assert refused.status_code == 403


# -- secrets --------------------------------------------------------------------------------
@pytest.fixture
def password_redis() -> Iterator[str]:
    """A redis-server that requires a password; yields its URL with the password in it."""
    require_redis_server()
    exe = shutil.which("redis-server")
    assert exe is not None
    port = free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [*args, "--requirepass", REDIS_PASSWORD],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def up() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        return False

    try:
        assert wait_until(up, 10)
        yield f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _everything_visible(router: RouterServer, headers: dict[str, str]) -> list[str]:
    """Every body and header an operator or a client can get from the router."""
    client = router.client
    sent = client.post("/generate", json={"text": "hello"})
    texts = [sent.text, str(sent.headers)]
    decision = sent.headers.get("X-KVRoute-Decision-Id", "none")
    for path in ("/health", "/metrics", "/openapi.json", f"/explain/{decision}", "/v1/models"):
        resp = client.get(path)
        texts += [resp.text, str(resp.headers)]
    texts.append(client.post("/explain", json={"text": "hello"}).text)
    for path in ("/workers", "/policy", "/models", "/models/challenger"):
        texts += [client.get(path, headers=headers).text, client.get(path).text]
    texts.append(client.post("/generate", content=b"{").text)
    texts.append(client.put("/policy", json={"name": "nope"}, headers=headers).text)
    texts.append(client.post("/workers", json={"url": "http://10.1.1.1:1"}, headers=headers).text)
    texts.append(client.get("/nowhere").text)
    return texts


def test_no_answer_echoes_the_admin_token_or_the_redis_password(
    routers: Callable[..., RouterServer],
    two_workers: tuple[FakeWorker, FakeWorker],
    password_redis: str,
) -> None:
    router = routers(
        worker_urls=[w.url for w in two_workers],
        admin_token=ADMIN_TOKEN,
        redis_url=password_redis,
        cluster="secrets",
    )
    health = router.client.get("/health").json()
    assert health["store"]["mode"] == "redis"  # the password worked
    for text in _everything_visible(router, AUTH):
        assert ADMIN_TOKEN not in text
        assert REDIS_PASSWORD not in text


def test_a_wrong_redis_password_is_not_echoed_either(
    routers: Callable[..., RouterServer],
    two_workers: tuple[FakeWorker, FakeWorker],
    password_redis: str,
) -> None:
    wrong = password_redis.replace(REDIS_PASSWORD, "wrong-" + REDIS_PASSWORD)
    router = routers(
        worker_urls=[w.url for w in two_workers], redis_url=wrong, cluster="secrets-wrong"
    )
    store = router.client.get("/health").json()["store"]
    assert store["mode"] == "embedded-fallback"
    assert store["last_error"]
    for text in _everything_visible(router, {}):
        assert REDIS_PASSWORD not in text


def test_settings_shown_to_operators_are_redacted() -> None:
    from router_harness import service_settings

    settings = service_settings(
        admin_token=ADMIN_TOKEN, redis_url=f"redis://:{REDIS_PASSWORD}@127.0.0.1:1/0"
    )
    shown = str(settings.redacted())
    assert ADMIN_TOKEN not in shown
    assert REDIS_PASSWORD not in shown
    assert ADMIN_TOKEN not in repr(settings)


# -- prompts in logs ------------------------------------------------------------------------
@pytest.mark.parametrize("log_prompts", [False, True])
def test_prompt_text_reaches_the_logs_only_when_enabled(
    routers: Callable[..., RouterServer],
    two_workers: tuple[FakeWorker, FakeWorker],
    caplog: pytest.LogCaptureFixture,
    log_prompts: bool,
) -> None:
    canary = f"CANARY-PROMPT-{time.monotonic_ns()}"
    router = routers(worker_urls=[w.url for w in two_workers], log_prompts=log_prompts)
    with caplog.at_level(logging.DEBUG):
        sends = [
            ("/generate", {"text": canary}),
            ("/v1/completions", {"prompt": canary}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": canary}]}),
        ]
        for path, body in sends:
            assert router.client.post(path, json=body).status_code == 200
        router.client.post("/generate", json={"text": canary, "stream": "bad"})
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert (canary in logged) is log_prompts


# -- no state shared between clients ------------------------------------------------------------
def test_a_cookie_a_worker_sets_never_reaches_another_clients_request(
    routers: Callable[..., RouterServer], two_workers: tuple[FakeWorker, FakeWorker]
) -> None:
    """The router's pooled client keeps no cookie jar: a worker's Set-Cookie goes back to
    the client that got the answer, and is not replayed on anybody else's requests."""
    w0, w1 = two_workers
    for w in two_workers:
        w.set_cookie = f"session=secret-of-{w.name}; Path=/"
    # By host name: aiohttp's default jar would ignore cookies from IP addresses anyway.
    urls = [w.url.replace("127.0.0.1", "localhost") for w in two_workers]
    router = routers(worker_urls=urls, policy="round_robin")
    first = router.client.post("/generate", json={"text": "client one"})
    assert first.status_code == 200
    assert "secret-of-" in first.headers["set-cookie"]  # passed through to its client
    router.client.cookies.clear()  # the test client would otherwise send it back itself
    for i in range(4):  # round robin: both workers see a request after the first answer
        resp = router.client.post("/generate", json={"text": f"client two, request {i}"})
        assert resp.status_code == 200
        router.client.cookies.clear()
    received = w0.received + w1.received
    assert len(received) == 5
    assert all("cookie" not in {k.lower() for k in r.headers} for r in received), [
        r.headers for r in received
    ]
