"""The emulated worker's KV-event publisher: SGLang's ``ZmqEventPublisher`` on asyncio.

Configured as SGLang is, with ``--kv-events-config`` JSON (``KVEventsSettings``): a PUB
socket on ``endpoint`` sends each batch as ``(topic, seq, payload)`` with sequence numbers
from 0, and keeps the last ``buffer_steps`` batches for a ROUTER on ``replay_endpoint``,
which answers ``(b"", start_seq)`` with every kept batch from ``start_seq`` on and then the
end marker (sequence -1), frame for frame as SGLang's publisher does. Endpoints bind when
their host is a wildcard (``*``, ``0.0.0.0``) or loopback, as the emulator always serves
locally.

>>> KVEventsSettings.parse('{"publisher": "zmq", "endpoint": "tcp://*:5557"}').endpoint
'tcp://*:5557'
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from router_service.kv_wire import END_SEQ, EventBatch, KVEvent, encode_batch, encode_seq

__all__ = ["KVEventPublisher", "KVEventsSettings"]

log = logging.getLogger("kvroute.emulator.kv_events")


@dataclass(frozen=True, slots=True)
class KVEventsSettings:
    """SGLang's ``KVEventsConfig`` fields the emulator honours."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsSettings:
        """The JSON of ``--kv-events-config``; ValueError names what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        publisher = raw.pop("publisher", "zmq")
        if publisher != "zmq":
            raise ValueError(f"the emulator publishes with 'zmq' only, got {publisher!r}")
        raw.pop("max_queue_size", None)  # SGLang's thread queue; nothing queues here
        raw.pop("bind", None)  # the emulator always binds (it serves on this host)
        if raw.pop("format", "default") != "default":
            raise ValueError("the emulator publishes SGLang's default format only")
        known = {"endpoint", "replay_endpoint", "buffer_steps", "hwm", "topic"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown --kv-events-config keys: {', '.join(unknown)}")
        return cls(**raw)


class KVEventPublisher:
    """PUB socket, replay buffer and replay ROUTER; ``publish`` never blocks."""

    def __init__(self, settings: KVEventsSettings) -> None:
        self.settings = settings
        self._ctx = zmq.asyncio.Context()
        self._replay: zmq.asyncio.Socket | None = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, settings.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(settings.endpoint)
            if settings.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(settings.replay_endpoint)
        except zmq.ZMQError:
            # A port in use: close what was opened now. A context left to the garbage
            # collector terms in whichever thread collects it, and term() can block there.
            self._ctx.destroy(linger=0)
            raise
        self._topic = settings.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self.published = 0
        self.replays = 0

    def endpoints(self) -> dict[str, str | None]:
        """The bound addresses (a ``:0`` port resolved)."""
        replay = self._replay
        return {
            "endpoint": self._pub.getsockopt_string(zmq.LAST_ENDPOINT),
            "replay_endpoint": replay.getsockopt_string(zmq.LAST_ENDPOINT) if replay else None,
        }

    def start(self) -> None:
        if self._replay is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replays())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._ctx.destroy(linger=0)

    def publish(self, events: list[KVEvent]) -> None:
        """Send one batch (nothing when ``events`` is empty)."""
        if not events:
            return
        seq = self._seq
        self._seq += 1
        payload = encode_batch(EventBatch(time.time(), events))
        self._buffer.append((seq, payload))
        # PUB never blocks and never raises for a slow subscriber: past the high-water mark
        # it drops the batch for that one, who sees the gap in the sequence and replays it.
        self._pub.send_multipart([self._topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)
        self.published += 1

    async def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            self.replays += 1
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart(
                        [client, b"", self._topic, encode_seq(seq), payload]
                    )
            await self._replay.send_multipart([client, b"", b"", encode_seq(END_SEQ), b""])

    def describe(self, page_size: int) -> dict[str, Any]:
        """``/server_info``'s ``kv_events`` entry, in SGLang's shape: the configured host
        (``*`` for a wildcard, which a subscriber replaces with the worker's), the bound ports."""
        ends = self.endpoints()
        port = int(str(ends["endpoint"]).rsplit(":", 1)[1])
        info: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint_host": urlsplit(self.settings.endpoint).hostname or "*",
            "endpoint_port_base": port,
            "topic": self.settings.topic,
            "block_size": page_size,
            "dp_size": 1,
        }
        if ends["replay_endpoint"]:
            info["replay_endpoint_port_base"] = int(str(ends["replay_endpoint"]).rsplit(":", 1)[1])
        return info
