"""The emulated worker's tokenizer: deterministic, prefix-stable, no model files.

One token per word with its leading whitespace (as GPT-style tokenizers attach spaces);
words longer than 8 characters are cut every 8 characters. A token's id is the CRC-32 of its
text modulo Llama 3's vocabulary size, so the same text always gives the same ids on every
machine, and a prompt that extends another at a word boundary extends its token ids too
(what prefix caching needs).
Real tokenizers give ~4 characters a token on English; this one gives ~5-6. Clients that send
``input_ids`` bypass it entirely.
"""

from __future__ import annotations

import re
import zlib

from sim.tokens import VOCAB_SIZE

__all__ = ["FILLER_WORD", "decode_filler", "encode"]

_PIECE = re.compile(r"\s*\S{1,8}|\s+$")
FILLER_WORD = " tok{}"


def encode(text: str) -> list[int]:
    """Token ids of ``text``.

    >>> encode("You are helpful. Hi") == encode("You are helpful. Hi there")[:4]
    True
    """
    return [zlib.crc32(piece.encode()) % VOCAB_SIZE for piece in _PIECE.findall(text)]


def decode_filler(index: int) -> str:
    """Text of the ``index``-th generated token (the emulator generates filler words)."""
    return FILLER_WORD.format(index)
