"""The workers' exact cache contents, from their KV events: which pages each worker holds.

SGLang names every cached page by the hash of its whole prefix (``block_hash``), so the set
of hashes a worker holds is its radix tree: the tree holds a page only with every page
before it (eviction takes leaves), so a request's cached prefix on a worker is its run of
leading page hashes the worker holds. One dict maps each held hash to a bitmask of the
workers that hold it; a request is hashed once, lazily, and walked down for all workers at
once, stopping at the first page none of them holds.

A worker's set is a subset of its real cache at all times: it holds only blocks whose
``BlockStored`` was seen and whose ``BlockRemoved`` was not. A lost removal would break
that, so whoever feeds the events (``event_stream``) clears a worker's set whenever events
may have been lost and cannot be replayed; the set then grows again from the next event.
A subset under-predicts the cache; it never over-predicts it.

Events tell what a worker stored, not what it is about to store: a request routed a moment
ago is still queued or prefilling, and the next one with the same prefix would find nothing.
So the router also counts the pages of its own requests in flight on each worker (``open``
when it sends one, ``close`` when it ends, as SGLang's router and Dynamo's keep their active
sequences): a worker holds a page for matching if its events stored it or a request in flight
there carries it. Not all of them, when the worker's chunk size is known (``set_chunk``: its
``chunked_prefill_size``): SGLang stores a chunked prompt's prefix after each chunk, and a
request it admits beside the last chunk (or beside a prompt's only chunk) finds what the
earlier chunks stored, not that chunk. So a request in flight counts its pages only up to
where its last chunk starts; the rest counts once its events store it.

Whether a worker's events can be trusted now is its ``status``: ``connecting`` (no event
yet since its stream (re)started), ``live``, ``disconnected`` (the feed says so), or
``stale``: the worker answered a request that had to store at least a page (its first token,
or its answer), no event came since that request was sent, and none for ``stale_s`` after the
answer (its publisher stopped while its HTTP side still serves). The clock starts at the
answer: a request may wait in the worker's queue for minutes with nothing stored meanwhile.
``refresh`` applies that timer with the caller's clock. A worker whose events are not
``live`` is matched on the approximate index instead (``Router``), and says why.

>>> from router_service.kv_wire import BlockStored, EventBatch
>>> from router_service.routing.block_hash import page_hashes
>>> sets = BlockSets()
>>> sets.add("w1"); sets.add("w2")
>>> h = page_hashes([1, 2, 3, 4], page_size=2)
>>> sets.apply("w1", EventBatch(0.0, [BlockStored(h, None, [1, 2, 3, 4], 2, None)]), 0.0)
>>> sets.match("r", "\\x01\\x02\\x03\\x04\\x05", ["w1", "w2"])
({'w1': 4}, {'w2': 'events connecting: no event yet'})
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from router_service.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router_service.routing.block_hash import iter_page_hashes, token_bytes

__all__ = ["STATUSES", "BlockSets", "WorkerBlocks"]

STATUSES = ("connecting", "live", "stale", "disconnected")
_HASHED_REQUESTS = 1024  # requests whose page hashes are kept (the hold queue rematches)


@dataclass(slots=True)
class WorkerBlocks:
    """One worker's event-fed state and counters."""

    slot: int
    page_size: int | None = None
    chunk_tokens: int | None = None  # the worker's chunked_prefill_size, if known
    blocks: int = 0
    status: str = "connecting"
    reason: str | None = "no event yet"
    expect_since_ms: float | None = None
    last_batch_ms: float | None = None
    batches: int = 0
    stored: int = 0
    removed: int = 0
    orphans: int = 0  # stores whose parent page this worker did not hold (history missed)
    clears: int = 0  # the set was emptied: AllBlocksCleared, or events lost for good

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "reason": self.reason,
            "page_size": self.page_size,
            "chunk_tokens": self.chunk_tokens,
            "blocks": self.blocks,
            "batches": self.batches,
            "stored": self.stored,
            "removed": self.removed,
            "orphans": self.orphans,
            "clears": self.clears,
        }


