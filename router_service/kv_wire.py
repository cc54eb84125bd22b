"""SGLang's KV-event wire format (``sglang/srt/disaggregation/kv_events.py``, 0.5.23).

A worker started with ``--kv-events-config '{"publisher": "zmq", ...}'`` publishes, after
each scheduler step that changed its radix cache, one ZMQ multipart message
``(topic, seq, payload)``: ``seq`` an 8-byte big-endian sequence number counting from 0,
``payload`` a msgpack ``EventBatch`` encoded as the array ``[ts, events, attn_dp_rank]``
whose events are maps tagged by ``type``:

- ``BlockStored``: ``block_hashes`` (one signed 64-bit hash per page, in order),
  ``parent_block_hash`` (the page before the first, ``None`` at the root), ``token_ids``,
  ``block_size`` (the page size), ``lora_id``; optional fields are omitted when unset;
- ``BlockRemoved``: ``block_hashes``;
- ``AllBlocksCleared``: the cache was flushed.

The replay endpoint is a ROUTER socket: a DEALER sends ``(b"", start_seq)`` and receives
every buffered batch from ``start_seq`` on as ``(b"", topic, seq, payload)``, then
``(b"", b"", -1, b"")``. Encoding here is the same msgspec layout, so SGLang's classes
decode what the emulated worker publishes and the router decodes SGLang's (tested in the
engine tier against SGLang's own classes).

>>> batch = EventBatch(1.5, [BlockStored([7, 8], None, [1, 2], 1, None), AllBlocksCleared()])
>>> decode_batch(encode_batch(batch)) == batch
True
"""

from __future__ import annotations

import msgspec

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "MalformedMessage",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
]

END_SEQ = -1  # the replay socket's end-of-replay marker


class MalformedMessage(ValueError):
    """A message that is not a KV-event batch (wrong frames, bad msgpack, too large)."""


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """SGLang's ``KVCacheEvent``: a msgpack map tagged with the class name under ``type``."""


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_Event):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KVEvent]
    attn_dp_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in ``payload``; ``MalformedMessage`` for anything else."""
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(f"not a KV-event batch: {exc}") from None


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """A sequence-number frame (8 bytes, big endian); ``MalformedMessage`` otherwise."""
    if len(frame) != 8:
        raise MalformedMessage(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)
