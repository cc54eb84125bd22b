"""Subscribe to the workers' KV events over ZMQ (asyncio) and feed the exact block sets.

One task per worker with an event endpoint (``--worker-kv-events URL=tcp://host:port``,
``POST /workers`` with ``kv_events``, or, with ``--kv-events-discover``, what the worker's
own ``/server_info`` names: ``EventDiscovery``): a SUB socket on the worker's publisher, a socket
monitor that reports (re)connects and disconnects, and a DEALER on the worker's replay
endpoint when it has one. What to do with each message (order, gaps, replays, rebuilds) is
``routing.event_stream``'s decision; this module only moves frames and passes the clock.
Nothing here can stop the router: a message that cannot be read is dropped and counted,
and a task that fails is logged and restarted.

Every replica subscribes itself: prefix knowledge of a worker with events comes from the
worker, not from the other replicas (the Redis index sync is for workers without events).
Each time it subscribes to a worker the feed also reads the worker's chunk size
(``chunked_prefill_size`` in its ``/server_info``; ``BlockSets.set_chunk``); a worker that
does not say is matched as if it stored a request's prompt whole.

>>> parse_source("tcp://10.0.0.5:5557,tcp://10.0.0.5:5558")
EventSource(endpoint='tcp://10.0.0.5:5557', replay='tcp://10.0.0.5:5558')
>>> parse_worker_events(["http://10.0.0.5:30001=tcp://10.0.0.5:5557"])
{'http://10.0.0.5:30001': EventSource(endpoint='tcp://10.0.0.5:5557', replay=None)}
>>> source_from_server_info("http://10.0.0.5:30000", {"kv_events": {"publisher": "zmq",
...     "endpoint_host": "*", "endpoint_port_base": 5557, "replay_endpoint_port_base": 5558,
...     "dp_size": 1, "block_size": 16, "topic": ""}})
EventSource(endpoint='tcp://10.0.0.5:5557', replay='tcp://10.0.0.5:5558')
>>> chunk_from_server_info({"chunked_prefill_size": 8192}), chunk_from_server_info({})
(8192, None)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from zmq.utils.monitor import parse_monitor_message

if TYPE_CHECKING:
    from router_service.settings import Settings

from router_service.errors import ServiceError
from router_service.kv_wire import encode_seq
from router_service.routing.block_sets import BlockSets
from router_service.routing.event_stream import DEFAULT_MAX_MESSAGE_BYTES, EventStream
from router_service.worker_metrics import read_at_most

__all__ = [
    "EventDiscovery",
    "EventSource",
    "KVEventFeed",
    "allowed_source",
    "chunk_from_server_info",
    "disallowed_host",
    "feed_from_settings",
    "fetch_server_info",
    "parse_source",
    "parse_worker_events",
    "source_from_server_info",
    "url_host",
]

log = logging.getLogger("kvroute.kv_events")


@dataclass(frozen=True, slots=True)
class EventSource:
    """A worker's event publisher (``tcp://host:port``) and its replay endpoint, if any."""

    endpoint: str
    replay: str | None = None


_WILDCARDS = ("", "*", "0.0.0.0", "::")  # bind addresses: no host to connect to


def url_host(url: str) -> str:
    """The host of ``url`` as it goes into ``tcp://HOST:port`` (an IPv6 address bracketed).

    >>> url_host("http://10.1.2.3:30000"), url_host("http://worker"), url_host("http://[fd00::1]")
    ('10.1.2.3', 'worker', '[fd00::1]')
    """
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def _endpoint(text: str) -> str:
    text = text.strip()
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or not port or parts.path or parts.query:
        raise ValueError(f"a KV-event endpoint looks like tcp://host:port, got {text!r}")
    if parts.hostname in _WILDCARDS:
        raise ValueError(f"{text!r} is a bind address; give the worker's host to connect to")
    return text


def parse_source(text: str) -> EventSource:
    """``tcp://host:port`` or ``tcp://host:port,tcp://host:replay_port``."""
    parts = text.split(",")
    if len(parts) > 2:
        raise ValueError(f"give the events endpoint and at most a replay endpoint, got {text!r}")
    replay = _endpoint(parts[1]) if len(parts) == 2 else None
    return EventSource(_endpoint(parts[0]), replay)


