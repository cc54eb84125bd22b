"""A simulated worker: the shared scheduler (``WorkerEngine``) driven by the event kernel."""

from __future__ import annotations

from collections.abc import Callable

from engine_ext.cache import RadixCache
from sim.engine import EngineRequest, Step, WorkerEngine
from sim.kernel import Environment
from sim.profiles import ServiceProfile

__all__ = ["SimWorker"]

Callback = Callable[[EngineRequest], None]


class SimWorker:
    """Runs one step at a time; each step lasts the profile's step time in simulated ms."""

    def __init__(
        self,
        env: Environment,
        url: str,
        profile: ServiceProfile,
        cache: RadixCache,
        on_first_token: Callback,
        on_finish: Callback,
        on_last_step: Callback | None = None,
        refresh_waiting: bool = True,
    ) -> None:
        self.env = env
        self.url = url
        self.profile = profile
        self.cache = cache
        self.engine = WorkerEngine(profile, cache, refresh_waiting)
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self._on_last_step = on_last_step
        self.steps = 0
        self.busy_ms = 0.0
        # Called after each batch is formed and after it finishes (cache changes: admissions
        # evict, completions insert); the KV-event feed publishes there (``sim.kv_feed``).
        self.on_step: Callable[[], None] | None = None

    def set_profile(self, profile: ServiceProfile) -> None:
        """Change speed from the next step on (drift: thermal throttling, a noisy neighbour)."""
        self.profile = self.engine.profile = profile

    def submit(self, request: EngineRequest) -> None:
        self.engine.submit(request, self.env.now_ms)
        self._kick()

    def _kick(self) -> None:
        if self.engine.busy:
            return
        step = self.engine.plan_step(self.env.now_ms)
        if self.on_step is not None:
            self.on_step()
        if step is not None:
            self.steps += 1
            self.busy_ms += step.duration_ms
            self.env.schedule(step.duration_ms, self._step_done, step)

    def _step_done(self, step: Step) -> None:
        result = self.engine.finish_step(step, self.env.now_ms)
        if self.on_step is not None:
            self.on_step()
        for req in result.first_tokens:
            self._on_first_token(req)
        if self._on_last_step is not None:
            # One token left: the next decode step, planned below before anything that
            # arrives later, is the request's last (what a router sees as max - 1 tokens).
            for req in (*result.first_tokens, *step.decode):
                if req.generated == req.max_new_tokens - 1:
                    self._on_last_step(req)
        for req in result.finished:
            self._on_finish(req)
        self._kick()
