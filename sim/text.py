"""Prompt text for token ids: what a client that sends text (not ``input_ids``) would send.

SGLang's router (0.4.6, the paper's baseline, and the paper's LBGR built on it) matches
prefixes on the *characters* of the request text: ``cache_aware`` routes by cache when
``matched_chars / total_chars > cache_threshold``. Our workloads are token ids, so a
simulation that wants the router to see text needs the text those ids stand for. We cannot
decode them (the emulator's tokenizer hashes words into ids; Llama 3's files are not shipped
here), so each id is given a fixed character length drawn once from a measured distribution
and written as one word the emulator's tokenizer reads back as exactly one token:
``" " * (n - k) + body`` with ``k = min(n - 1, 8)`` letters or digits, ``n >= 2`` characters.

The distribution (``LLAMA3_VOCAB_CHARS``) is the decoded length of Llama 3's 128,000 regular
vocabulary entries (``tokenizer.model``, bytes decoded as UTF-8 with replacement): mean 5.77
characters, standard deviation 3.91; the 797 entries longer than 16 characters are three
buckets here, each at its mean length (as drawn, one-character entries made two: mean 5.81,
standard deviation 3.90). That is the right law for the paper's GSP, whose prompts are
uniformly random vocabulary ids decoded to text (``bench_serving.gen_prompt``). English text
tokenised by the same tokenizer is shorter per token and a little less spread (the 1,000
ShareGPT prompts of ``../shared/data``: mean 4.57, standard deviation 2.89); what decides
whether a prompt's shared prefix passes a threshold on the character share is the spread
relative to the mean, 0.68 against 0.63, so either law gives about the same pass rates. One-
character entries (3.7%) become two characters (a word needs its leading space).

The same text serves the simulator (the router's key: ``sim.cluster`` with
``prompt_format="text"``) and the emulated cluster (``sim.loadgen`` sends it; the emulated
worker tokenises it back into as many tokens, with the same prefix structure), so both see
the characters the other sees.

>>> from sim.tokens import ids_to_key
>>> text = render_text(ids_to_key([1, 2, 3]))
>>> len(render_text(ids_to_key([1, 2]))) < len(text) and text.startswith(" ")
True
"""

from __future__ import annotations

import functools

import numpy as np

from sim.tokens import VOCAB_SIZE

__all__ = ["LLAMA3_VOCAB_CHARS", "char_lengths", "render_text"]

# (characters, number of Llama 3 vocabulary entries of that decoded length); longer than 16
# in three buckets (17-31, 32-63, 64-128 characters) at their mean lengths.
LLAMA3_VOCAB_CHARS: tuple[tuple[int, int], ...] = (
    (1, 4731),
    (2, 10763),
    (3, 16596),
    (4, 19278),
    (5, 18071),
    (6, 15054),
    (7, 12650),
    (8, 9813),
    (9, 7276),
    (10, 5049),
    (11, 3373),
    (12, 2085),
    (13, 1160),
    (14, 710),
    (15, 355),
    (16, 239),
    (20, 566),
    (43, 100),
    (76, 131),
)
_SEED = 20260126  # fixes which id gets which length (the paper's arXiv date)
_ALPHABET = np.frombuffer(
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", np.uint8
)
_BODY_MAX = 8  # the emulator's tokenizer cuts words longer than 8 characters
_SURROGATE_START, _SURROGATE_SIZE = 0xD800, 0x800  # see engine_ext.cache.keys


@functools.cache
def char_lengths() -> np.ndarray:
    """Characters of every token id's text (``VOCAB_SIZE`` entries, each >= 2)."""
    lengths = np.array([n for n, _ in LLAMA3_VOCAB_CHARS])
    counts = np.array([c for _, c in LLAMA3_VOCAB_CHARS], dtype=float)
    gen = np.random.default_rng(_SEED)
    drawn = gen.choice(lengths, size=VOCAB_SIZE, p=counts / counts.sum())
    lengths_drawn: np.ndarray = np.maximum(drawn, 2).astype(np.int64)
    return lengths_drawn


@functools.cache
def _words() -> tuple[np.ndarray, np.ndarray]:
    """Every id's word, end to end in one ASCII buffer, and where each starts."""
    lengths = char_lengths()
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    blob = np.full(int(lengths.sum()), ord(" "), dtype=np.uint8)
    # The body: the last min(n - 1, 8) characters, base-62 digits (lowest first) of a scrambled
    # code per id, so that two ids' words rarely begin alike.
    code = np.random.default_rng(_SEED + 1).permutation(VOCAB_SIZE * 7)[:VOCAB_SIZE]
    body = np.minimum(lengths - 1, _BODY_MAX)
    ends = starts + lengths
    for j in range(_BODY_MAX):
        has = body > j
        code, digit = np.divmod(code, len(_ALPHABET))
        blob[(ends - body + j)[has]] = _ALPHABET[digit[has]]
    return blob, starts


def render_text(key: str) -> str:
    """The text of a token key (``sim.tokens``): one word per token, lengths as documented."""
    if not key:
        return ""
    blob, starts = _words()
    points = np.frombuffer(key.encode("utf-32-le"), dtype="<u4").astype(np.int64)
    ids = np.where(points >= _SURROGATE_START, points - _SURROGATE_SIZE, points)
    if ids.max() >= VOCAB_SIZE:
        raise ValueError(f"token ids must be < {VOCAB_SIZE} to be rendered as text")
    lengths = char_lengths()[ids]
    shift = np.repeat(starts[ids] - (np.cumsum(lengths) - lengths), lengths)
    text: str = blob[np.arange(len(shift)) + shift].tobytes().decode("ascii")
    return text