def parse_worker_events(items: Iterable[str]) -> dict[str, EventSource]:
    """``URL=tcp://host:port[,tcp://host:replay_port]`` entries, by worker URL (as given:
    the caller normalises it)."""
    sources: dict[str, EventSource] = {}
    for item in items:
        url, sep, source = item.partition("=")
        if not sep or not url.strip():
            raise ValueError(f"expected URL=tcp://host:port, got {item!r}")
        if url.strip() in sources:
            raise ValueError(f"{url.strip()} has two event endpoints")
        sources[url.strip()] = parse_source(source)
    return sources


def feed_from_settings(
    settings: Settings,
    blocks: BlockSets,
    now_ms: Callable[[], float],
    session: Callable[[], aiohttp.ClientSession] | None = None,
) -> KVEventFeed:
    """The replica's feed, subscribed to the workers of ``--worker-kv-events`` (more come
    with ``POST /workers``); ``session`` reads each worker's chunk size."""
    feed = KVEventFeed(
        blocks,
        now_ms,
        replay_timeout_s=settings.kv_events_replay_timeout_s,
        max_message_bytes=settings.kv_events_max_message_bytes,
        session=session,
        info_timeout_s=settings.health_timeout_s,
    )
    for url, source in parse_worker_events(settings.worker_kv_events).items():
        feed.add(url, source)
    return feed


def disallowed_host(settings: Settings, source: EventSource) -> str | None:
    """The first of ``source``'s endpoints (``host:port``) that the worker allow-list refuses,
    if any: a host not on it, or a port it refuses a worker (Redis's, the router's own, a
    well-known non-HTTP service's)."""
    for endpoint in filter(None, (source.endpoint, source.replay)):
        shown = urlsplit(endpoint).netloc
        if not settings.worker_allowed(f"http://{shown}"):
            return shown
    return None


def allowed_source(settings: Settings, text: str) -> EventSource:
    """``POST /workers``'s ``kv_events``: parsed, and its hosts on the worker allow-list (the
    control plane must not make the router connect anywhere else)."""
    try:
        source = parse_source(text)
    except ValueError as exc:
        raise ServiceError(400, f"kv_events: {exc}", field="kv_events") from None
    host = disallowed_host(settings, source)
    if host is not None:
        raise ServiceError(
            403,
            f"kv_events: {host} is not allowed: its host must be on the worker allow-list "
            "(--allowed-worker-networks, --allowed-worker-hosts) and its port not one the "
            "router refuses (Redis's, its own, well-known non-HTTP services')",
            field="kv_events",
            error_type="forbidden",
        )
    return source


def source_from_server_info(worker_url: str, info: Any) -> EventSource:
    """The event source a worker's ``/server_info`` names under ``kv_events``: SGLang's
    descriptor (``publisher``, ``endpoint_host``, ``endpoint_port_base``,
    ``replay_endpoint_port_base`` when there is a replay endpoint, ``dp_size``), on the
    worker URL's own host where the descriptor gives a wildcard (a bind address). ValueError
    says why there is none."""
    if not isinstance(info, dict):
        raise ValueError("its server info is not a JSON object")
    found = info.get("kv_events")
    if found is None:
        raise ValueError("it describes no KV-event publisher (started without --kv-events-config)")
    if not isinstance(found, dict):
        raise ValueError(f"its kv_events descriptor is not an object: {found!r}")
    if found.get("publisher") != "zmq":
        raise ValueError(f"its publisher is {found.get('publisher')!r}, not 'zmq'")
    ranks = found.get("dp_size", 1)
    if ranks != 1:
        raise ValueError(
            f"{ranks} data-parallel ranks publish on ports base + rank: give each rank as its "
            "own worker with --worker-kv-events"
        )
    host = found.get("endpoint_host")
    if not isinstance(host, str) or host.strip("[]") in _WILDCARDS:
        host = url_host(worker_url)
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"

    def port(key: str) -> int:
        value = found.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            raise ValueError(f"its {key} is not a TCP port: {value!r}")
        return value

    endpoint = f"tcp://{host}:{port('endpoint_port_base')}"
    if found.get("replay_endpoint_port_base") is None:
        return parse_source(endpoint)
    return parse_source(f"{endpoint},tcp://{host}:{port('replay_endpoint_port_base')}")


MAX_INFO_BYTES = 1 << 20  # the most of a worker's /server_info read (SGLang's lists every argument)


