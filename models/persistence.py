"""Model snapshots: signed JSON, written atomically; a planted snapshot never runs code.

A snapshot holds a ``ModelSlot`` (champion, challenger, what each learned, their rolling
errors) as JSON behind an HMAC-SHA256 signature made with a dedicated key
(``KVROUTE_MODEL_SNAPSHOT_KEY``, never the admin token). ``loads`` checks the signature
before it reads anything else, and refuses a snapshot that is unsigned, signed with another
key, or in the old pickle format.

Models whose learned state is a few numbers (``ewmean``, ``ratio``, ``none``: the defaults)
say so with ``state()`` / ``load_state()`` and are stored as those numbers: nothing in them
can execute. River's learners (``linear``, ``tree``) have no such form; they are stored as a
pickle inside the signed JSON, and read back, once the signature holds, by an unpickler that
only builds River's and kvroute's model classes and a few plain containers.

>>> from models import ModelSlot
>>> slot = ModelSlot("ewmean")
>>> _ = slot.learn("w", {}, 42.0)
>>> data = dumps(slot, b"a key of at least 16 bytes")
>>> round(loads(data, b"a key of at least 16 bytes").predict("w", {}), 3)
42.0
>>> loads(data, b"another key, just as long")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
models.persistence.SnapshotError: model snapshot signature does not verify ...
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import math
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

from models.bank import ModelBank
from models.online_error import RollingMAE
from models.registry import ModelSpecError, make_model, parse_spec
from models.slot import ModelSlot

__all__ = ["MIN_KEY_BYTES", "SnapshotError", "dumps", "load", "loads", "save"]

_MAGIC = b"KVRM2\n"
_OLD_MAGIC = b"KVRM1"
_SIG_LEN = 32
FORMAT = "kvroute-models/2"
MIN_KEY_BYTES = 16


class SnapshotError(ValueError):
    """A snapshot is corrupt, of another format, or fails its signature check."""


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        raise SnapshotError(f"a snapshot key must be at least {MIN_KEY_BYTES} bytes")
    return key


def dumps(slot: ModelSlot, key: bytes) -> bytes:
    """The signed snapshot of ``slot``."""
    body = json.dumps(_slot_state(slot), separators=(",", ":"), allow_nan=False).encode()
    sig = hmac.new(_check_key(key), body, hashlib.sha256).digest()
    return _MAGIC + sig + body


def loads(data: bytes, key: bytes) -> ModelSlot:
    """The slot in a snapshot, once its signature verifies with ``key``."""
    _check_key(key)
    if data.startswith(_OLD_MAGIC):
        raise SnapshotError(
            "model snapshot is in the old pickle format, which is never loaded (it could run "
            "code); it is replaced at the next save"
        )
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + _SIG_LEN:
        raise SnapshotError("not a kvroute model snapshot (bad header)")
    sig = data[len(_MAGIC) : len(_MAGIC) + _SIG_LEN]
    body = data[len(_MAGIC) + _SIG_LEN :]
    if not hmac.compare_digest(sig, hmac.new(key, body, hashlib.sha256).digest()):
        raise SnapshotError(
            "model snapshot signature does not verify (signed with another key, or altered); "
            "refusing to load it"
        )
    try:
        state = json.loads(body)
        return _slot_from(state)
    except SnapshotError:
        raise
    except Exception as exc:  # noqa: BLE001 - signed, yet unreadable: say so, never crash
        raise SnapshotError(f"model snapshot is corrupt: {type(exc).__name__}: {exc}") from None


def save(slot: ModelSlot, path: str | os.PathLike[str], key: bytes) -> None:
    """Write atomically: a crash mid-write never leaves a truncated snapshot behind."""
    data = dumps(slot, key)  # first: a slot that cannot be stored leaves the old file alone
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | os.PathLike[str], key: bytes) -> ModelSlot:
    return loads(Path(path).read_bytes(), key)


# -- the JSON form ----------------------------------------------------------------------------
def _slot_state(slot: ModelSlot) -> dict[str, Any]:
    challenger = slot.challenger
    return {
        "format": FORMAT,
        "version": slot.version,
        "champion": _bank_state(slot.champion),
        "challenger": _bank_state(challenger) if challenger is not None else None,
    }


def _bank_state(bank: ModelBank) -> dict[str, Any]:
    return {
        "spec": bank.spec.to_dict(),
        "sharing": bank.sharing,
        "window": bank.window,
        "overrides": {w: s.to_dict() for w, s in bank.overrides.items()},
        "models": {key: _model_state(model) for key, model in list(bank._models.items())},
        "errors": {
            w: {"errors": list(t._errors), "count": t.count} for w, t in list(bank._errors.items())
        },
        "shared_workers": list(bank._one_hot),
        "last_sample": dict(bank._last_sample),
        "failures": bank.failures,
        "samples": bank.samples,
    }


def _model_state(model: Any) -> dict[str, Any]:
    state = getattr(model, "state", None)
    if callable(state):
        return {"state": state()}
    raw = pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL)
    return {"pickle": base64.b64encode(raw).decode("ascii")}


def _slot_from(state: dict[str, Any]) -> ModelSlot:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise SnapshotError(f"model snapshot is not in the {FORMAT} format")
    slot = ModelSlot.__new__(ModelSlot)
    slot.champion = _bank_from(state["champion"])
    challenger = state["challenger"]
    slot.challenger = _bank_from(challenger) if challenger is not None else None
    slot.version = _int(state["version"], "version")
    return slot


def _bank_from(state: dict[str, Any]) -> ModelBank:
    try:
        bank = ModelBank(
            parse_spec(state["spec"]),
            sharing=state["sharing"],
            window=_int(state["window"], "window"),
            overrides={w: parse_spec(s) for w, s in state["overrides"].items()},
        )
    except ModelSpecError as exc:
        raise SnapshotError(
            f"model snapshot names a model this router cannot build: {exc}"
        ) from None
    for key, model_state in state["models"].items():
        spec = bank.spec if key == "*" else bank.spec_for(key)
        bank._models[key] = _model_from(model_state, spec)
    for worker, tracked in state["errors"].items():
        errors = RollingMAE(bank.window)
        for error in tracked["errors"][-bank.window :]:
            errors.update(_finite(error, "errors"))
        errors.count = _int(tracked["count"], "count")
        bank._errors[worker] = errors
    bank._set_shared_workers([str(w) for w in state["shared_workers"]])
    bank._last_sample = {
        str(k): _int(v, "last_sample") for k, v in state.get("last_sample", {}).items()
    }
    bank.failures = _int(state["failures"], "failures")
    bank.samples = _int(state["samples"], "samples")
    return bank


def _model_from(state: dict[str, Any], spec: Any) -> Any:
    fresh = make_model(spec)
    if "state" in state:
        load_state = getattr(fresh, "load_state", None)
        if not callable(load_state):
            raise SnapshotError(f"model kind {spec.kind!r} cannot load a stored state")
        load_state(state["state"])
        return fresh
    model = _RiverUnpickler(io.BytesIO(base64.b64decode(state["pickle"]))).load()
    if type(model) is not type(fresh):
        raise SnapshotError(
            f"model snapshot holds a {type(model).__name__} where {spec.kind!r} builds a "
            f"{type(fresh).__name__}"
        )
    return model


def _int(value: Any, name: str) -> int:
    if type(value) is not int or value < 0:
        raise SnapshotError(f"model snapshot field {name!r} must be a non-negative integer")
    return value


def _finite(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SnapshotError(f"model snapshot field {name!r} must hold finite numbers")
    return float(value)


# River's learners in a snapshot: classes of these packages only, and a few plain types.
_RIVER_PACKAGES = (
    "river.compose.",
    "river.drift.",
    "river.linear_model.",
    "river.optim.",
    "river.preprocessing.",
    "river.stats.",
    "river.tree.",
    "river._river_rust.",
    "models.",
)
_PLAIN = {
    ("builtins", "float"),
    ("builtins", "int"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("collections", "Counter"),
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("collections", "deque"),
    ("random", "Random"),
    ("statistics", "NormalDist"),
    # A static method River's splitter keeps as an attribute (pickled by reference).
    ("river.tree.splitter.ebst_splitter", "EBSTNode._update_estimator_univariate"),
}


class _RiverUnpickler(pickle.Unpickler):
    """Builds model classes of River and kvroute and plain containers; nothing else (no
    function, no module attribute that is not a class), even from a signed snapshot."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module.startswith(_RIVER_PACKAGES) and "." not in name:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        raise SnapshotError(f"model snapshot refers to {module}.{name}, which is not a model")
