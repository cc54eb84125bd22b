"""Page hashes of a token sequence, computed the way SGLang hashes its KV events.

SGLang 0.5.23 (``mem_cache/cpp_utils/hash_binding.cpp``, ``mem_cache/utils.py``) gives every
page of ``page_size`` tokens the SHA-256 of the previous page's digest (none for the first
page) followed by the page's token ids as little-endian ``uint32``; the event's block hash is
the digest's first 8 bytes read as a signed big-endian 64-bit integer
(``hash_str_to_int64``). The digest chains, so a page's hash names the whole prefix up to
its end: two sequences share their first ``k`` page hashes exactly when they share their
first ``k`` pages. Only full pages are hashed (SGLang's tree holds page-aligned keys).

This is the definition; the router hashes a request lazily (``iter_page_hashes``) and stops
at the first page no worker holds, so a miss costs one hash.

>>> hashes = page_hashes([1, 2, 3, 4, 5], page_size=2)
>>> len(hashes), hashes == page_hashes([1, 2, 3, 4, 9], page_size=2)
(2, True)
>>> first = hashlib.sha256(bytes([1, 0, 0, 0, 2, 0, 0, 0])).digest()
>>> hashes[0] == int.from_bytes(first[:8], "big", signed=True)
True
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from engine_ext.cache.keys import key_to_ids

__all__ = ["iter_page_hashes", "page_hashes", "token_bytes"]

_SHA256 = hashlib.sha256


def token_bytes(tokens: Sequence[int] | str) -> bytes:
    """Token ids (or a token key string, ``engine_ext.cache.keys``) as little-endian u32."""
    ids = key_to_ids(tokens) if isinstance(tokens, str) else tokens
    return np.asarray(ids, dtype="<u4").tobytes()


def iter_page_hashes(data: bytes, page_size: int) -> Iterator[int]:
    """The block hash of each full page of ``data`` (``token_bytes``), in order, lazily."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    step = 4 * page_size
    prior = b""
    for start in range(0, len(data) - step + 1, step):
        prior = _SHA256(prior + data[start : start + step]).digest()
        yield int.from_bytes(prior[:8], "big", signed=True)


def page_hashes(tokens: Sequence[int] | str, page_size: int) -> list[int]:
    """Every full page's block hash (the definition ``iter_page_hashes`` walks lazily)."""
    return list(iter_page_hashes(token_bytes(tokens), page_size))
