"""The simulated workers' KV events, fed to the router the way the service feeds them.

Each simulated worker's cache records its events (``sim.cache_events``); after every
scheduler step they are encoded as one SGLang batch with its sequence number and, after
``delay_ms`` of simulated time (the publisher's hop), handed as ZMQ-shaped frames to the
same ``EventStream`` and ``BlockSets`` the service's feed uses, with each worker's chunk
size (what the service reads from its ``/server_info``). Only the sockets differ.

Staleness runs on the simulated clock: ``refresh`` is called on each arrival.
"""

from __future__ import annotations

from router_service.kv_wire import EventBatch, encode_batch, encode_seq
from router_service.routing.block_sets import BlockSets
from router_service.routing.event_stream import EventStream
from sim.cache_events import EventedRadixCache
from sim.kernel import Environment
from sim.worker import SimWorker

__all__ = ["SimEventFeed"]


class SimEventFeed:
    """Publishes each worker's events into ``blocks`` after ``delay_ms``."""

    def __init__(self, env: Environment, blocks: BlockSets, delay_ms: float = 1.0) -> None:
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        self.env = env
        self.blocks = blocks
        self.delay_ms = delay_ms
        self.streams: dict[str, EventStream] = {}
        self.batches = 0
        self._seq: dict[str, int] = {}

    def attach(self, worker: SimWorker) -> None:
        """Subscribe to ``worker`` (its cache must be an ``EventedRadixCache``)."""
        if not isinstance(worker.cache, EventedRadixCache):
            raise TypeError(f"{worker.url}: KV events need an EventedRadixCache")
        url = worker.url
        self.blocks.add(url)
        self.blocks.set_chunk(url, worker.profile.chunked_prefill_tokens)  # its /server_info's
        stream = EventStream(url, self.blocks, can_replay=False)
        stream.begin(self.env.now_ms)
        self.streams[url] = stream
        self._seq[url] = 0
        worker.on_step = lambda: self._publish(worker)
        self._publish(worker)  # the new cache's AllBlocksCleared: the stream is live after it

    def _publish(self, worker: SimWorker) -> None:
        assert isinstance(worker.cache, EventedRadixCache)
        events = worker.cache.events.take()
        if not events:
            return
        url = worker.url
        seq = self._seq[url]
        self._seq[url] = seq + 1
        payload = encode_batch(EventBatch(self.env.now_ms / 1000.0, events))
        frames = [b"", encode_seq(seq), payload]
        self.batches += 1
        self.env.schedule(self.delay_ms, self._deliver, url, frames)

    def _deliver(self, url: str, frames: list[bytes]) -> None:
        stream = self.streams.get(url)
        if stream is not None:
            stream.on_live(frames, self.env.now_ms)

    def refresh(self) -> None:
        self.blocks.refresh(self.env.now_ms)