def chunk_from_server_info(info: Any) -> int | None:
    """The most new tokens the worker prefills in a step (SGLang's ``chunked_prefill_size``);
    None when it does not say, or does not chunk (-1)."""
    size = info.get("chunked_prefill_size") if isinstance(info, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        return None
    return size


async def fetch_server_info(
    session: aiohttp.ClientSession, url: str, timeout_s: float, max_bytes: int
) -> Any:
    """SGLang's ``/server_info`` (``/get_server_info`` on versions before the rename);
    redirects are not followed and the body is read up to ``max_bytes``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    for path in ("/server_info", "/get_server_info"):
        get = session.get(url + path, timeout=timeout, allow_redirects=False)
        async with get as resp:
            if resp.status == 404:
                continue
            if resp.status != 200:
                raise ValueError(f"GET {path} answered {resp.status}")
            raw = await read_at_most(resp, max_bytes)
            if len(raw) > max_bytes:
                raise ValueError(f"GET {path} is larger than {max_bytes} bytes")
            return json.loads(raw)
    raise ValueError("it serves neither /server_info nor /get_server_info")


class EventDiscovery:
    """Subscribes to the events of workers that describe their publisher (``/server_info``'s
    ``kv_events``, SGLang's since it added the descriptor; the emulated worker's too).

    Before serving and every ``interval_s`` it asks each healthy worker that has no stream
    yet, and subscribes the feed to what the worker names, if its hosts are on the worker
    allow-list (the same rule as ``POST /workers``'s ``kv_events``). A worker that names none
    is asked again the next round (it may be restarted with a publisher); why it has none is
    logged once per change and kept in ``outcomes`` (``GET /workers``).
    """

    def __init__(
        self,
        feed: KVEventFeed,
        session: Callable[[], aiohttp.ClientSession],
        disallowed: Callable[[EventSource], str | None],
        *,
        registered: Callable[[str], bool] = lambda url: True,
        timeout_s: float = 2.0,
        max_info_bytes: int = MAX_INFO_BYTES,
    ) -> None:
        self.feed = feed
        self._session = session
        self._disallowed = disallowed  # the first of a source's endpoints not allowed, or None
        self._registered = registered  # whether the worker is still in the pool
        self.timeout_s = timeout_s
        self.max_info_bytes = max_info_bytes
        self.outcomes: dict[str, str] = {}  # url -> "subscribed" or why not

    async def _server_info(self, url: str) -> Any:
        return await fetch_server_info(self._session(), url, self.timeout_s, self.max_info_bytes)

    async def check(self, url: str) -> None:
        """Ask ``url`` once, unless it has a stream already."""
        if url in self.feed.sources:
            return
        try:
            source = source_from_server_info(url, await self._server_info(url))
            refused = self._disallowed(source)
            if refused is not None:
                raise ValueError(
                    f"its publisher at {refused} is not allowed (a host not on the worker "
                    "allow-list, or a port the router refuses)"
                )
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            reason = str(exc) or type(exc).__name__
            if not self._registered(url):  # removed while this one asked
                return
            if self.outcomes.get(url) != reason:
                log.info("no KV events discovered for %s: %s", url, reason)
            self.outcomes[url] = reason
            return
        if url in self.feed.sources or not self._registered(url):
            return  # configured, or removed, while this one asked
        self.feed.add(url, source)
        self.outcomes[url] = "subscribed"
        log.info("KV events of %s discovered at %s", url, source.endpoint)

    def forget(self, url: str) -> None:
        self.outcomes.pop(url, None)

    async def check_all(self, urls: Iterable[str]) -> None:
        await asyncio.gather(*(self.check(url) for url in urls))

    async def run(self, urls: Callable[[], list[str]], interval_s: float) -> None:
        """Ask every worker ``urls()`` names every ``interval_s`` (the router asked each once
        before serving); cancelled on shutdown."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check_all(urls())
            except Exception:  # a bug must not end discovery for the router's lifetime
                log.exception("KV-event discovery failed this round; it runs again")


class KVEventFeed:
    """The subscriptions of one router replica, feeding one ``BlockSets``."""

    def __init__(
        self,
        blocks: BlockSets,
        now_ms: Callable[[], float],
        *,
        replay_timeout_s: float = 5.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        refresh_s: float = 1.0,
        session: Callable[[], aiohttp.ClientSession] | None = None,
        info_timeout_s: float = 2.0,
    ) -> None:
        self.blocks = blocks
        self.now_ms = now_ms
        self._session = session  # reads each worker's chunk size; None: not read
        self.info_timeout_s = info_timeout_s
        self.chunk_reasons: dict[str, str] = {}  # url -> why its chunk size is not known
        self.replay_timeout_s = replay_timeout_s
        self.max_message_bytes = max_message_bytes
        self.refresh_s = refresh_s
        self.sources: dict[str, EventSource] = {}
        self.streams: dict[str, EventStream] = {}
        self.failures = 0  # subscriber tasks that failed and were restarted
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._timer: asyncio.Task[None] | None = None

    # -- membership ------------------------------------------------------------------------
    def add(self, url: str, source: EventSource) -> None:
        """Subscribe to ``url``'s events (now if the feed runs, else when it starts)."""
        if url in self.sources:
            raise KeyError(f"{url} already has an event stream")
        self.sources[url] = source
        self.blocks.add(url)
        self.streams[url] = EventStream(
            url,
            self.blocks,
            can_replay=source.replay is not None,
            max_message_bytes=self.max_message_bytes,
        )
        if self._ctx is not None:
            self._spawn(url)

    def remove(self, url: str) -> None:
        if url not in self.sources:
            return
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()
        del self.sources[url], self.streams[url]
        self.chunk_reasons.pop(url, None)
        self.blocks.remove(url)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        for url in self.sources:
            self._spawn(url)
        self._timer = asyncio.get_running_loop().create_task(self._refresh(), name="kv-stale")

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *([self._timer] if self._timer else [])]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _spawn(self, url: str) -> None:
        self._tasks[url] = asyncio.get_running_loop().create_task(
            self._supervise(url), name=f"kv-events {url}"
        )

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            for url in self.blocks.refresh(self.now_ms()):
                log.warning("KV events of %s are stale: matching it on the approximate index", url)

    async def _supervise(self, url: str) -> None:
        while True:
            try:
                await self._learn_chunk(url)
                await self._subscribe(url)
            except asyncio.CancelledError:
                raise
            except Exception:  # a feed must never take the router down: restart it
                self.failures += 1
                log.exception("KV-event subscriber of %s failed; restarting", url)
                if url in self.streams:
                    self.streams[url].disconnected()
                await asyncio.sleep(1.0)

    # -- one worker ------------------------------------------------------------------------
    async def _learn_chunk(self, url: str) -> None:
        """Read ``url``'s chunk size from its ``/server_info`` (best effort: without it the
        worker's requests in flight count their pages whole)."""
        if self._session is None:
            return
        try:
            info = await fetch_server_info(
                self._session(), url, self.info_timeout_s, MAX_INFO_BYTES
            )
            chunk = chunk_from_server_info(info)
            reason = None if chunk is not None else "its server info names no chunked_prefill_size"
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            chunk, reason = None, str(exc) or type(exc).__name__
        if url not in self.sources:
            return  # removed while it asked
        self.blocks.set_chunk(url, chunk)
        if reason is None:
            self.chunk_reasons.pop(url, None)
        elif self.chunk_reasons.get(url) != reason:
            log.info("chunk size of %s unknown (%s): pages count whole", url, reason)
            self.chunk_reasons[url] = reason

    async def _subscribe(self, url: str) -> None:
        assert self._ctx is not None
        source, stream = self.sources[url], self.streams[url]
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.LINGER, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        replay: zmq.asyncio.Socket | None = None
        try:
            sub.connect(source.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            deadline: float | None = None
            loop = asyncio.get_running_loop()
            while True:
                timeout = None if deadline is None else max(0.0, deadline - loop.time())
                ready = dict(await poller.poll(None if timeout is None else timeout * 1000))
                start: int | None = None
                if monitor in ready:
                    while _events(monitor) & zmq.POLLIN:
                        asked = self._on_monitor(stream, await monitor.recv_multipart())
                        start = asked if asked is not None else start
                if sub in ready:
                    start = await self._drain_live(sub, stream, start)
                if (
                    replay is not None
                    and replay in ready
                    and await self._drain_replay(replay, stream)
                ):
                    poller.unregister(replay)
                    replay.close(linger=0)
                    replay, deadline = None, None
                if deadline is not None and loop.time() >= deadline:
                    log.warning("KV-event replay of %s timed out", url)
                    stream.end_replay(self.now_ms())
                    if replay is not None:
                        poller.unregister(replay)
                        replay.close(linger=0)
                    replay, deadline = None, None
                if start is not None and source.replay is not None:
                    if replay is not None:
                        poller.unregister(replay)
                        replay.close(linger=0)
                    replay = self._ctx.socket(zmq.DEALER)
                    replay.setsockopt(zmq.LINGER, 0)
                    replay.connect(source.replay)
                    poller.register(replay, zmq.POLLIN)
                    await replay.send_multipart([b"", encode_seq(start)])
                    deadline = loop.time() + self.replay_timeout_s
        finally:
            if replay is not None:
                replay.close(linger=0)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _on_monitor(self, stream: EventStream, frames: list[bytes]) -> int | None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_CONNECTED:
            log.info("KV events of %s: connected; rebuilding from the replay", stream.url)
            return stream.begin(self.now_ms())
        if event == zmq.EVENT_DISCONNECTED:
            log.warning("KV events of %s: disconnected", stream.url)
            stream.disconnected()
        return None

    async def _drain_live(
        self, sub: zmq.asyncio.Socket, stream: EventStream, start: int | None
    ) -> int | None:
        """Every message waiting on ``sub`` (one wake-up, many batches under load)."""
        now = self.now_ms()
        while _events(sub) & zmq.POLLIN:
            asked = stream.on_live(await sub.recv_multipart(), now)
            if asked is not None:
                start = asked
        return start

    async def _drain_replay(self, replay: zmq.asyncio.Socket, stream: EventStream) -> bool:
        now = self.now_ms()
        while _events(replay) & zmq.POLLIN:
            frames = await replay.recv_multipart()
            if stream.on_replay(frames[1:] if frames and frames[0] == b"" else frames, now):
                return True
        return False

    # -- inspection ------------------------------------------------------------------------
    def worker_status(self, url: str) -> dict[str, Any] | None:
        """One worker's stream (``GET /workers``); None without one."""
        return self.status().get(url) if url in self.sources else None

    def status(self) -> dict[str, dict[str, Any]]:
        blocks = self.blocks.status()
        return {
            url: {
                "endpoint": source.endpoint,
                "replay": source.replay,
                "history": self.streams[url].history,
                **blocks[url],
                **self.streams[url].counters.to_dict(),
            }
            for url, source in self.sources.items()
        }

    def collector(self, name: Callable[[str], str] = lambda url: url) -> Collector:
        """Prometheus families of the feed (``kvroute_kv_events_*``), computed when scraped."""
        return _FeedCollector(self, name)


def _events(socket: zmq.asyncio.Socket) -> int:
    """The socket's ready flags, read without waiting."""
    flags: Any = socket.getsockopt(zmq.EVENTS)
    return int(flags)


class _FeedCollector(Collector):
    def __init__(self, feed: KVEventFeed, name: Callable[[str], str]) -> None:
        self.feed = feed
        self.name = name

    def collect(self) -> Iterator[Metric]:
        feed, name = self.feed, self.name
        if not feed.streams:  # exported only with KV events configured (docs/metrics.md)
            return
        live = GaugeMetricFamily(
            "kvroute_kv_events_live",
            "1 if the worker's cache is read from its KV events now, 0 if it falls back to "
            "the approximate index",
            labels=["worker", "status"],
        )
        blocks = GaugeMetricFamily(
            "kvroute_kv_events_blocks", "Pages the worker's events say it holds", labels=["worker"]
        )
        counts = {
            "batches": CounterMetricFamily(
                "kvroute_kv_events_batches", "KV-event batches applied", labels=["worker"]
            ),
            "gaps": CounterMetricFamily(
                "kvroute_kv_events_gaps", "Sequence gaps seen", labels=["worker"]
            ),
            "replays": CounterMetricFamily(
                "kvroute_kv_events_replays", "Replay requests made", labels=["worker"]
            ),
            "lost": CounterMetricFamily(
                "kvroute_kv_events_lost",
                "Times events were lost for good and the worker's set was rebuilt",
                labels=["worker"],
            ),
            "restarts": CounterMetricFamily(
                "kvroute_kv_events_restarts", "Publisher restarts seen", labels=["worker"]
            ),
        }
        dropped = CounterMetricFamily(
            "kvroute_kv_events_dropped",
            "Messages dropped (malformed, oversized, wrong frames)",
            labels=["worker", "reason"],
        )
        for url, stream in feed.streams.items():
            worker = feed.blocks.workers[url]
            label = name(url)
            live.add_metric([label, worker.status], 1.0 if worker.status == "live" else 0.0)
            blocks.add_metric([label], float(worker.blocks))
            c = stream.counters
            counts["batches"].add_metric([label], float(c.applied))
            counts["gaps"].add_metric([label], float(c.gaps))
            counts["replays"].add_metric([label], float(c.replays))
            counts["lost"].add_metric([label], float(c.lost))
            counts["restarts"].add_metric([label], float(c.restarts))
            for reason, n in c.dropped.items():
                dropped.add_metric([label, reason], float(n))
        yield live
        yield blocks
        yield from counts.values()
        yield dropped
