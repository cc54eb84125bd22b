"""One worker's KV-event stream in order: sequence numbers, gaps, replay, rebuilds.

SGLang numbers its batches from 0 and keeps the last ones for replay. The stream applies
batch ``n`` only after ``n - 1`` (``BlockSets`` must see every removal to stay a subset of
the worker's cache), and decides, with no I/O of its own (the feed in
``router_service.kv_events`` does the sockets and passes the clock):

- **(re)connect** (``begin``): the worker may have restarted or events may have been lost
  while disconnected, so its set is cleared and rebuilt: replay from sequence 0. Whatever
  the replay buffer no longer holds was stored before the oldest batch it has; those blocks
  stay unknown (under-predicted, never over-predicted) until the worker stores them again.
- **gap** (a live batch past the next expected one): it waits, and the missing ones are
  asked of the replay endpoint; batches that arrive meanwhile wait too (``max_pending``).
- **lost for good** (no replay endpoint, the replay buffer moved on, a replay that timed
  out, a malformed or oversized batch that took a sequence number): the set is cleared and
  goes on from the next batch.
- **restart** (a live batch before the expected one: a new publisher counting from 0):
  cleared and rebuilt from a replay.

Messages are lists of ZMQ frames: live ``[topic, seq, payload]``, replayed the same after
the DEALER's empty delimiter is stripped; the replay ends with sequence ``-1``. Frames of the
wrong shape are dropped and counted without touching any state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router_service.kv_wire import END_SEQ, MalformedMessage, decode_batch, decode_seq
from router_service.routing.block_sets import BlockSets

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "EventStream", "StreamCounters"]

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(slots=True)
class StreamCounters:
    received: int = 0  # batches (live and replayed) with a sequence number
    applied: int = 0
    replayed: int = 0  # of those applied, from the replay endpoint
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0  # replay requests made
    lost: int = 0  # times events were lost for good (the set was cleared)
    restarts: int = 0
    malformed: int = 0
    oversized: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> messages dropped

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "received": self.received,
            "applied": self.applied,
            "replayed": self.replayed,
            "duplicates": self.duplicates,
            "gaps": self.gaps,
            "replays": self.replays,
            "lost": self.lost,
            "restarts": self.restarts,
            "malformed": self.malformed,
            "oversized": self.oversized,
            "dropped": dict(self.dropped),
        }


class EventStream:
    """Orders one worker's batches into its ``BlockSets`` entry."""

    def __init__(
        self,
        url: str,
        blocks: BlockSets,
        *,
        can_replay: bool,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_pending: int = 10_000,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.url = url
        self.blocks = blocks
        self.can_replay = can_replay
        self.max_message_bytes = max_message_bytes
        self.max_pending = max_pending
        self.on_drop = on_drop
        self.counters = StreamCounters()
        self.expected: int | None = None  # the next sequence number to apply
        self.replaying = False
        self.history: str | None = None  # "full" (from sequence 0) or "partial"
        self._pending: dict[int, bytes] = {}

    # -- the feed's calls ------------------------------------------------------------------
    def begin(self, now_ms: float) -> int | None:
        """The subscription (re)connected: clear and rebuild. Returns the sequence to replay
        from (0), or None without a replay endpoint."""
        self.blocks.clear(self.url, "reconnected")
        self.blocks.set_status(self.url, "connecting", "waiting for the replay")
        self.expected, self.history = None, None
        self._pending.clear()
        return self._ask(0)

    def disconnected(self) -> None:
        self.blocks.set_status(self.url, "disconnected", "the event socket is not connected")
        self.replaying = False

    def on_live(self, frames: list[bytes], now_ms: float) -> int | None:
        """A live message; returns a sequence to replay from when one is needed now."""
        parsed = self._parse(frames)
        if parsed is None:
            return None
        seq, payload = parsed
        self.counters.received += 1
        if self.replaying or (self.expected is not None and seq > self.expected):
            if len(self._pending) >= self.max_pending:
                self._drop("pending_full")
                return None
            self._pending[seq] = payload
            if self.replaying:
                return None
            self.counters.gaps += 1
            if not self.can_replay:
                self._lost_then_drain(now_ms)
                return None
            # A removal may be among the missing batches: until they are in, the set may
            # hold blocks the worker dropped, so the router does not read it.
            self.blocks.set_status(self.url, "connecting", "replaying missed events")
            return self._ask(self.expected)
        if self.expected is not None and seq < self.expected:
            # A new publisher (the worker restarted): its history replaces ours.
            self.counters.restarts += 1
            self.blocks.clear(self.url, "restart")
            self.expected, self.history = None, None
            self._pending = {seq: payload}
            if not self.can_replay:
                self._lost_then_drain(now_ms)
                return None
            return self._ask(0)
        if self.expected is None:  # the first batch, with no replay: history starts here
            self.expected, self.history = seq, "full" if seq == 0 else "partial"
        self._apply(seq, payload, now_ms)
        return None

    def on_replay(self, frames: list[bytes], now_ms: float) -> bool:
        """A message from the replay endpoint; True when the replay is over."""
        if len(frames) >= 2 and len(frames[1]) == 8 and decode_seq(frames[1]) == END_SEQ:
            self.end_replay(now_ms)
            return True
        parsed = self._parse(frames)
        if parsed is None or not self.replaying:
            return False
        seq, payload = parsed
        self.counters.received += 1
        if self.expected is None:
            self.expected, self.history = seq, "full" if seq == 0 else "partial"
        if seq < self.expected:
            self.counters.duplicates += 1
            return False
        if seq > self.expected:  # the buffer no longer holds what we missed
            self._lose(seq)
        if self._apply(seq, payload, now_ms):
            self.counters.replayed += 1
        return False

    def end_replay(self, now_ms: float) -> None:
        """The replay ended (or timed out): apply what waited, in order."""
        self.replaying = False
        self._drain(now_ms)
        if self.expected is None and not self._pending:
            # Nothing published yet, or nothing kept: the worker's history starts with the
            # next batch, and it holds nothing we could know of.
            self.history = self.history or "partial"
            self.blocks.set_status(self.url, "live")

    # -- internals -------------------------------------------------------------------------
    def _ask(self, start: int | None) -> int | None:
        if not self.can_replay or start is None:
            return None
        self.replaying = True
        self.counters.replays += 1
        return start

    def _parse(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        if len(frames) != 3:
            self._drop("frames")
            return None
        try:
            seq = decode_seq(frames[1])
        except MalformedMessage:
            self._drop("sequence")
            return None
        if seq < 0:
            self._drop("sequence")
            return None
        return seq, frames[2]

    def _drop(self, reason: str) -> None:
        self.counters.drop(reason)
        if self.on_drop is not None:
            self.on_drop(reason)

    def _apply(self, seq: int, payload: bytes, now_ms: float) -> bool:
        """Apply batch ``seq`` (the expected one); a batch that cannot be read loses it."""
        self.expected = seq + 1
        if len(payload) > self.max_message_bytes:
            self.counters.oversized += 1
            self._drop("oversized")
            self._lose(seq + 1)
            return False
        try:
            batch = decode_batch(payload)
        except MalformedMessage:
            self.counters.malformed += 1
            self._drop("malformed")
            self._lose(seq + 1)
            return False
        self.blocks.apply(self.url, batch, now_ms)
        self.counters.applied += 1
        return True

    def _lose(self, resume: int) -> None:
        """Events before ``resume`` are lost for good: start the set again from there."""
        self.counters.lost += 1
        self.blocks.clear(self.url, "events lost")
        self.history = "partial"
        self.expected = resume

    def _lost_then_drain(self, now_ms: float) -> None:
        first = min(self._pending)
        self._lose(first)
        self._drain(now_ms)

    def _drain(self, now_ms: float) -> None:
        pending = self._pending
        for seq in sorted(pending):
            payload = pending.pop(seq)
            if self.expected is None:
                self.expected = seq
                self.history = self.history or ("full" if seq == 0 else "partial")
            if seq < self.expected:
                self.counters.duplicates += 1
                continue
            if seq > self.expected:
                self._lose(seq)
            self._apply(seq, payload, now_ms)
