"""Prefix-index keys made of chained block hashes, so replicas can share what they route.

A replica cannot ship prompts to the others (no prompt text leaves the router). Instead each
prompt is cut into blocks of ``block_units`` units and every block gets a 32-bit digest of
the *whole prefix* up to its end, so two prompts share their first k digests exactly when
they share their first k blocks, up to a 2^-32 chance per sibling pair in the tree (the
index is positional, so only prompts with the same earlier blocks can collide, and a
collision only misjudges one cache estimate). The digest is computed vectorised (numpy):
each block's units are mixed with fixed pseudo-random odd weights into a 64-bit block hash,
and the prefix digest is the wrapping sum of block hashes times fixed per-position
multipliers, i.e. a polynomial hash of the prefix. The weights come from a fixed seed, so
every replica computes the same digests. Each digest becomes 2 characters (20 + 12 bits), so
digests form a string key the ordinary radix ``PrefixIndex`` matches; replicas send each
other the digests and all index the same keys. A trailing partial block is not indexed, so
matches are block-granular.

>>> keys = BlockKeys(block_units=4)
>>> a, b = keys.key("abcdefghXY"), keys.key("abcdefghZZ")
>>> len(a) // 2, a == b
(2, True)
>>> keys.units(len(a), total_units=10)
8
"""

from __future__ import annotations

import numpy as np

from engine_ext.cache.keys import Key

__all__ = ["CHARS_PER_BLOCK", "DIGEST_BYTES", "BlockKeys", "digests_to_key", "key_to_digests"]

CHARS_PER_BLOCK = 2
DIGEST_BYTES = 4  # wire format: the 32-bit prefix digest, big endian
_PLANE = 0x10000  # chunks land in planes 1-16: never surrogates


class BlockKeys:
    """Turns request keys into block-hash index keys and matched lengths back into units."""

    def __init__(self, block_units: int = 16) -> None:
        if block_units < 1:
            raise ValueError(f"block_units must be >= 1, got {block_units}")
        self.block_units = block_units
        self._unit_weights = _odd_weights(_UNIT_SEED, block_units)

    def digests(self, key: Key) -> bytes:
        """One 4-byte digest per full block of ``key`` (the wire format, big endian)."""
        return self._digests(key).astype(">u4").tobytes()

    def _digests(self, key: Key) -> np.ndarray:
        units = _units(key)
        blocks = len(units) // self.block_units
        if blocks == 0:
            return np.zeros(0, dtype=np.uint64)
        grid = units[: blocks * self.block_units].reshape(blocks, self.block_units)
        block_hash = (grid * self._unit_weights).sum(axis=1, dtype=np.uint64)
        prefix = np.cumsum(block_hash * _position_weights(blocks), dtype=np.uint64)
        return prefix >> np.uint64(32)

    def key(self, key: Key) -> str:
        return _digests_key(self._digests(key))

    def units(self, matched_key_chars: int, total_units: int) -> int:
        """Prompt units covered by a match of ``matched_key_chars`` index characters."""
        return min(total_units, matched_key_chars // CHARS_PER_BLOCK * self.block_units)

    def index_units(self, units: int) -> int:
        """Index characters that stand for ``units`` prompt units (for size caps)."""
        return max(1, units // self.block_units * CHARS_PER_BLOCK)


_UNIT_SEED, _POSITION_SEED = 0x6B76726F, 0x75746521  # fixed: every replica agrees
_positions = np.zeros(0, dtype=np.uint64)


def _odd_weights(seed: int, count: int) -> np.ndarray:
    weights = np.random.default_rng(seed).integers(0, 2**63, size=count, dtype=np.uint64)
    return weights * np.uint64(2) + np.uint64(1)


def _position_weights(count: int) -> np.ndarray:
    global _positions  # a cache of a pure function of the fixed seed, grown on demand
    if _positions.size < count:
        _positions = _odd_weights(_POSITION_SEED, max(count, 2 * _positions.size, 1024))
    return _positions[:count]


def _units(key: Key) -> np.ndarray:
    if isinstance(key, str):
        raw = np.frombuffer(key.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        return raw.astype(np.uint64)
    return np.fromiter(key, dtype=np.int64).astype(np.uint64)


def _digests_key(digests: np.ndarray) -> str:
    """Two characters per 32-bit digest: its top 20 and low 12 bits, each in planes 1-16."""
    if not digests.size:
        return ""
    pairs = np.empty((digests.size, 2), dtype="<u4")
    pairs[:, 0] = (digests >> 12) + _PLANE
    pairs[:, 1] = (digests & 0xFFF) + _PLANE
    return pairs.tobytes().decode("utf-32-le")


def digests_to_key(digests: bytes) -> str:
    """The index key of received digests (the same string ``BlockKeys.key`` builds).

    Vectorised: every replica runs this for every other replica's routing event.
    """
    whole = len(digests) - len(digests) % DIGEST_BYTES
    return _digests_key(np.frombuffer(digests[:whole], dtype=">u4").astype(np.uint64))


def key_to_digests(key: str) -> bytes:
    """Inverse of ``digests_to_key`` (a trailing odd character is ignored)."""
    if not key:
        return b""
    chars = np.frombuffer(key.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    pairs = chars[: len(chars) - len(chars) % CHARS_PER_BLOCK].reshape(-1, CHARS_PER_BLOCK)
    digests = ((pairs[:, 0] - _PLANE) << 12) | (pairs[:, 1] - _PLANE)
    return bytes(digests.astype(">u4").tobytes())