class BlockSets:
    """Held page hashes of every worker with an event stream, and each stream's status."""

    def __init__(self, stale_s: float = 10.0) -> None:
        if stale_s <= 0:
            raise ValueError(f"stale_s must be > 0, got {stale_s}")
        self.stale_s = stale_s
        self.holders: dict[int, int] = {}  # page hash -> bitmask of worker slots
        self.workers: dict[str, WorkerBlocks] = {}
        self._hashed: OrderedDict[tuple[str, int], tuple[list[int], Iterator[int] | None]] = (
            OrderedDict()
        )
        # Pages of the router's requests in flight: hash -> bitmask of workers, the count per
        # (slot, hash), and each open request's (slot, hashes).
        self.pending: dict[int, int] = {}
        self._pending_counts: dict[tuple[int, int], int] = {}
        self._open: dict[str, tuple[int, list[int]]] = {}

    def __contains__(self, url: str) -> bool:
        return url in self.workers

    # -- membership ------------------------------------------------------------------------
    def add(self, url: str) -> None:
        """Track ``url``'s events (a worker with an event stream)."""
        if url in self.workers:
            raise KeyError(f"{url} already has an event stream")
        used = {w.slot for w in self.workers.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        self.workers[url] = WorkerBlocks(slot)

    def remove(self, url: str) -> None:
        """Forget ``url`` and its blocks (it left the fleet)."""
        if url in self.workers:
            self.clear(url, "removed")
            slot = self.workers[url].slot
            for request_id in [r for r, (s, _) in self._open.items() if s == slot]:
                self.close(request_id)
            del self.workers[url]

    def set_chunk(self, url: str, tokens: int | None) -> None:
        """``url`` prefills at most ``tokens`` new tokens a step (None: not known)."""
        worker = self.workers.get(url)
        if worker is not None:
            worker.chunk_tokens = tokens if tokens is None or tokens > 0 else None

    # -- the router's own requests in flight -------------------------------------------------
    def open(
        self, request_id: str, url: str, key: str | Sequence[int], cached_tokens: int = 0
    ) -> None:
        """``url`` was sent the token sequence ``key``, of which it was predicted to hold
        ``cached_tokens``: its pages count as held there until ``close`` (the worker stores
        them as it prefills), up to where its last chunk starts when the worker's chunk
        size is known."""
        worker = self.workers.get(url)
        if worker is None or worker.page_size is None or request_id in self._open:
            return
        pages: Iterable[int] = self._hashes(request_id, key, worker.page_size)
        chunk = worker.chunk_tokens
        if chunk is not None:
            cached = min(max(0, cached_tokens), len(key))
            chunks = max(1, -(-(len(key) - cached) // chunk))  # ceil; one for a cached prompt
            pages = islice(pages, (cached + (chunks - 1) * chunk) // worker.page_size)
        hashes = list(pages)
        slot, bit = worker.slot, 1 << worker.slot
        counts, pending = self._pending_counts, self.pending
        for block in hashes:
            count = counts.get((slot, block), 0)
            if not count:
                pending[block] = pending.get(block, 0) | bit
            counts[(slot, block)] = count + 1
        self._open[request_id] = (slot, hashes)

    def close(self, request_id: str) -> None:
        """The request ended: its pages are held if the worker's events say so."""
        entry = self._open.pop(request_id, None)
        if entry is None:
            return
        slot, hashes = entry
        counts, pending = self._pending_counts, self.pending
        for block in hashes:
            count = counts.pop((slot, block), 0) - 1
            if count > 0:
                counts[(slot, block)] = count
                continue
            left = pending.get(block, 0) & ~(1 << slot)
            if left:
                pending[block] = left
            else:
                pending.pop(block, None)

    # -- events ----------------------------------------------------------------------------
    def apply(self, url: str, batch: EventBatch, now_ms: float) -> None:
        """Apply one batch of ``url``'s events, in order; the stream is live after it."""
        worker = self.workers[url]
        bit = 1 << worker.slot
        holders = self.holders
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(worker, bit, event)
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    held = holders.get(block, 0)
                    if held & bit:
                        held &= ~bit
                        if held:
                            holders[block] = held
                        else:
                            del holders[block]
                        worker.blocks -= 1
                        worker.removed += 1
            elif isinstance(event, AllBlocksCleared):
                self.clear(url, "AllBlocksCleared")
        worker.batches += 1
        worker.last_batch_ms = now_ms
        worker.expect_since_ms = None
        worker.status, worker.reason = "live", None

    def _store(self, worker: WorkerBlocks, bit: int, event: BlockStored) -> None:
        holders = self.holders
        if event.block_size > 0:
            worker.page_size = event.block_size
        parent = event.parent_block_hash
        if parent is not None and not holders.get(parent, 0) & bit:
            worker.orphans += 1
        for block in event.block_hashes:
            held = holders.get(block, 0)
            if not held & bit:
                holders[block] = held | bit
                worker.blocks += 1
                worker.stored += 1

    def clear(self, url: str, reason: str) -> None:
        """Empty ``url``'s set (it starts again from the next event)."""
        worker = self.workers[url]
        worker.clears += 1
        if not worker.blocks:
            return
        bit = 1 << worker.slot
        holders = self.holders
        for block in [b for b, held in holders.items() if held & bit]:
            held = holders[block] & ~bit
            if held:
                holders[block] = held
            else:
                del holders[block]
        worker.blocks = 0

    # -- liveness --------------------------------------------------------------------------
    def set_status(self, url: str, status: str, reason: str | None = None) -> None:
        """The feed's view: ``connecting`` (stream (re)started), ``disconnected``."""
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}; known: {', '.join(STATUSES)}")
        worker = self.workers[url]
        worker.status, worker.reason = status, reason
        if status != "live":
            worker.expect_since_ms = None

    def expect(
        self, url: str, uncached_tokens: int, now_ms: float, sent_ms: float | None = None
    ) -> None:
        """``url`` prefilled a request that stored ``uncached_tokens`` (its answer says so;
        ``now_ms``: its first token, or its end): if that is a page or more, an event was
        due, unless a batch already came after the request was sent (``sent_ms``). The
        clock starts at the answer, not at the send: a request may wait in the worker's
        queue far longer than ``stale_s`` while the worker has nothing to store."""
        worker = self.workers.get(url)
        if worker is None or worker.status != "live" or worker.expect_since_ms is not None:
            return
        if uncached_tokens < (worker.page_size or 1):
            return
        last = worker.last_batch_ms
        if sent_ms is not None and last is not None and last >= sent_ms:
            return  # the publisher spoke after the request left: it is alive
        worker.expect_since_ms = now_ms

    def refresh(self, now_ms: float) -> list[str]:
        """Mark stale the live workers whose expected events are ``stale_s`` late; returns
        the workers that turned stale now."""
        late = []
        limit_ms = self.stale_s * 1000.0
        for url, worker in self.workers.items():
            since = worker.expect_since_ms
            if worker.status == "live" and since is not None and now_ms - since > limit_ms:
                worker.status = "stale"
                worker.reason = f"no event {self.stale_s:g} s after an answer that stored blocks"
                late.append(url)
        return late

    def fallback(self, url: str) -> str | None:
        """Why ``url``'s cache is not read from its events now (None: it is)."""
        worker = self.workers.get(url)
        if worker is None:
            return "no event stream"
        if worker.status != "live":
            return f"events {worker.status}" + (f": {worker.reason}" if worker.reason else "")
        if worker.page_size is None:  # pages cannot be hashed before a store names their size
            return "events live, no page stored yet (page size unknown)"
        return None

    # -- matching --------------------------------------------------------------------------
    def match(
        self, request_id: str, key: str | Sequence[int], workers: Iterable[str]
    ) -> tuple[dict[str, int], dict[str, str]]:
        """Cached tokens of the token sequence ``key`` on each of ``workers`` whose events
        are live, and the fallback reason of those with a stream that is not."""
        matched: dict[str, int] = {}
        reasons: dict[str, str] = {}
        groups: dict[int, list[tuple[str, int]]] = {}
        for url in workers:
            worker = self.workers.get(url)
            if worker is None:
                continue
            why = self.fallback(url)
            if why is not None or worker.page_size is None:
                reasons[url] = why or "no page size"
            else:
                groups.setdefault(worker.page_size, []).append((url, worker.slot))
        for page, members in groups.items():
            matched.update(self._walk(request_id, key, page, members))
        return matched, reasons

    def _walk(
        self, request_id: str, key: str | Sequence[int], page: int, members: list[tuple[str, int]]
    ) -> dict[str, int]:
        live = 0
        for _, slot in members:
            live |= 1 << slot
        depth = {}  # slot -> pages matched
        holders, pending = self.holders, self.pending
        pages = 0
        for block in self._hashes(request_id, key, page):
            held = (holders.get(block, 0) | pending.get(block, 0)) & live
            lost = live & ~held
            if lost:
                for _, slot in members:
                    if lost >> slot & 1:
                        depth[slot] = pages
                live = held
                if not live:
                    break
            pages += 1
        return {url: depth.get(slot, pages) * page for url, slot in members}

    def _hashes(self, request_id: str, key: str | Sequence[int], page: int) -> Iterator[int]:
        """The request's page hashes, computed once and only as far as a walk goes."""
        entry = self._hashed.get((request_id, page))
        if entry is None:
            entry = ([], iter_page_hashes(token_bytes(key), page))
            self._hashed[(request_id, page)] = entry
            if len(self._hashed) > _HASHED_REQUESTS:
                self._hashed.popitem(last=False)
        done, rest = entry
        yield from done
        if rest is None:
            return
        for block in rest:
            done.append(block)
            yield block
        self._hashed[(request_id, page)] = (done, None)

    # -- inspection ------------------------------------------------------------------------
    def status(self) -> dict[str, dict[str, Any]]:
        return {url: worker.to_dict() for url, worker in self.workers.items()}

    def check_invariants(self) -> None:
        """Recount each worker's blocks from the holder masks (tests)."""
        for url, worker in self.workers.items():
            bit = 1 << worker.slot
            counted = sum(1 for held in self.holders.values() if held & bit)
            if counted != worker.blocks:
                raise AssertionError(f"{url}: counted {counted} blocks != {worker.blocks}")
