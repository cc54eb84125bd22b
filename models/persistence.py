"""Model snapshots: pickled, optionally signed, written atomically.

A snapshot holds a ``ModelSlot`` (champion, challenger, learned state). Unpickling runs code,
so only load snapshots from places you trust; with a ``key`` every snapshot carries an
HMAC-SHA256 signature and a snapshot that does not verify is refused before unpickling.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import tempfile
from pathlib import Path

from models.slot import ModelSlot

__all__ = ["SnapshotError", "dumps", "load", "loads", "save"]

_MAGIC = b"KVRM1"
_SIG_LEN = 32


class SnapshotError(ValueError):
    """A snapshot is corrupt, of another format, or fails its signature check."""


def dumps(slot: ModelSlot, key: bytes | None = None) -> bytes:
    body = pickle.dumps(slot, protocol=pickle.HIGHEST_PROTOCOL)
    sig = hmac.new(key, body, hashlib.sha256).digest() if key else b"\0" * _SIG_LEN
    return _MAGIC + sig + body


def loads(data: bytes, key: bytes | None = None) -> ModelSlot:
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + _SIG_LEN:
        raise SnapshotError("not a kvroute model snapshot (bad header)")
    sig = data[len(_MAGIC) : len(_MAGIC) + _SIG_LEN]
    body = data[len(_MAGIC) + _SIG_LEN :]
    if key is not None and not hmac.compare_digest(
        sig, hmac.new(key, body, hashlib.sha256).digest()
    ):
        raise SnapshotError("model snapshot signature does not verify; refusing to load it")
    try:
        slot = pickle.loads(body)  # signed when a key is set; see module doc
    except Exception as exc:  # noqa: BLE001
        raise SnapshotError(f"model snapshot is corrupt: {exc}") from None
    if not isinstance(slot, ModelSlot):
        raise SnapshotError(f"model snapshot holds a {type(slot).__name__}, not a ModelSlot")
    return slot


def save(slot: ModelSlot, path: str | os.PathLike[str], key: bytes | None = None) -> None:
    """Write atomically: a crash mid-write never leaves a truncated snapshot behind."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(dumps(slot, key))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | os.PathLike[str], key: bytes | None = None) -> ModelSlot:
    return loads(Path(path).read_bytes(), key)
