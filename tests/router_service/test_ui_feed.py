"""The ``/ui`` feed and endpoints: what each caller sees, prompts, the per-second history, and
the event stream (the browser test, test_ui_browser.py, runs the page itself)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from router_service.app import create_app
from router_service.routing import Candidate, Decision, ModelInfo, RouteRequest
from router_service.settings import Settings
from router_service.state import ServiceState
from router_service.ui import CACHE_DETAIL, HISTORY_S, RECENT, UiFeed, _stream

TOKEN = "feed-test-admin-token-0123"
W0, W1 = "http://127.0.0.1:30001", "http://127.0.0.1:30002"


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(**settings: Any) -> tuple[ServiceState, UiFeed, Clock]:
    app = create_app(Settings(worker_urls=[W0, W1], admin_token=TOKEN, **settings))
    state: ServiceState = app.state.kvroute
    feed = state.decisions.feed
    assert isinstance(feed, UiFeed)
    clock = Clock()
    feed.clock = clock
    feed._second = int(clock())
    return state, feed, clock


def decision(
    decision_id: str, chosen: str = W1, cached: int = 300, queue_ms: float = 5.0
) -> Decision:
    def cand(url: str, hit: int) -> Candidate:
        return Candidate(url, True, None, hit, 400 - hit, 10.0, queue_ms, 1.0, 16.0, 2, 3.0, 19.0)

    return Decision(
        decision_id,
        "lbgr",
        chosen,
        (cand(W0, 0), cand(W1, cached)),
        400,
        reserve_ms=10.0,
        model=ModelInfo("ratio", 1),
        branch="argmin",
    )


def route(text: str) -> RouteRequest:
    return RouteRequest("r", text)


def test_admins_see_everything_others_what_explain_shows_them() -> None:
    state, feed, _ = make()
    state.decisions.add(decision("d1"), route("hello"), replica_id="r1", attempt=1)
    full = feed.entry("d1", admin=True)
    shown = feed.entry("d1", admin=False)
    assert full is not None
    assert shown is not None
    assert full["candidates"][1]["cached"] == 300
    assert full["chosen"] == W1
    assert full["attempt"] == 1
    assert full["replica_id"] == "r1"
    for cand in shown["candidates"]:
        assert all(cand[key] is None for key in CACHE_DETAIL)
        assert cand["eligible"] is True
    assert shown["reserve_ms"] is None
    assert shown["chosen"] == state.public(W1)
    assert [c["worker"] for c in shown["candidates"]] == [state.public(W0), state.public(W1)]


def test_prompts_only_with_prompt_logging_on_and_only_to_admins() -> None:
    state, feed, _ = make()
    state.decisions.add(decision("d1"), route("secret prompt"))
    assert feed.entry("d1", admin=True)["prompt"] is None  # type: ignore[index]
    state, feed, _ = make(log_prompts=True)
    state.decisions.add(decision("d1"), route("secret prompt"))
    state.decisions.add(decision("d2"), RouteRequest("r", "\x01\x02", tokens=True))
    assert feed.entry("d1", admin=True)["prompt"] == "secret prompt"  # type: ignore[index]
    assert feed.entry("d1", admin=False)["prompt"] is None  # type: ignore[index]
    assert feed.entry("d2", admin=True)["prompt"] == "(2 token ids)"  # type: ignore[index]
    # Never in the ring buffer that /explain/{id} answers from.
    assert "prompt" not in json.dumps(state.decisions.get("d1"))


def test_outcomes_land_on_their_decision_and_old_decisions_age_out() -> None:
    state, feed, _ = make()
    for i in range(RECENT + 5):
        state.decisions.add(decision(f"d{i}"))
    assert len(feed.recent) == RECENT
    assert feed.entry("d0", admin=True) is None
    state.decisions.set_outcome("d10", {"status": "ok", "latency_ms": 12.5})
    assert feed.entry("d10", admin=True)["outcome"] == {"status": "ok", "latency_ms": 12.5}  # type: ignore[index]


def test_history_has_one_row_per_second_with_each_workers_figures() -> None:
    state, feed, clock = make()
    state.decisions.add(decision("a", W1, cached=300, queue_ms=7.0))
    state.decisions.add(decision("b", W1, cached=100))
    state.decisions.add(decision("c", W0, cached=0))  # W0's candidate: 0 of 400 cached
    clock.t += 1.0
    state.decisions.add(decision("d", W1))  # a new second closes the last one
    (row,) = feed.history
    assert row["t"] == 1000
    assert row["workers"][W1]["routed"] == 2
    assert row["workers"][W1]["hit_rate"] == pytest.approx(400 / 800)
    assert row["workers"][W0] == {"routed": 1, "hit_rate": 0.0, "in_flight": 0, "queue_ms": 5.0}
    others = feed.samples(admin=False)
    assert others[0]["workers"][state.public(W1)] == {
        "routed": 2, "hit_rate": None, "in_flight": None, "queue_ms": None
    }  # fmt: skip
    for _ in range(HISTORY_S + 10):
        clock.t += 1.0
        feed.roll(clock())
    assert len(feed.history) == HISTORY_S


def test_summary_has_the_policy_and_the_models_rolling_error_for_admins() -> None:
    _, feed, _ = make()
    admin, anyone = feed.summary(admin=True), feed.summary(admin=False)
    assert admin["policy"] == anyone["policy"] == "lbgr"
    assert admin["model"]["kind"] == anyone["model"]["kind"] == "ratio"
    assert "mae_ms" in admin["model"]
    assert anyone["model"]["mae_ms"] is None
    assert [w["worker"] for w in admin["workers"]] == [W0, W1]
    assert admin["admin"]
    assert not anyone["admin"]


def parse(chunk: bytes) -> tuple[str, Any]:
    event, data = chunk.decode().strip().split("\n")
    return event.removeprefix("event: "), json.loads(data.removeprefix("data: "))


def test_the_stream_says_hello_then_each_decision_and_outcome_then_stats() -> None:
    state, feed, _ = make()
    state.decisions.add(decision("old"))

    async def scenario() -> list[tuple[str, Any]]:
        stream = _stream(state, feed, admin=False)
        events = [parse(await anext(stream))]
        state.decisions.add(decision("new"))
        events.append(parse(await anext(stream)))
        state.decisions.set_outcome("new", {"status": "ok", "latency_ms": 3.0})
        events.append(parse(await anext(stream)))
        events.append(parse(await anext(stream)))  # a second later: stats
        assert len(feed.viewers) == 1
        state.draining = True
        rest = [chunk async for chunk in stream]  # ends at the next second's check
        assert [parse(chunk)[0] for chunk in rest] in ([], ["stats"])
        assert not feed.viewers  # unsubscribed on the way out
        return events

    (hello, new, outcome, stats) = asyncio.run(scenario())
    assert hello[0] == "hello"
    assert [d["decision_id"] for d in hello[1]["decisions"]] == ["old"]
    assert new[0] == "decision"
    assert new[1]["decision_id"] == "new"
    assert new[1]["candidates"][0]["cached"] is None  # not admin
    assert outcome[0] == "outcome"
    assert outcome[1]["outcome"]["status"] == "ok"
    assert stats[0] == "stats"
    assert stats[1]["policy"] == "lbgr"


def test_the_pages_and_state_over_http() -> None:
    app = create_app(Settings(worker_urls=[W0], admin_token=TOKEN))
    with TestClient(app) as client:
        page = client.get("/ui")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"].startswith("default-src 'self'")
        assert '<script src="/ui/app.js"' in page.text
        assert "http" not in page.text.replace("http://www.w3.org", "")  # nothing external
        for path, kind in (("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")):
            answer = client.get(path)
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith(kind)
        anyone = client.get("/ui/state").json()
        admin = client.get("/ui/state", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        wrong = client.get("/ui/state", headers={"Authorization": "Bearer nope"}).json()
        assert admin["admin"]
        assert not anyone["admin"]
        assert not wrong["admin"]
        assert admin["workers"][0]["worker"] == W0
        assert "/ui" not in json.dumps(client.get("/openapi.json").json()["paths"])


def test_stats_carry_every_second_closed_since_the_viewer_last_heard() -> None:
    state, feed, clock = make()

    async def scenario() -> list[tuple[str, Any]]:
        stream = _stream(state, feed, admin=True)
        events = [parse(await anext(stream))]
        for i in range(3):  # seconds 1000, 1001, 1002; each decision closes the one before
            state.decisions.add(decision(f"d{i}"))
            clock.t += 1.0
        events += [parse(await anext(stream)) for _ in range(4)]
        state.draining = True
        _ = [chunk async for chunk in stream]
        return events

    hello, *decisions, stats = asyncio.run(scenario())
    assert hello[1]["history"] == []
    assert [kind for kind, _ in decisions] == ["decision"] * 3
    assert stats[0] == "stats"
    assert [row["t"] for row in stats[1]["history"]] == [1000, 1001, 1002]
