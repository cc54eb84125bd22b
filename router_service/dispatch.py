"""The service's hold queue: requests wait in the router for a free slot on a worker.

``router_service.routing.hold_queue`` is the rule (affinity, shortest first, no
starvation); this module drives it from the event loop. A request awaits a future that a
pass of the queue resolves with its worker; passes run when a request arrives and when a
slot frees (its response ended, or with ``free_at_first_token`` its first streamed chunk
came back). The slot is taken from the moment the pass picks the request until then, so a
worker never has more than ``slots`` of this replica's requests in prefill.

A request whose client goes away while it waits leaves the queue; one already picked gives
its slot back. Slots count this replica's requests only: behind several replicas a worker
can have up to replicas x slots in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from router_service.routing import Held, HoldQueue, HoldSettings, Router, RouteRequest

__all__ = ["DispatchQueue"]


class DispatchQueue:
    def __init__(
        self,
        settings: HoldSettings,
        router: Router,
        healthy: Callable[[], list[str]],
        now_ms: Callable[[], float],
        metrics: Any = None,
    ) -> None:
        self.queue = HoldQueue(settings)
        self.settings = settings
        self.router = router
        self.healthy = healthy  # the workers a pass may pick, in order
        self.now_ms = now_ms
        self.metrics = metrics
        self.abandoned = 0  # clients that left while waiting

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def snapshot(self) -> dict[str, Any]:
        """What ``/health`` shows of the queue."""
        q = self.queue
        return {
            "slots": self.settings.slots,
            "waiting": len(q),
            "busy": dict(sorted(q.busy.items())),
            "dispatched": q.dispatched,
            "dispatched_after_max_wait": q.aged,
            "abandoned": self.abandoned,
        }

    async def wait_turn(self, request: RouteRequest, avoid: frozenset[str] = frozenset()) -> str:
        """Wait until a pass gives ``request`` a slot; returns the worker. Never picks a
        worker in ``avoid`` (it already failed this request)."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        held = Held(request, self.now_ms(), future, avoid=avoid)
        self.queue.push(held)
        started = time.perf_counter()
        self.pump()
        try:
            worker = await future
        except asyncio.CancelledError:
            if not self.queue.remove(held) and future.done() and not future.cancelled():
                self.release(future.result())  # picked, then abandoned: free the slot
            self.abandoned += 1
            raise
        finally:
            self._gauge()
        if self.metrics is not None:
            self.metrics.queue_wait_seconds.observe(time.perf_counter() - started)
        return worker

    def release(self, worker: str) -> None:
        """A slot on ``worker`` is free (its request ended, failed or started streaming)."""
        self.queue.release(worker)
        self.pump()

    def pump(self) -> None:
        """One pass: hand free slots to waiting requests."""
        if not len(self.queue):
            return
        router = self.router
        picks = self.queue.assign(
            self.healthy(), self.now_ms(), router.cached_by_worker, router.place
        )
        gave_back = False
        for held, worker in picks:
            if held.ticket.done():  # its client left during this pass: the slot goes back
                self.queue.release(worker)
                gave_back = True
            else:
                held.ticket.set_result(worker)
        self._gauge()
        if gave_back:
            self.pump()

    def forget_worker(self, url: str) -> None:
        """The worker left: its slots go, and requests bound to it are matched again."""
        self.queue.forget(url)
        self.pump()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_waiting.set(len(self.queue))
