"""An SGLang-like worker scheduler over the reference radix cache, with no clock of its own.

The simulator drives it in simulated time and the emulated worker in real time; both call
``plan_step`` to form the next batch (admitting requests, which matches, locks and reserves
KV) and ``finish_step`` when the step's duration has passed. Scheduling follows SGLang's
defaults: FCFS, prefill first (a decode step runs only when no prefill batch can be formed),
chunked prefill of at most ``chunked_prefill_tokens`` new tokens per step with one request
in chunked prefill at a time, continuous batching up to ``max_running_requests``. As in
SGLang 0.5.23, a chunked request's prefix enters the tree after each chunk (the scheduler's
``stash_chunked_request`` -> ``checkpoint_kv_cache``), so a request admitted later matches
it, and waiting requests fill what budget its last chunk leaves (``PrefillAdder`` goes on
through the queue after ``add_chunked_req``).

KV accounting follows SGLang's allocator: at admission a request reserves its uncached
prompt tokens plus ``max_new_tokens`` (evicting if needed; a request that does not fit even
after evicting all it could waits at the head of the queue, and evicts nothing meanwhile:
``RadixCache.ensure_free``); when its prefill completes the prompt enters the tree and
stays locked while it decodes; when it finishes, prompt + output enter the tree, the lock is
dropped and the reservation released.

While requests wait, SGLang 0.5.23 keeps their prefixes warm (``_touch_waiting_prefixes`` in
``managers/schedule_policy.py``, on by default: ``SGLANG_ENABLE_WAITING_PREFIX_REFRESH``):
every 32nd time the scheduler ranks its waiting queue under FCFS, it touches the cached
prefixes of the first 128 waiting requests, head last, so LRU evicts them in reverse
admission order (kvroute's RLT backend, which SGLang still runs as ``lru``, marks them). It
ranks the queue only when it may admit: not while its batch is full (a request refused for
KV, or the running limit reached) until a request leaves, unless a chunked prefill is in
progress. ``WorkerEngine`` does the same (``refresh_waiting``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from engine_ext.cache import RadixCache, RadixNode
from sim.profiles import ServiceProfile

__all__ = [
    "EngineRequest",
    "RequestTooLarge",
    "Step",
    "StepResult",
    "WorkerEngine",
    "generated_tokens",
]

WAITING_PREFIX_REFRESH_INTERVAL = 32  # SGLang 0.5.23's, in rankings of the waiting queue
WAITING_QUEUE_PREFIX_MATCH_MAX = 128  # waiting requests touched per refresh


class RequestTooLarge(ValueError):
    """The request can never fit in this worker's KV cache."""


@dataclass(slots=True, eq=False)
class EngineRequest:
    """A request inside one worker. ``prompt`` and ``output`` are token keys (see sim.tokens)."""

    rid: str
    prompt: str
    max_new_tokens: int
    output: str = ""
    cached: int = 0
    prefilled: int = 0
    in_tree: int = 0  # prompt tokens in the tree: the cached prefix, then each chunk's
    generated: int = 0
    reserved: int = 0
    lock_node: RadixNode | None = None
    submitted_ms: float = 0.0
    admitted_ms: float | None = None
    first_token_ms: float | None = None
    finished_ms: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


@dataclass(slots=True)
class Step:
    """One forward pass: a prefill batch (``chunks``) or a decode batch (``decode``)."""

    kind: str
    duration_ms: float
    chunks: list[tuple[EngineRequest, int]] = field(default_factory=list)
    decode: list[EngineRequest] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    first_tokens: list[EngineRequest]
    finished: list[EngineRequest]


