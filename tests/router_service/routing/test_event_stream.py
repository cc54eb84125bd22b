"""One worker's event stream: order, gaps and replay, lost events, restarts, bad messages.

Frames are built as SGLang's publisher sends them (``[topic, seq, payload]``); the replay
endpoint's answers as the feed hands them over (delimiter stripped, ``-1`` at the end).
"""

from __future__ import annotations

from router_service.kv_wire import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    encode_seq,
)
from router_service.routing.block_hash import page_hashes
from router_service.routing.block_sets import BlockSets
from router_service.routing.event_stream import EventStream

PAGE = 2


def store(ids: list[int]) -> bytes:
    return encode_batch(
        EventBatch(0.0, [BlockStored(page_hashes(ids, PAGE), None, ids, PAGE, None)])
    )


def remove(ids: list[int]) -> bytes:
    return encode_batch(EventBatch(0.0, [BlockRemoved(page_hashes(ids, PAGE))]))


def frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"", encode_seq(seq), payload]


END = [b"", encode_seq(END_SEQ), b""]
A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def stream(can_replay: bool = True, **kwargs: int) -> tuple[EventStream, BlockSets]:
    sets = BlockSets()
    sets.add("w")
    return EventStream("w", sets, can_replay=can_replay, **kwargs), sets


def cached(sets: BlockSets, ids: list[int]) -> int | None:
    matched, _ = sets.match(str(ids), ids, ["w"])
    return matched.get("w")


def test_connect_replays_history_then_applies_live_batches_in_order() -> None:
    s, sets = stream()
    assert s.begin(0.0) == 0  # replay from the start
    assert cached(sets, A) is None  # connecting: not read until the replay is in
    assert s.on_live(frames(2, store(C)), 0.0) is None  # waits for the replay
    assert not s.on_replay(frames(0, store(A)), 0.0)
    assert not s.on_replay(frames(1, store(B)), 0.0)
    assert s.on_replay(END, 0.0)
    assert (cached(sets, A), cached(sets, B), cached(sets, C)) == (4, 4, 4)
    assert s.history == "full"
    assert s.counters.replayed == 2
    assert s.counters.applied == 3


def test_a_gap_is_replayed_and_the_stream_is_not_read_meanwhile() -> None:
    s, sets = stream()
    s.begin(0.0)
    s.on_replay(END, 0.0)
    s.on_live(frames(0, store(A)), 0.0)
    assert s.on_live(frames(2, remove(A)), 0.0) == 1  # batch 1 missing: replay from 1
    assert s.counters.gaps == 1
    assert cached(sets, A) is None  # a removal may be missing: fall back
    s.on_replay(frames(1, store(B)), 0.0)
    s.on_replay(frames(2, remove(A)), 0.0)  # also buffered live: applied once
    s.on_replay(END, 0.0)
    assert (cached(sets, A), cached(sets, B)) == (0, 4)
    assert s.counters.duplicates == 1
    assert s.counters.lost == 0


def test_a_gap_the_replay_cannot_fill_rebuilds_from_what_comes_next() -> None:
    s, sets = stream()
    s.begin(0.0)
    s.on_replay(END, 0.0)
    s.on_live(frames(0, store(A)), 0.0)
    assert s.on_live(frames(5, store(B)), 0.0) == 1
    s.on_replay(frames(4, store(C)), 0.0)  # the buffer moved on: 1-3 are gone for good
    s.on_replay(END, 0.0)
    # A could have been removed in 1-3: forgotten (a subset never over-predicts).
    assert (cached(sets, A), cached(sets, B), cached(sets, C)) == (0, 4, 4)
    assert s.counters.lost == 1
    assert s.history == "partial"


def test_without_a_replay_endpoint_a_gap_is_lost_at_once() -> None:
    s, sets = stream(can_replay=False)
    assert s.begin(0.0) is None
    s.on_live(frames(3, store(A)), 0.0)  # history starts here
    assert s.history == "partial"
    assert cached(sets, A) == 4
    assert s.on_live(frames(5, store(B)), 0.0) is None
    assert (cached(sets, A), cached(sets, B)) == (0, 4)
    assert s.counters.lost == 1


def test_a_restarted_publisher_replaces_the_history() -> None:
    s, sets = stream()
    s.begin(0.0)
    s.on_replay(END, 0.0)
    for seq, ids in enumerate((A, B, C)):
        s.on_live(frames(seq, store(ids)), 0.0)
    assert s.on_live(frames(0, store(B)), 0.0) == 0  # a new process counts from 0 again
    assert s.counters.restarts == 1
    s.on_replay(frames(0, store(B)), 0.0)
    s.on_replay(END, 0.0)
    assert (cached(sets, A), cached(sets, B), cached(sets, C)) == (0, 4, 0)


def test_reconnecting_rebuilds_from_the_replay() -> None:
    s, sets = stream()
    s.begin(0.0)
    s.on_replay(END, 0.0)
    s.on_live(frames(0, store(A)), 0.0)
    s.disconnected()
    assert cached(sets, A) is None
    assert s.begin(0.0) == 0
    s.on_replay(frames(0, store(A)), 0.0)
    s.on_replay(frames(1, store(B)), 0.0)
    s.on_replay(END, 0.0)
    assert (cached(sets, A), cached(sets, B)) == (4, 4)
    assert sets.workers["w"].clears >= 1


def test_bad_messages_are_dropped_and_counted_and_never_raise() -> None:
    drops: list[str] = []
    s, sets = stream(can_replay=False, max_message_bytes=200)
    s.on_drop = drops.append
    s.begin(0.0)
    s.on_live(frames(0, store(A)), 0.0)
    s.on_live([b"only one frame"], 0.0)
    s.on_live([b"", b"short", b"x"], 0.0)
    s.on_live(frames(1, b"\xc1 not msgpack"), 0.0)  # takes seq 1: the set starts again
    assert cached(sets, A) == 0
    s.on_live(frames(2, store(B)), 0.0)
    s.on_live(frames(3, b"\x00" * 201), 0.0)  # oversized
    assert drops == ["frames", "sequence", "malformed", "oversized"]
    assert s.counters.malformed == 1
    assert s.counters.oversized == 1
    assert s.counters.dropped == {"frames": 1, "sequence": 1, "malformed": 1, "oversized": 1}
    s.on_live(frames(4, store(C)), 0.0)
    assert cached(sets, C) == 4
