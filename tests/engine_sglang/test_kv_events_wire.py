"""kvroute's KV-event wire format and page hashes against SGLang 0.5.23's own.

The router decodes what SGLang's ``ZmqEventPublisher`` sends and SGLang decodes what the
emulated worker sends (``router_service.kv_wire``); the router hashes a request's pages as
SGLang's native hash does (``router_service.routing.block_hash`` vs ``get_hash_str`` and
``hash_str_to_int64``, which SGLang's ``KVCacheEventRecorder`` publishes).

``router_service.routing``'s package imports River, which this virtualenv does not have, so
the hash module is loaded from its file (it needs only numpy and ``engine_ext``).
"""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
import zmq
from sglang.srt.disaggregation import kv_events as sgl
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

from router_service import kv_wire

ROOT = Path(__file__).resolve().parents[2]


def block_hash() -> ModuleType:
    path = ROOT / "router_service" / "routing" / "block_hash.py"
    spec = importlib.util.spec_from_file_location("kvroute_block_hash", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sglang_batch() -> sgl.KVEventBatch:
    return sgl.KVEventBatch(
        ts=1.5,
        events=[
            sgl.BlockStored(
                block_hashes=[-5, 2**62],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                lora_id=None,
                medium="GPU",
            ),
            sgl.BlockStored(
                block_hashes=[9],
                parent_block_hash=2**62,
                token_ids=[5, 6],
                block_size=2,
                lora_id=None,
                cache_salt="salt",
            ),
            sgl.BlockRemoved(block_hashes=[9], medium="GPU"),
            sgl.AllBlocksCleared(),
        ],
        attn_dp_rank=0,
    )


def test_kvroute_decodes_sglangs_batches() -> None:
    payload = msgspec.msgpack.Encoder().encode(sglang_batch())
    ours = kv_wire.decode_batch(payload)
    assert ours.ts == 1.5
    assert ours.attn_dp_rank == 0
    first, second, removed, cleared = ours.events
    assert isinstance(first, kv_wire.BlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == (
        [-5, 2**62],
        None,
        [1, 2, 3, 4],
    )
    assert (first.block_size, first.medium) == (2, "GPU")
    assert isinstance(second, kv_wire.BlockStored)
    assert (second.parent_block_hash, second.cache_salt) == (2**62, "salt")
    assert isinstance(removed, kv_wire.BlockRemoved)
    assert removed.block_hashes == [9]
    assert isinstance(cleared, kv_wire.AllBlocksCleared)


def test_sglang_decodes_kvroutes_batches() -> None:
    ours = kv_wire.EventBatch(
        2.0,
        [
            kv_wire.BlockStored([7, 8], None, [1, 2, 3, 4], 2, None),
            kv_wire.BlockRemoved([7]),
            kv_wire.AllBlocksCleared(),
        ],
    )
    theirs = msgspec.msgpack.Decoder(sgl.KVEventBatch).decode(kv_wire.encode_batch(ours))
    stored, removed, cleared = theirs.events
    assert isinstance(stored, sgl.BlockStored)
    assert (stored.block_hashes, stored.token_ids, stored.block_size) == ([7, 8], [1, 2, 3, 4], 2)
    assert isinstance(removed, sgl.BlockRemoved)
    assert removed.block_hashes == [7]
    assert isinstance(cleared, sgl.AllBlocksCleared)


@pytest.mark.parametrize("page", [1, 2, 16])
def test_page_hashes_are_sglangs(page: int) -> None:
    hashes = block_hash()
    rng = random.Random(page)
    ids = [rng.randrange(0, 128_256) for _ in range(page * 9)]
    theirs = [hash_str_to_int64(h) for h in get_hash_str(ids, None, page_size=page)]
    assert hashes.page_hashes(ids, page) == theirs


def test_sglangs_publisher_frames_and_replay_read_as_kvroute_expects() -> None:
    ctx = zmq.Context.instance()
    port, replay_port = _free_port(), _free_port()
    publisher = sgl.ZmqEventPublisher(
        attn_dp_rank=0,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        bind=True,
    )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 10
        frames = None
        while frames is None and time.monotonic() < deadline:  # until the subscription is on
            publisher.publish(sglang_batch())
            if sub.poll(100):
                frames = sub.recv_multipart()
        assert frames is not None
        topic, seq, payload = frames  # kvroute's live shape: [topic, seq, payload]
        assert topic == b""
        assert kv_wire.decode_seq(seq) >= 0
        assert len(kv_wire.decode_batch(payload).events) == 4
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", kv_wire.encode_seq(0)])
        replayed = []
        while True:
            assert dealer.poll(5000)
            reply = dealer.recv_multipart()
            assert reply[0] == b""  # the DEALER's delimiter, which kvroute strips
            if kv_wire.decode_seq(reply[2]) == kv_wire.END_SEQ:
                break
            replayed.append(kv_wire.decode_seq(reply[2]))
            kv_wire.decode_batch(reply[3])
        assert replayed[0] == 0
        assert replayed == sorted(replayed)
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        publisher.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