class WorkerEngine:
    """Scheduler state: the waiting queue, the chunked request and the running batch."""

    def __init__(
        self, profile: ServiceProfile, cache: RadixCache, refresh_waiting: bool = True
    ) -> None:
        self.profile = profile
        self.cache = cache
        self.refresh_waiting = refresh_waiting
        self.waiting: deque[EngineRequest] = deque()
        self.chunked: EngineRequest | None = None
        self.running: list[EngineRequest] = []
        self.busy = False
        # SGLang's batch_is_full: it ranks its queue again only once a request leaves. Here it
        # gates the ranking only; admission is retried each step and finds what it found.
        self.full = False
        self.rankings = 0  # times the waiting queue was ranked (its prefixes touched each 32nd)

    @property
    def load(self) -> int:
        """Requests in the worker: waiting, in prefill or decoding."""
        return len(self.waiting) + len(self.running) + (self.chunked is not None)

    def submit(self, request: EngineRequest, now_ms: float) -> None:
        if request.prompt_tokens < 1:
            raise ValueError("a request needs at least one prompt token")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if request.prompt_tokens + request.max_new_tokens > self.cache.capacity_tokens:
            raise RequestTooLarge(
                f"request {request.rid} needs {request.prompt_tokens + request.max_new_tokens} "
                f"KV tokens; the cache holds {self.cache.capacity_tokens}"
            )
        request.submitted_ms = now_ms
        self.waiting.append(request)

    # -- batch formation -------------------------------------------------------------------
    def plan_step(self, now_ms: float) -> Step | None:
        """Form the next batch (prefill first); None when there is nothing to do."""
        step = self._plan_prefill(now_ms)
        if step is None and self.running:
            context = sum(r.prompt_tokens + r.generated for r in self.running)
            step = Step(
                "decode",
                self.profile.decode_ms(context, len(self.running)),
                decode=list(self.running),
            )
        self.busy = step is not None
        return step

    def _plan_prefill(self, now_ms: float) -> Step | None:
        budget = self.profile.chunked_prefill_tokens
        chunks: list[tuple[EngineRequest, int]] = []
        if self.chunked is not None:
            req = self.chunked
            n = min(req.prompt_tokens - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
        limit = self.profile.max_running_requests
        if not self.running:
            self.full = False
        may_admit = not (self.full or len(self.running) >= limit)
        if self.waiting and (self.chunked is not None or may_admit):
            self._rank_waiting()
        # A chunk that is not its request's last takes the whole budget: others join only
        # the last one (and a request cut here becomes the next chunked request).
        while budget > 0 and self.waiting:
            if len(self.running) + len(chunks) >= limit or not self._admit(self.waiting[0], now_ms):
                self.full = bool(chunks or self.running)
                break
            req = self.waiting.popleft()
            n = min(req.prompt_tokens - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
            if req.prefilled + n < req.prompt_tokens:
                self.chunked = req
        if not chunks:
            return None
        duration = self.profile.prefill_ms((n, req.prefilled) for req, n in chunks)
        return Step("prefill", duration, chunks=chunks)

    def _rank_waiting(self) -> None:
        """SGLang ranks the waiting queue (``calc_priority``): each 32nd time, it touches the
        first 128 waiting requests' cached prefixes, the head last (the most recent)."""
        if self.refresh_waiting and self.rankings % WAITING_PREFIX_REFRESH_INTERVAL == 0:
            for req in reversed(list(islice(self.waiting, WAITING_QUEUE_PREFIX_MATCH_MAX))):
                self.cache.match_prefix(req.prompt)
        self.rankings += 1

    def _admit(self, req: EngineRequest, now_ms: float) -> bool:
        """Match, lock and reserve KV for ``req``; False (and nothing held) if it must wait."""
        cache = self.cache
        match = cache.match_prefix(req.prompt)
        cache.lock(match.node)
        cached = min(match.length, req.prompt_tokens - 1)  # SGLang recomputes the last token
        need = req.prompt_tokens - cached + req.max_new_tokens
        if not cache.ensure_free(need):  # evicts nothing when it cannot make the room
            cache.unlock(match.node)
            return False
        cache.reserve(need)
        cache.stats.record(req.prompt_tokens, cached)
        req.cached = req.prefilled = req.in_tree = cached
        req.reserved = need
        req.lock_node = match.node
        req.admitted_ms = now_ms
        return True

    # -- step completion ---------------------------------------------------------------------
    def finish_step(self, step: Step, now_ms: float) -> StepResult:
        first: list[EngineRequest] = []
        finished: list[EngineRequest] = []
        for req, n in step.chunks:
            req.prefilled += n
            if req.prefilled < req.prompt_tokens:
                self._checkpoint(req)
                continue
            if self.chunked is req:
                self.chunked = None
            self._prefill_done(req, now_ms)
            first.append(req)
            if req.generated >= req.max_new_tokens:
                self._finish(req, now_ms)
                finished.append(req)
            else:
                self.running.append(req)
        for req in step.decode:
            req.generated += 1
            if req.generated >= req.max_new_tokens:
                self._finish(req, now_ms)
                finished.append(req)
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
            self.full = False  # a request left: SGLang admits again
        self.busy = False
        return StepResult(first, finished)

    def _checkpoint(self, req: EngineRequest) -> None:
        """A chunk of ``req``'s prompt is computed: the prefix so far enters the tree, locked
        by ``req`` (SGLang's ``checkpoint_kv_cache`` after each chunk), whole pages of it: the
        rest stays in ``req``'s reservation until a later chunk completes the page."""
        page = self.cache.page_size
        length = req.prefilled // page * page
        if length > req.in_tree:
            self._to_tree(req, length)

    def _prefill_done(self, req: EngineRequest, now_ms: float) -> None:
        """The prompt's KV now lives in the tree, locked while the request decodes."""
        self._to_tree(req, req.prompt_tokens)
        req.generated = 1  # the prefill pass yields the first token
        req.first_token_ms = now_ms

    def _to_tree(self, req: EngineRequest, length: int) -> None:
        """The first ``length`` prompt tokens enter the tree; ``req``'s lock moves to them
        and their KV leaves its reservation."""
        cache = self.cache
        inserted = cache.insert(req.prompt[:length])
        cache.lock(inserted.node)
        assert req.lock_node is not None
        cache.unlock(req.lock_node)
        req.lock_node = inserted.node
        moved = length - req.in_tree
        cache.release(moved)
        req.reserved -= moved
        req.in_tree = length

    def _finish(self, req: EngineRequest, now_ms: float) -> None:
        """Prompt + output (all but the last token, as SGLang) enter the tree; locks drop."""
        cache = self.cache
        produced = req.generated - 1
        if produced > 0:
            cache.insert(req.prompt + _output_tokens(req, produced))
        cache.release(req.reserved)
        req.reserved = 0
        assert req.lock_node is not None
        cache.unlock(req.lock_node)
        req.lock_node = None
        req.finished_ms = now_ms

    def flush(self) -> bool:
        """Empty the cache (SGLang refuses while requests are in the worker; so do we)."""
        if self.load or self.busy:
            return False
        self.cache.reset()
        return True


def _output_tokens(req: EngineRequest, count: int) -> str:
    return generated_tokens(req.output, count)


def generated_tokens(output: str, count: int) -> str:
    """The first ``count`` generated tokens: ``output`` (from the workload), then a filler.

    The filler (private-use code points, never produced by ``sim.tokens``) only matters when
    two requests have the same prompt, where a deterministic model would answer alike too.
    """
    if len(output) >= count:
        return output[:count]
    return output + "".join(chr(0xF0000 + i) for i in range(count - len(output)))
