"""Token ids as the characters of a ``str``: compact, hashable, sliced at C speed.

A 10k-token prompt as a tuple of ints costs ~360 kB of objects; as a str it costs 40 kB and
compares with ``memcmp``. The radix cache and the prefix index take any sliceable key, so the
simulator and the emulated worker use these strings as token sequences. Code points in the
UTF-16 surrogate block are skipped so keys always encode.
"""

from __future__ import annotations

import numpy as np

from engine_ext.cache.keys import ids_to_key, key_to_ids

__all__ = ["VOCAB_SIZE", "array_to_key", "ids_to_key", "key_to_ids", "random_tokens"]

VOCAB_SIZE = 128_256  # Llama 3's vocabulary
_SURROGATE_START, _SURROGATE_SIZE = 0xD800, 0x800  # see engine_ext.cache.keys


def random_tokens(gen: np.random.Generator, n: int) -> str:
    """``n`` uniformly random token ids from Llama 3's vocabulary, as a key string."""
    return array_to_key(gen.integers(0, VOCAB_SIZE, size=n))


def array_to_key(ids: np.ndarray) -> str:
    """A numpy array of token ids in ``[0, VOCAB_SIZE)`` as a key string, at C speed."""
    ids = np.where(ids >= _SURROGATE_START, ids + _SURROGATE_SIZE, ids).astype(np.uint32)
    return ids.tobytes().decode("utf-32-le")
