"""Token ids as the characters of a ``str``: compact, hashable, sliced at C speed.

A 10k-token prompt as a tuple of ints costs ~360 kB of objects; as a str it costs 40 kB and
compares with ``memcmp``. The radix cache and the prefix index take any sliceable key, so the
simulator and the emulated worker use these strings as token sequences. Code points in the
UTF-16 surrogate block are skipped so keys always encode.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["VOCAB_SIZE", "ids_to_key", "key_to_ids", "random_tokens"]

VOCAB_SIZE = 128_256  # Llama 3's vocabulary
_SURROGATE_START, _SURROGATE_SIZE = 0xD800, 0x800


def ids_to_key(ids: Iterable[int]) -> str:
    """Token ids -> key string (one character per token)."""
    return "".join(chr(i + _SURROGATE_SIZE if i >= _SURROGATE_START else i) for i in ids)


def key_to_ids(key: str) -> list[int]:
    out = []
    for ch in key:
        code = ord(ch)
        out.append(code - _SURROGATE_SIZE if code >= _SURROGATE_START + _SURROGATE_SIZE else code)
    return out


def random_tokens(gen: np.random.Generator, n: int) -> str:
    """``n`` uniformly random token ids from Llama 3's vocabulary, as a key string."""
    ids = gen.integers(0, VOCAB_SIZE, size=n)
    ids = np.where(ids >= _SURROGATE_START, ids + _SURROGATE_SIZE, ids).astype(np.uint32)
    return ids.tobytes().decode("utf-32-le")
