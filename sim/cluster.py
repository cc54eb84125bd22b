"""Simulate a fleet behind the router: the same routing core the service runs.

Each arrival is routed by ``router_service.routing.Router`` with worker status read from the
embedded decayed-load store (in simulated time); the chosen worker receives it after the
profile's per-request overhead (tokenisation, HTTP); on completion the load reservation is
released and the policy learns from the observed latency, exactly as in the live service.

Closed-loop clients: a request whose ``after`` names an earlier request of the workload is
released at ``max(its arrival_ms, the completion of that request)`` (a failed dependency
releases it too, as a client moves on after an error); its latency and TTFT count from the
release, as the client's own clock would. Requests without ``after`` arrive exactly as
before.

What the client sends (``prompt_format``): token ids (``"ids"``, the default), which the
router matches token by token, or the prompt's text (``"text"``, ``sim.text``), which it
matches character by character, as SGLang's router (and the paper's, built on it) does with
the text the paper's benchmark client sends.

What the client says of the answer's length (``output_hint``): ``"exact"`` (the default) sends
the workload's output length as ``max_new_tokens``, as benchmark clients do (sglang's
``bench_serving`` sets ``max_tokens`` to the trace's length and ignores EOS), so the router's
output estimate is exact; ``"none"`` sends no cap, as a chat client that lets the model stop
does: the router then only knows the mean it learns from completions. The engine generates the
workload's output either way.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_ext.cache import RadixCache
from router_service.routing import (
    DecayedLoads,
    Decision,
    Held,
    HoldQueue,
    HoldSettings,
    Outcome,
    Reservation,
    Router,
    RouteRequest,
    WorkerStatus,
    make_policy,
)
from router_service.routing.block_sets import BlockSets
from sim.cache_events import EventedRadixCache
from sim.engine import EngineRequest, RequestTooLarge
from sim.kernel import Environment
from sim.kv_feed import SimEventFeed
from sim.profiles import ServiceProfile, get_profile
from sim.text import render_text
from sim.worker import SimWorker
from sim.workloads.base import Workload, WorkloadRequest

__all__ = [
    "PROMPT_FORMATS",
    "ClusterConfig",
    "RequestRecord",
    "SimRun",
    "route_request",
    "simulate",
]

PROMPT_FORMATS = ("ids", "text")
OUTPUT_HINTS = ("exact", "none")


@dataclass(frozen=True)
class ClusterConfig:
    """A fleet and its router. ``worker_speeds`` makes workers heterogeneous (1.0 = profile).

    ``prompt_format``: what the client sends the router (``PROMPT_FORMATS``, module
    docstring). ``marking``: what a cache match marks under ``rlt`` (``engine_ext.cache``'s
    ``MARKINGS``: the whole matched path, or only a node the match splits, as the paper's code).
    ``refresh_waiting``: the workers keep their waiting requests' prefixes warm, as SGLang
    0.5.23 does (``sim.engine``); off, as SGLang 0.4.6 (the paper's) did not.
    """

    workers: int = 4
    policy: str = "lbgr"
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    eviction: str = "lru"
    profile: str = "llama3.1-8b-l40"
    capacity_tokens: int | None = None
    page_size: int = 1
    worker_speeds: Sequence[float] | None = None
    speed_changes: Sequence[tuple[int, float, float]] = ()  # (worker index, at s, new speed)
    seed: int = 0
    hold: HoldSettings = field(default_factory=HoldSettings)  # slots > 0: hold_queue
    # Workers publish KV events and the router matches on them (sim.kv_feed), after this
    # much simulated delay; off: the router's approximate index only.
    kv_events: bool = False
    kv_event_delay_ms: float = 1.0

    prompt_format: str = "ids"
    marking: str = "path"
    output_hint: str = "exact"
    refresh_waiting: bool = True

    def __post_init__(self) -> None:
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(
                f"unknown prompt_format {self.prompt_format!r}; known: {', '.join(PROMPT_FORMATS)}"
            )
        if self.output_hint not in OUTPUT_HINTS:
            raise ValueError(
                f"unknown output_hint {self.output_hint!r}; known: {', '.join(OUTPUT_HINTS)}"
            )

    def worker_urls(self) -> list[str]:
        return [f"http://sim-worker-{i}" for i in range(self.workers)]

    def worker_profiles(self) -> list[ServiceProfile]:
        base = get_profile(self.profile)
        speeds = list(self.worker_speeds) if self.worker_speeds else [1.0] * self.workers
        if len(speeds) != self.workers:
            raise ValueError(f"worker_speeds has {len(speeds)} entries for {self.workers} workers")
        return [base if s == 1.0 else base.scaled(s) for s in speeds]


@dataclass(slots=True)
class RequestRecord:
    rid: str
    worker: str
    arrival_ms: float
    prompt_tokens: int
    cached_tokens: int = 0
    predicted_cached: int | None = None  # what the router believed the worker cached
    sent_ms: float | None = None  # left the router (later than arrival in the hold queue)
    first_token_ms: float | None = None
    finished_ms: float | None = None
    failed: str | None = None

    @property
    def latency_ms(self) -> float | None:
        return None if self.finished_ms is None else self.finished_ms - self.arrival_ms

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_ms is None else self.first_token_ms - self.arrival_ms


@dataclass
class SimRun:
    config: ClusterConfig
    records: list[RequestRecord]
    workers: list[SimWorker]
    router: Router
    end_ms: float


@dataclass(slots=True)
class _InFlight:
    record: RequestRecord
    decision: Decision
    reservation: Reservation | None
    sent_ms: float  # when it left the router (after any time in the hold queue)
    holds_slot: bool = False  # a hold-queue slot, freed at the first token or the end


def route_request(
    item: WorkloadRequest, prompt_format: str = "ids", output_hint: str = "exact"
) -> RouteRequest:
    """What the router is given for ``item``: its token ids, or its text (``sim.text``),
    with the prompt's length in tokens either way; its output length as ``max_new_tokens``,
    or none (``output_hint``)."""
    key = render_text(item.prompt) if prompt_format == "text" else item.prompt
    max_new = item.max_new_tokens if output_hint == "exact" else None
    return RouteRequest(item.rid, key, len(item.prompt), max_new, tokens=prompt_format != "text")


def simulate(
    config: ClusterConfig,
    workload: Workload,
    on_progress: Callable[[int], None] | None = None,
    on_submit: Callable[[SimWorker, EngineRequest], None] | None = None,
) -> SimRun:
    """Run ``workload`` through the fleet; deterministic for a given config and workload.
    ``on_submit`` sees each request as it reaches its worker, before it queues there."""
    env = Environment()
    rng = random.Random(config.seed)
    blocks = BlockSets(stale_s=30.0) if config.kv_events else None
    router = Router(
        make_policy(
            config.policy, random.Random(rng.getrandbits(64)), **dict(config.policy_params)
        ),
        blocks=blocks,
    )
    feed = SimEventFeed(env, blocks, config.kv_event_delay_ms) if blocks is not None else None
    store = DecayedLoads()
    queue = HoldQueue(config.hold) if config.hold.enabled else None
    records: list[RequestRecord] = []
    in_flight: dict[str, _InFlight] = {}
    urls = config.worker_urls()

    waiting: dict[str, list[WorkloadRequest]] = {}  # rid -> requests released by its end

    def release_dependents(rid: str) -> None:
        for item in waiting.pop(rid, ()):
            env.schedule_at(max(item.arrival_ms, env.now_ms), arrive, item)

    def finish(req: EngineRequest) -> None:
        release_dependents(req.rid)
        job = in_flight.pop(req.rid)
        job.record.finished_ms = env.now_ms
        job.record.cached_tokens = req.cached
        if job.reservation is not None:
            store.release(job.reservation, env.now_ms)
        # The policy learns the worker's part: from when the request left the router.
        sent, first = job.sent_ms, job.record.first_token_ms
        router.complete(
            job.decision,
            Outcome(
                True,
                env.now_ms - sent,
                None if first is None else first - sent,
                output_tokens=req.generated,
                cached_tokens=req.cached,
                prompt_tokens=req.prompt_tokens,
            ),
            env.now_ms,
        )
        if on_progress is not None:
            on_progress(1)
        free_slot(job)

    def first_token(req: EngineRequest) -> None:
        job = in_flight[req.rid]
        job.record.first_token_ms = env.now_ms
        router.first_token(job.decision.decision_id, env.now_ms)
        if job.holds_slot and config.hold.free_at_first_token:
            free_slot(job)

    def last_step(req: EngineRequest) -> None:
        free_slot(in_flight[req.rid])

    def free_slot(job: _InFlight) -> None:
        if queue is not None and job.holds_slot:
            job.holds_slot = False
            queue.release(job.decision.chosen)
            pump()

    workers = []
    for url, profile in zip(urls, config.worker_profiles(), strict=True):
        capacity = config.capacity_tokens or profile.kv_capacity_tokens
        cache = (EventedRadixCache if feed is not None else RadixCache)(
            capacity,
            config.eviction,
            page_size=config.page_size,
            rng=random.Random(rng.getrandbits(64)),
            marking=config.marking,
        )
        workers.append(
            SimWorker(
                env,
                url,
                profile,
                cache,
                first_token,
                finish,
                last_step if queue is not None and config.hold.free_at_last_token else None,
                refresh_waiting=config.refresh_waiting,
            )
        )
    by_url = dict(zip(urls, workers, strict=True))
    if feed is not None:
        for worker in workers:
            feed.attach(worker)

    def arrive(item: WorkloadRequest) -> None:
        now = env.now_ms
        router.maybe_trim(now)
        request = route_request(item, config.prompt_format, config.output_hint)
        if feed is not None:
            feed.refresh()
        if queue is None:
            send(item, request, now, None)
            return
        queue.push(Held(request, now, item))
        pump()

    def pump() -> None:
        assert queue is not None
        picks = queue.assign(urls, env.now_ms, router.cached_by_worker, router.place)
        for held, worker in picks:
            send(held.ticket, held.request, held.arrived_ms, worker)

    def send(
        item: WorkloadRequest, request: RouteRequest, arrived_ms: float, only: str | None
    ) -> None:
        """Route (to ``only`` when the hold queue picked the worker) and send."""
        now = env.now_ms
        statuses = [
            WorkerStatus(u, queue_ms=store.read(u, now))
            if only is None or u == only
            else WorkerStatus(u, False, f"hold queue: sent to {only}", store.read(u, now))
            for u in urls
        ]
        decision = router.route(request, statuses, now)
        reservation = (
            store.reserve(decision.chosen, decision.reserve_ms, now)
            if decision.reserve_ms is not None
            else None
        )
        record = RequestRecord(item.rid, decision.chosen, arrived_ms, len(item.prompt))
        record.predicted_cached = decision.candidate(decision.chosen).cached
        record.sent_ms = now
        records.append(record)
        in_flight[item.rid] = _InFlight(record, decision, reservation, now, only is not None)
        worker = by_url[decision.chosen]
        env.schedule(worker.profile.request_overhead_ms, deliver, worker, item)

    def deliver(worker: SimWorker, item: WorkloadRequest) -> None:
        req = EngineRequest(item.rid, item.prompt, item.max_new_tokens, item.output)
        if on_submit is not None:
            on_submit(worker, req)
        try:
            worker.submit(req)
        except RequestTooLarge as exc:
            release_dependents(item.rid)
            job = in_flight.pop(item.rid)
            job.record.failed = str(exc)
            if job.reservation is not None:
                store.release(job.reservation, env.now_ms)
            router.complete(job.decision, Outcome(False, status="rejected"))
            if on_progress is not None:
                on_progress(1)
            free_slot(job)

    base_profile = get_profile(config.profile)
    for index, at_s, speed in config.speed_changes:
        if not 0 <= index < len(workers):
            raise ValueError(f"speed change for worker {index}; the fleet has {len(workers)}")
        env.schedule_at(at_s * 1000.0, workers[index].set_profile, base_profile.scaled(speed))
    seen: set[str] = set()
    for item in workload:
        if item.after is None:
            env.schedule_at(item.arrival_ms, arrive, item)
        elif item.after in seen:
            waiting.setdefault(item.after, []).append(item)
        else:
            raise ValueError(
                f"request {item.rid!r} waits for {item.after!r}, which does not come earlier "
                "in the workload"
            )
        seen.add(item.rid)
    env.run()
    return SimRun(config, records, workers, router, env.now_ms)
