"""How long what the router sent a worker stays in its cache, learned from the worker's answers.

The approximate prefix index records what the router *sent* each worker and never what the
worker evicted, so under cache pressure it believes in prefixes long gone: on GSP at 90% load
a third of lbgr's requests were sent after a prefix the worker no longer held. Every answer
says what the worker really found cached (SGLang's ``meta_info.cached_tokens``, OpenAI's
``usage.prompt_tokens_details.cached_tokens``), and the index knows when it last sent each
worker each part of the prompt. ``CacheSurvival`` learns, per worker, the share of the
index's belief that was really cached as a function of that age, and the router discounts the
index by it (``Router``): each matched segment counts at its survival, or whole while its
survival is at least the policy's ``whole_survival`` (``lbgr``: 0.2).

An LRU cache keeps an entry for about a fixed time after its last use (Che's approximation:
the cache's characteristic time, shorter the busier the worker); RLT evicts random leaf tails,
so its survival falls off gradually. Neither is assumed: the curve is learned per octave of age
(under 250 ms, 250-500 ms, ..., the last from about 18 hours on), each octave an
exponentially weighted share with a prior of trust (``prior`` pseudo-answers of "still
cached"), made non-increasing in age (an older entry cannot be likelier cached than a
younger one on the same worker). A worker whose answers never say what was cached keeps the
prior: the index as it is. The same learning runs in the simulator (the simulated engine's
cached tokens), the emulated cluster and the live router (the answers' counts).

>>> s = CacheSurvival()
>>> s.survival("w", 20_000.0)
1.0
>>> for _ in range(50):  # entries sent 20 s ago were gone; those sent 1 s ago were there
...     s.observe("w", [(0, 100, 1_000.0), (100, 400, 20_000.0)], cached_units=100)
>>> round(s.survival("w", 1_000.0), 2), round(s.survival("w", 20_000.0), 2)
(1.0, 0.04)
>>> round(s.expected("w", [(0, 100, 1_000.0), (100, 400, 20_000.0)]))
111
>>> round(s.survival("w", 60_000.0), 2)  # older than anything seen: no likelier cached
0.04

What an eviction costs is learned from the same answers: of the prompt units a worker had to
prefill (everything it did not find cached), the share the index believed it held, i.e.
entries it evicted and now prefills again (``refetch_share``). In a full cache every unit a
request inserts evicts one; this share is how much of what a worker evicts comes back, so an
insert there is expected to cost that share of its prefill again later (``lbgr``'s
``evict``, for a copy of what another worker holds). A cache with room, or one whose evicted
entries never return (GSP in grouped order: a finished group is not asked again), learns
about 0.

>>> s.observe_prefill("w", believed_units=4_000, cached_units=1_000, prompt_units=5_000)
>>> round(s.refetch_share("w"), 2)  # prefilled 4,000, of which 3,000 (less the slack) held
0.75
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["BASE_MS", "BUCKETS", "REFETCH_MEMORY", "CacheSurvival", "Segment", "age_bucket"]

# A matched part of a prompt on one worker: units [start, end) of the request's key, last sent
# to that worker age_ms ago (``PrefixIndex.match_segments``).
Segment = tuple[int, int, float]

BASE_MS = 250.0  # the first octave: ages under 250 ms
BUCKETS = 20  # 250 ms * 2**18 is about 18 h; older ages share the last octave
_TRUST = (1.0,) * BUCKETS
REFETCH_MEMORY = 0.99  # per answer: about the worker's last 100 answers weigh


def age_bucket(age_ms: float) -> int:
    """The octave of ``age_ms``: 0 below ``BASE_MS``, then one per doubling.

    >>> age_bucket(100.0), age_bucket(250.0), age_bucket(999.0), age_bucket(1e12)
    (0, 1, 2, 19)
    """
    if not age_ms >= BASE_MS:  # also NaN
        return 0
    return min(BUCKETS - 1, int(math.log2(age_ms / BASE_MS)) + 1)


class CacheSurvival:
    """Per worker: the share of the index's belief really cached, by age of the belief.

    ``memory`` is each octave's forgetting per answer that falls in it (0.97: about the last
    30 answers weigh), ``prior`` the pseudo-answers of "still cached" each octave starts with
    and never loses (so a first miss does not write a worker's cache off, and a curve that fell
    recovers once answers say the entries are there). It is also the curve's floor: answers
    that never find an octave's entries take it to ``prior / (prior + 1 / (1 - memory))``,
    2.9% with one pseudo-answer (with two, 5.7%: on a 13k-token prompt 770 tokens believed
    where none are, and ``lbgr`` prices a cached token's saving for every request its prefill
    would stall: ``docs/routing.md``, *What survives*).
    ``slack_tokens``: a prefix counts as found when the worker reports it short by at most
    this many tokens (the engine's page rounding and the last prompt token, which SGLang
    recomputes even on a full hit).
    """

    def __init__(self, memory: float = 0.97, prior: float = 1.0, slack_tokens: float = 16.0):
        if not 0.0 < memory < 1.0:
            raise ValueError(f"memory must be in (0, 1), got {memory!r}")
        if not prior > 0.0:
            raise ValueError(f"prior must be > 0, got {prior!r}")
        self.memory = memory
        self.prior = prior
        self.slack_tokens = slack_tokens
        self._found: dict[str, list[float]] = {}  # weighted units found, per octave
        self._seen: dict[str, list[float]] = {}  # weighted answers, per octave
        self._curve: dict[str, tuple[float, ...]] = {}
        self._answers: dict[str, int] = {}  # answers learned from, per worker
        self._refetched: dict[str, float] = {}  # weighted units prefilled again, per worker
        self._prefilled: dict[str, float] = {}  # weighted units prefilled, per worker

    @property
    def answers(self) -> int:
        """Answers learned from, all workers."""
        return sum(self._answers.values())

    def curve(self, worker: str) -> tuple[float, ...]:
        """Survival per octave of age (``age_bucket``), non-increasing; all 1.0 unlearned."""
        return self._curve.get(worker, _TRUST)

    def survival(self, worker: str, age_ms: float) -> float:
        return self.curve(worker)[age_bucket(age_ms)]

    def expected(
        self, worker: str, segments: Sequence[Segment], whole_from: float | None = None
    ) -> float:
        """Units of the matched ``segments`` expected still cached on ``worker``: each at its
        survival; with ``whole_from``, a segment whose survival is at least that counts whole
        (``Router``: a likely belief keeps the prefix's home)."""
        curve = self._curve.get(worker)
        if curve is None:
            return float(segments[-1][1]) if segments else 0.0
        total = 0.0
        for start, end, age in segments:
            share = curve[age_bucket(age)]
            if whole_from is not None and share >= whole_from:
                share = 1.0
            total += (end - start) * share
        return total

    def horizon_ms(self, worker: str) -> float | None:
        """The age from which less than half of the belief is cached (None: no such age
        learned): about an LRU cache's characteristic time."""
        for i, share in enumerate(self.curve(worker)):
            if share < 0.5:
                return 0.0 if i == 0 else BASE_MS * 2.0 ** (i - 1)
        return None

    def observe(
        self,
        worker: str,
        segments: Sequence[Segment],
        cached_units: float,
        tokens_per_unit: float = 1.0,
    ) -> None:
        """Learn from one answer: the index matched ``segments`` on ``worker``, which found
        ``cached_units`` of the prompt cached. Each segment counts as one answer in its
        octave, found in the share of it the worker's count covers."""
        if not segments or not math.isfinite(cached_units) or cached_units < 0:
            return
        found = self._found.get(worker)
        seen = self._seen.get(worker)
        if found is None or seen is None:
            found = self._found[worker] = [0.0] * BUCKETS
            seen = self._seen[worker] = [0.0] * BUCKETS
        reach = cached_units + self._slack_units(tokens_per_unit)
        keep = self.memory
        for start, end, age in segments:
            if end <= start:
                continue
            # Whole when the count falls short of the end by at most the slack; else the
            # share of the segment the count reaches.
            covered = 1.0 if reach >= end else max(0.0, (cached_units - start) / (end - start))
            b = age_bucket(age)
            found[b] = found[b] * keep + covered
            seen[b] = seen[b] * keep + 1.0
        self._answers[worker] = self._answers.get(worker, 0) + 1
        prior, shares, floor = self.prior, [], 1.0
        for f, n in zip(found, seen, strict=True):
            floor = min(floor, (f + prior) / (n + prior))
            shares.append(floor)
        self._curve[worker] = tuple(shares)

    def _slack_units(self, tokens_per_unit: float) -> float:
        """``slack_tokens`` in the request's units."""
        return self.slack_tokens / max(tokens_per_unit, 1e-9)

    def observe_prefill(
        self,
        worker: str,
        believed_units: float,
        cached_units: float,
        prompt_units: float,
        tokens_per_unit: float = 1.0,
    ) -> None:
        """Learn from one answer what ``worker``'s evictions cost: it found ``cached_units``
        of a prompt of ``prompt_units`` cached where the index believed ``believed_units``
        (the index's own belief, before any discount); what it prefilled of that belief it
        had evicted (short by the slack, as in ``observe``)."""
        values = (believed_units, cached_units, prompt_units)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            return
        refetched = max(0.0, believed_units - cached_units - self._slack_units(tokens_per_unit))
        prefilled = max(0.0, prompt_units - cached_units)
        keep = REFETCH_MEMORY
        self._refetched[worker] = self._refetched.get(worker, 0.0) * keep + refetched
        self._prefilled[worker] = self._prefilled.get(worker, 0.0) * keep + prefilled

    def refetch_share(self, worker: str) -> float:
        """Of what ``worker`` prefilled lately, the share it had cached before and evicted
        (0 until it has prefilled anything)."""
        prefilled = self._prefilled.get(worker, 0.0)
        if prefilled <= 0.0:
            return 0.0
        return min(1.0, self._refetched.get(worker, 0.0) / prefilled)

    def forget_worker(self, worker: str) -> None:
        tables = (self._found, self._seen, self._curve, self._answers)
        for table in (*tables, self._refetched, self._prefilled):
            table.pop(worker, None)

    def view(self, worker: str) -> dict[str, object]:
        """For operators (``GET /workers``): answers learned from, the curve, its horizon,
        and the share of its prefill that refetches what it evicted."""
        return {
            "answers": self._answers.get(worker, 0),
            "survival": [round(x, 3) for x in self.curve(worker)],
            "horizon_ms": self.horizon_ms(worker),
            "refetch_share": round(self.refetch_share(worker), 3),
        }
