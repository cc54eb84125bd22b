"""Robustness matrix: routing policies across workloads and loads, in the simulator.

A policy that wins on the paper's GSP setting may lose elsewhere. This matrix runs every
policy x eviction on eight workloads at four loads, three seeds each, 4 workers of profile
``llama3.1-8b-l40``, and gives each policy's latency over the best baseline's in every cell.
That profile is the one ``lbgr``'s constants come from, and the clients send each answer's
length as ``max_new_tokens``; ``--profile``, ``--speed`` (every worker that many times as fast)
and ``--output-hint none`` (no ``max_new_tokens``) run the same matrix off that prior;
``--workers`` on another fleet size (the same requests; the loads are that fleet's),
``--speed`` with one value per worker on a mixed fleet, and ``--window`` (the traces' later
requests) with other ``--seeds`` (the generated workloads') on what the matrix never ran.

**Workloads** (the request count of a workload is the same in every cell and in its
bisection): GSP in random and in grouped order (128 groups x 24 prompts); multi-turn chat,
200 clients with 2/4/6/8 turns whose user messages are the ShareGPT sample's 1,000 prompts
(no prompt reused); long documents (synthetic ``longdoc``, 256 documents x 8 questions,
random order: the LooGLE sample has 5 documents, too few for a fleet); the first 2,000
requests of the Mooncake synthetic trace; the first 3,000 of the Azure 2023 code and
conversation traces; and the cyclic worst case sized to the *fleet's* cache (the cycle is
1.1x the workers' capacity, so a router that spreads it evenly leaves every worker a cycle
1.1x its own cache: LRU's worst case on each), three passes. Data files are read from
``../shared/data``; a workload whose file is missing is skipped and listed in the JSON.

**Load.** Each workload has one knob that scales its arrival times: the Poisson rate
(``--rate``) of the generated workloads, the replay speed (``--time-scale``) of the traces,
whose offered rate is ``time_scale x requests / (last - first arrival)`` of the unscaled
trace. A seed's requests at any rate are the same requests, only closer together. Loads are
50%, 75%, 90% and 110% of the saturation rate of ``round_robin`` + ``lru`` on the same
workload and seed (so a cell's seeds run at their own rates; the table gives the mean).

**Saturation.** A run *keeps up* when its completed throughput, ``completed / (last
completion - first arrival)``, is at least ``SUSTAINED`` (95%) of its offered rate,
``served / (last arrival - first arrival)`` (requests the engine rejected as too large are
in neither). An overloaded queue grows until the arrivals stop and then drains, so the ratio
falls to about 1/load; a stable one ends one latency after the last arrival. The saturation
rate is the highest offered rate at which ``round_robin`` + ``lru`` keeps up, found by
bisection: from the workload's starting rate, double (or halve) until a rate keeps up and
twice it does not, then bisect geometrically until ``hi / lo <= 1 + TOLERANCE`` (1%; 5% with
``--quick``). The saturation is ``lo``, the highest probed rate that kept up; ``hi`` did not.
Simulations are deterministic, so the result is a function of the workload and the seed.
It is the saturation *of a run of this length*: a latency of 5% of the run's span at its
end fails it, so it lies at or just below the rate where the queue starts to grow.

**Multi-turn is closed-loop.** A turn is offered on a Poisson schedule but released only
once the client's previous answer is back. Its load is the schedule's rate: the offered load
of the other workloads. At most 200 turns (one per client) are in flight, so above
saturation the loop holds turns back instead of queueing them: latency (counted from the
release, the client's clock) stays bounded, and the shortfall shows as throughput below the
offered rate and as ``client_delay_s``, the mean time a turn waited past its scheduled offer.

**Policies**: ``round_robin``, ``power_of_two``, ``cache_aware`` (sglang-router's defaults,
preset ``sglang``), ``lbgr`` (kvroute's default) and ``lbgr_paper`` (the paper's LBGR);
``--policies`` adds any entry of ``SPECS``, any registered policy by name,
``LABEL=POLICY:KEY=VALUE,...`` (values parsed as JSON, else strings) or
``LABEL=POLICY:{JSON object}``. The baselines are round_robin, power_of_two and cache_aware
and always run. In a
cell (workload, load, eviction) the *best baseline* of a metric is the baseline with the
lowest mean over seeds; a policy's ratio is its mean over that baseline's mean, and the
spread is the min-max over seeds of the same ratio seed by seed (same requests, same rate).

**No-wait floor.** Per workload and seed, a lower bound of every request's latency that no
router, eviction policy or load can beat: the request alone on an idle worker, its prompt
cached as far as any request that may run before it left it in a cache (unlimited capacity,
perfect affinity). A worker admits its requests first come, first served in the order they
arrive (no hold queue here), so in an open-loop workload that is the requests earlier in
arrival order; a closed loop can reorder releases, so there it is every request but the
request's own later turns. Its latency is then ``request_overhead_ms`` + prefill of the
uncached part (one step per chunk; SGLang recomputes the last token of a fully cached
prompt) + one batch-1 decode step per further output token (``latency_floor_ms``). Every
served request's latency is at least its floor, so the k-th smallest latency is at least
the k-th smallest floor, and the p50 (any percentile: it interpolates between two adjacent
order statistics) of the latencies is at least the p50 of the floors over the same
requests; the means over seeds keep the order. Requests too large for a worker are served
by no router and left out of both.

**Targets** of the new default routing configuration (``--candidate``, default ``lbgr``),
each checked on the cells' means over seeds, every check a row in the JSON's ``targets``:
(A) at loads 50/75/90%, p50 and p95 at most 1.05x the best baseline's, every workload and
eviction; (B) at 75/90% on the prefix-sharing workloads, p50 at most 1/1.3 of cache_aware +
lru's on the same workload and load, each eviction (a cell whose floor p50 is already above
that is *infeasible*); (C) at 110%, throughput at least 95% of the best baseline's and p50
no worse than round_robin's (same eviction). A missing cell, a missing value or a zero
reference is a check not met, with its reason. Every other policy run beside the baselines
is scored the same way, one line each (``targets_by_policy``), so a variant is compared with
the default in the same run.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import DATA_DIR, REPO_ROOT, base_parser, parallel_map, ratio, write_json

from engine_ext.cache.keys import common_prefix_length
from router_service.routing import make_policy, policy_names
from sim.cluster import OUTPUT_HINTS, ClusterConfig, SimRun, simulate
from sim.engine import generated_tokens
from sim.profiles import PROFILES, ServiceProfile, get_profile
from sim.report import markdown_table, percentile_s, summarize
from sim.workloads import (
    CyclicConfig,
    CyclicWorkload,
    GSPConfig,
    GSPWorkload,
    LongDocConfig,
    LongDocWorkload,
    MultiTurnConfig,
    MultiTurnWorkload,
    Workload,
    WorkloadRequest,
    load_azure,
    load_mooncake,
)

NAME = "robustness"
PROFILE = "llama3.1-8b-l40"
WORKERS = 4
SEEDS = (0, 1, 2)
LOADS = (0.5, 0.75, 0.9, 1.1)
EVICTIONS = ("lru", "rlt")
QUICK_SEEDS = (0,)
QUICK_LOADS = (0.5, 1.1)
SUSTAINED = 0.95  # completed throughput / offered rate at which a run keeps up
TOLERANCE = 0.01  # bisection stops at hi / lo <= 1 + TOLERANCE
QUICK_TOLERANCE = 0.05
MAX_PROBES = 40
FIGURE = REPO_ROOT / "docs" / "figures" / "robustness.png"


def fleet_label(profile: str, speed: float, output_hint: str, speeds: Sequence[float] = ()) -> str:
    """``llama3.1-8b-l40``, or ``llama3.1-8b-l40 at 0.5x speed, max_new_tokens none``, or
    ``llama3.1-8b-l40 at 1/1/0.5/0.5x speed`` (one speed per worker)."""
    if speeds:
        label = f"{profile} at {'/'.join(f'{v:g}' for v in speeds)}x speed"
    else:
        label = profile if speed == 1.0 else f"{profile} at {speed:g}x speed"
    return label if output_hint == "exact" else f"{label}, max_new_tokens {output_hint}"


# -- policies ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A routing configuration under a label: a registered policy and its parameters."""

    label: str
    policy: str
    params: tuple[tuple[str, Any], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "policy": self.policy, "params": dict(self.params)}


def spec(label: str, policy: str, **params: Any) -> PolicySpec:
    return PolicySpec(label, policy, tuple(sorted(params.items())))


BASELINES = (
    spec("round_robin", "round_robin"),
    spec("power_of_two", "power_of_two"),
    spec("cache_aware", "cache_aware", preset="sglang"),
)
SATURATION_POLICY = BASELINES[0]  # with lru
# Configurations --policies knows by label; a new one is one line here.
SPECS = {
    s.label: s
    for s in (
        *BASELINES,
        spec("lbgr", "lbgr"),
        spec("lbgr_linear", "lbgr", model="linear"),
        spec("cache_aware_paper", "cache_aware", preset="paper"),
    )
}
POLICIES = ("round_robin", "power_of_two", "cache_aware", "lbgr", "lbgr_paper")


def parse_policy(text: str) -> PolicySpec:
    """A label of ``SPECS``, a registered policy's name, or ``LABEL=POLICY:KEY=VALUE,...``;
    checked by building the policy once, so a bad one fails before any simulation."""
    if text in SPECS:
        found = SPECS[text]
    elif "=" in text:
        label, _, rest = text.partition("=")
        policy, _, pairs = rest.partition(":")
        params: dict[str, Any] = {}
        if pairs.startswith("{"):  # LABEL=POLICY:{"key": value, ...}, values of any JSON
            try:
                params = json.loads(pairs)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{text!r}: parameters are not a JSON object: {exc}") from None
            pairs = ""
        for pair in filter(None, pairs.split(",")):
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ValueError(f"{text!r}: expected KEY=VALUE, got {pair!r}")
            try:
                params[key] = json.loads(value)
            except json.JSONDecodeError:
                params[key] = value
        found = spec(label.strip(), policy.strip(), **params)
    elif text in policy_names():
        found = spec(text, text)
    else:
        known = sorted({*SPECS, *policy_names()})
        raise ValueError(
            f"unknown policy spec {text!r}; known: {', '.join(known)}, or LABEL=POLICY:K=V,..."
        )
    make_policy(found.policy, **dict(found.params))  # fails loudly, naming what is accepted
    return found


def policy_list(texts: Sequence[str]) -> list[PolicySpec]:
    """The baselines first (every cell needs them), then the rest in the order given."""
    specs = [parse_policy(t) for t in texts]
    out = [*BASELINES, *(s for s in specs if s not in BASELINES)]
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"policy labels must be unique, got {labels}")
    return out


# -- workloads ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    key: str
    title: str
    kind: str  # gsp, multiturn, longdoc, trace, azure, cyclic
    size: int  # groups' prompts, clients, documents, requests or cycles (see build)
    quick_size: int
    data: str | None = None  # file under the data directory
    order: str = "random"
    start_rps: float | None = None  # first bisection probe; None: the trace's own rate

    @property
    def knob(self) -> str:
        return "time_scale" if self.kind in ("trace", "azure") else "rate"


WORKLOADS = (
    WorkloadSpec("gsp_random", "GSP, random order", "gsp", 24, 8, start_rps=12.0),
    WorkloadSpec("gsp_grouped", "GSP, grouped order", "gsp", 24, 8, order="grouped", start_rps=12),
    WorkloadSpec(
        "multiturn",
        "multi-turn, ShareGPT prompts",
        "multiturn",
        200,
        64,
        data="mlenergy_ShareGPT_V3_filtered_1000.json",
        start_rps=8.0,
    ),
    WorkloadSpec("longdoc", "long documents (synthetic)", "longdoc", 256, 48, start_rps=8.0),
    WorkloadSpec(
        "mooncake", "Mooncake trace", "trace", 2000, 300, data="mooncake_synthetic_trace.jsonl"
    ),
    WorkloadSpec(
        "azure_code", "Azure code", "azure", 3000, 500, "azure2023_AzureLLMInferenceTrace_code.csv"
    ),
    WorkloadSpec(
        "azure_conv", "Azure conv", "azure", 3000, 500, "azure2023_AzureLLMInferenceTrace_conv.csv"
    ),
    WorkloadSpec("cyclic", "cyclic (LRU's worst case)", "cyclic", 3, 1, start_rps=16.0),
)
WORKLOAD_KEYS = tuple(w.key for w in WORKLOADS)


@dataclass(frozen=True, slots=True)
class Setting:
    """What every simulation of a workload shares: its size, seed, data directory and the
    fleet's service profile (``speed`` scales every time in it: 0.5 = half as fast; with
    ``speeds``, one per worker, ``speed`` is the fastest's, which the floor assumes)."""

    workload: WorkloadSpec
    seed: int
    quick: bool
    data_dir: str
    profile: str = PROFILE
    speed: float = 1.0
    output_hint: str = "exact"
    workers: int = WORKERS
    speeds: tuple[float, ...] = ()
    window: int = 0  # the traces replay requests window * size .. (window + 1) * size

    @property
    def service(self) -> ServiceProfile:
        base = get_profile(self.profile)
        return base if self.speed == 1.0 else base.scaled(self.speed)

    @property
    def size(self) -> int:
        return self.workload.quick_size if self.quick else self.workload.size

    @property
    def skip(self) -> int:
        """Requests of a trace left out before its window."""
        return self.window * self.size

    @property
    def path(self) -> str | None:
        return None if self.workload.data is None else str(Path(self.data_dir) / self.workload.data)


def build(setting: Setting, rate_rps: float) -> Workload:
    """The setting's requests at an offered rate (the rate, or the trace's time scale)."""
    w, n, seed = setting.workload, setting.size, setting.seed
    if w.kind == "gsp":
        groups = 32 if setting.quick else 128
        config = GSPConfig(groups, n, order=w.order, rate=rate_rps, seed=seed)
        return GSPWorkload(config)
    if w.kind == "multiturn":
        turns = MultiTurnConfig(n, rate=rate_rps, seed=seed, dataset=setting.path)
        return MultiTurnWorkload(turns)
    if w.kind == "longdoc":
        return LongDocWorkload(LongDocConfig(n, order=w.order, rate=rate_rps, seed=seed))
    if w.kind == "cyclic":
        capacity = setting.workers * setting.service.kv_capacity_tokens
        return CyclicWorkload(CyclicConfig(capacity, cycles=n, rate=rate_rps, seed=seed))
    scale = rate_rps / native_rps(setting)
    loader = load_mooncake if w.kind == "trace" else load_azure
    return loader(str(setting.path), time_scale=scale, limit=n, seed=seed, skip=setting.skip)


@functools.cache
def native_rps(setting: Setting) -> float:
    """A trace's offered rate at time scale 1: requests over its arrival span."""
    loader = load_mooncake if setting.workload.kind == "trace" else load_azure
    trace = loader(str(setting.path), limit=setting.size, seed=setting.seed, skip=setting.skip)
    return len(trace) / (max(r.arrival_ms for r in trace) / 1000.0)


# -- one simulation ----------------------------------------------------------------------------
def keeping_up(run: SimRun, workload: Workload) -> dict[str, Any]:
    """Offered rate, completed throughput, their ratio and the closed loop's hold-back."""
    scheduled = {r.rid: r.arrival_ms for r in workload}
    first, last = min(scheduled.values()), max(scheduled.values())
    served = [r for r in run.records if not r.failed]
    finished = [r.finished_ms for r in served if r.finished_ms is not None]
    offered = len(served) / ((last - first) / 1000.0)
    achieved = len(finished) / ((max(finished) - first) / 1000.0) if finished else 0.0
    held = [r.arrival_ms - scheduled[r.rid] for r in run.records]
    return {
        "offered_rps": offered,
        "completed_rps": achieved,
        "kept_up_ratio": achieved / offered,
        "kept_up": achieved >= SUSTAINED * offered,
        "client_delay_s": statistics.fmean(held) / 1000.0,
    }


def run_one(
    workload: Workload, policy: PolicySpec, eviction: str, setting: Setting
) -> dict[str, Any]:
    config = ClusterConfig(
        workers=setting.workers,
        policy=policy.policy,
        policy_params=dict(policy.params),
        eviction=eviction,
        profile=setting.profile,
        worker_speeds=list(setting.speeds) or [setting.speed] * setting.workers,
        output_hint=setting.output_hint,
        seed=setting.seed,
    )
    started = time.perf_counter()
    run = simulate(config, workload)
    summary = summarize(run)
    keys = ("p50_latency_s", "p95_latency_s", "p50_ttft_s", "throughput_rps", "hit_rate")
    return {
        "policy": policy.label,
        "eviction": eviction,
        "seed": setting.seed,
        "requests": len(workload),
        **{k: summary[k] for k in (*keys, "completed", "failed")},
        **keeping_up(run, workload),
        "wall_s": round(time.perf_counter() - started, 3),
    }


# -- saturation --------------------------------------------------------------------------------
def find_saturation(setting: Setting) -> dict[str, Any]:
    """Bisect the highest rate at which round_robin + lru keeps up (module docstring)."""
    tolerance = QUICK_TOLERANCE if setting.quick else TOLERANCE
    probes: list[dict[str, Any]] = []

    def keeps_up(rate: float) -> bool:
        if len(probes) >= MAX_PROBES:
            raise RuntimeError(f"{setting.workload.key}: no saturation in {MAX_PROBES} probes")
        row = run_one(build(setting, rate), SATURATION_POLICY, "lru", setting)
        probes.append({"rate_rps": rate, **row})
        return bool(row["kept_up"])

    start = setting.workload.start_rps or native_rps(setting)
    if keeps_up(start):
        lo = start
        while keeps_up(2 * lo):
            lo *= 2
        hi = 2 * lo
    else:
        hi = start
        while not keeps_up(hi / 2):
            hi /= 2
        lo = hi / 2
    while hi > lo * (1 + tolerance):
        mid = math.sqrt(lo * hi)
        if keeps_up(mid):
            lo = mid
        else:
            hi = mid
    at = next(p for p in probes if p["rate_rps"] == lo)
    knob = lo / native_rps(setting) if setting.workload.knob == "time_scale" else lo
    return {
        "workload": setting.workload.key,
        "seed": setting.seed,
        "saturation_rps": lo,
        "bracket_rps": [lo, hi],
        "tolerance": tolerance,
        "knob": setting.workload.knob,
        "knob_at_saturation": knob,
        "completed_rps_at_saturation": at["completed_rps"],
        "p50_latency_s_at_saturation": at["p50_latency_s"],
        "probes": probes,
    }


# -- the no-wait floor -------------------------------------------------------------------------
def latency_floor_ms(
    profile: ServiceProfile, prompt_tokens: int, cached_tokens: int, output_tokens: int
) -> float:
    """The latency of a request alone on an idle worker with ``cached_tokens`` of its prompt
    in the cache: a lower bound of its latency in any run where at most that much is cached.

    Prefill: at least one step per ``chunked_prefill_tokens`` new tokens. A step costs at
    least its own chunk's time (others in the batch only add), the chunks' compute adds up to
    the one-chunk formula's (the attention term counts the same token pairs), so the steps
    cost at least ``prefill_ms`` of one chunk plus a ``step_overhead_ms`` per further step.
    More cached tokens never cost more (``a + c x (prompt - new) >= 0``: the compute grows
    with the new tokens), so an upper bound of the cached part gives a lower bound.
    Decode: the first token comes out of the prefill, then one step per further token; a
    step costs at least its batch-1 time with the request's own context.

    >>> p = get_profile(PROFILE)
    >>> latency_floor_ms(p, 100, 0, 1) == p.request_overhead_ms + p.prefill_ms([(100, 0)])
    True
    """
    cached = min(cached_tokens, prompt_tokens - 1)  # SGLang recomputes the last token
    new = prompt_tokens - cached
    chunks = -(-new // profile.chunked_prefill_tokens)
    prefill = profile.prefill_ms([(new, cached)]) + (chunks - 1) * profile.step_overhead_ms
    decode = sum(profile.decode_ms(prompt_tokens + k, 1) for k in range(1, output_tokens))
    return profile.request_overhead_ms + prefill + decode


def shared_prefix_tokens(workload: Workload) -> list[int]:
    """Per request (workload order): the longest prefix of its prompt that a request which
    may run before it leaves in a cache (its prompt + all but the last output token, as the
    engine inserts it), at most the prompt less one token. Open loop: the requests earlier
    in arrival order (a worker admits in that order); closed loop (any ``after``): every
    request but itself and the turns that wait for it."""
    items = list(workload)
    paths = [r.prompt + generated_tokens(r.output, r.max_new_tokens - 1) for r in items]
    shared = [0] * len(items)
    if any(r.after is not None for r in items):
        order = sorted(range(len(items)), key=paths.__getitem__)
        keys = [paths[i] for i in order]
        position = {i: at for at, i in enumerate(order)}
        for i, skip in enumerate(_waiting_on(items)):
            found = _longest_prefix(keys, items[i].prompt, {position[j] for j in skip})
            shared[i] = min(found, len(items[i].prompt) - 1)
        return shared
    seen: list[str] = []  # sorted: the paths of the requests so far
    for i in sorted(range(len(items)), key=lambda i: items[i].arrival_ms):  # stable on ties
        shared[i] = min(_longest_prefix(seen, items[i].prompt), len(items[i].prompt) - 1)
        bisect.insort(seen, paths[i])
    return shared


def _longest_prefix(keys: Sequence[str], query: str, skip: set[int] | None = None) -> int:
    """The longest common prefix of ``query`` with any of the sorted ``keys`` but the
    positions in ``skip``: it is reached at the nearest key on either side of ``query``."""
    at = bisect.bisect_left(keys, query)
    best = 0
    for j, step in ((at - 1, -1), (at, 1)):
        while skip and j in skip:
            j += step
        if 0 <= j < len(keys):
            best = max(best, common_prefix_length(query, keys[j]))
    return best


def _waiting_on(items: Sequence[WorkloadRequest]) -> list[set[int]]:
    """Per request: itself and every request that waits for it, directly or not."""
    index = {r.rid: i for i, r in enumerate(items)}
    closure = [{i} for i in range(len(items))]
    for i in reversed(range(len(items))):  # a request names one that comes earlier
        after = items[i].after
        if after is not None:
            closure[index[after]] |= closure[i]
    return closure


def no_wait_floor(setting: Setting) -> dict[str, Any]:
    """The p50 and p95 over the setting's requests of ``latency_floor_ms``, each with its
    ``shared_prefix_tokens`` cached (the requests are the same at any rate)."""
    profile = setting.service
    workload = build(setting, setting.workload.start_rps or native_rps(setting))
    floors_ms, prompt, cached = [], 0, 0
    for r, shared in zip(workload, shared_prefix_tokens(workload), strict=True):
        if len(r.prompt) + r.max_new_tokens > profile.kv_capacity_tokens:
            continue  # rejected by every worker: in no run's latencies
        floors_ms.append(latency_floor_ms(profile, len(r.prompt), shared, r.max_new_tokens))
        prompt += len(r.prompt)
        cached += shared
    return {
        "workload": setting.workload.key,
        "seed": setting.seed,
        "requests": len(floors_ms),
        "too_large": len(workload) - len(floors_ms),
        "p50_floor_s": percentile_s(floors_ms, 50),
        "p95_floor_s": percentile_s(floors_ms, 95),
        "cached_fraction": cached / prompt if prompt else 0.0,
    }


def floor_means(floors: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per workload: the mean over seeds of the floor's p50, as the cells average theirs."""
    by: dict[str, list[float]] = {}
    for f in floors:
        if f["p50_floor_s"] is not None:
            by.setdefault(f["workload"], []).append(f["p50_floor_s"])
    return {workload: statistics.fmean(values) for workload, values in by.items()}


# -- the matrix --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Cell:
    setting: Setting
    load: float
    rate_rps: float
    policies: tuple[PolicySpec, ...]
    evictions: tuple[str, ...]


def run_cell(cell: Cell) -> list[dict[str, Any]]:
    """Every policy x eviction on one workload, seed and load (the workload built once)."""
    workload = build(cell.setting, cell.rate_rps)
    rows = []
    for eviction in cell.evictions:
        for policy in cell.policies:
            row = run_one(workload, policy, eviction, cell.setting)
            row.update(workload=cell.setting.workload.key, load=cell.load, rate_rps=cell.rate_rps)
            rows.append(row)
    return rows


METRICS = ("p50_latency_s", "p95_latency_s", "p50_ttft_s", "throughput_rps", "hit_rate")
RATIOS = {"p50": "p50_latency_s", "p95": "p95_latency_s", "ttft50": "p50_ttft_s"}


def aggregate(
    runs: Sequence[dict[str, Any]], labels: Sequence[str], baselines: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per (workload, load, eviction, policy): means, min-max over seeds, and the
    ratios to the best baseline (lowest mean of that metric among ``baselines``)."""
    groups: dict[tuple[str, float, str], dict[tuple[str, int], dict[str, Any]]] = {}
    for r in runs:
        key = (r["workload"], r["load"], r["eviction"])
        groups.setdefault(key, {})[(r["policy"], r["seed"])] = r
    cells = []
    for (workload, load, eviction), by in groups.items():
        seeds = sorted({seed for _, seed in by})
        mean = {
            (label, m): statistics.fmean(by[(label, s)][m] for s in seeds)
            for label in labels
            for m in METRICS
        }
        best = {
            short: min(baselines, key=lambda b, m=m: mean[(b, m)]) for short, m in RATIOS.items()
        }
        for label in labels:
            mine = [by[(label, s)] for s in seeds]
            cell: dict[str, Any] = {
                "workload": workload,
                "load": load,
                "eviction": eviction,
                "policy": label,
                "seeds": seeds,
                "rate_rps": statistics.fmean(r["rate_rps"] for r in mine),
                "failed": sum(r["failed"] for r in mine),
                "kept_up": all(r["kept_up"] for r in mine),
                "client_delay_s": statistics.fmean(r["client_delay_s"] for r in mine),
            }
            for m in METRICS:
                cell[m] = mean[(label, m)]
                cell[f"{m}_min"] = min(r[m] for r in mine)
                cell[f"{m}_max"] = max(r[m] for r in mine)
            for short, m in RATIOS.items():
                base = best[short]
                per_seed = [ratio(by[(label, s)][m], by[(base, s)][m]) for s in seeds]
                cell[f"{short}_best_baseline"] = base
                cell[f"{short}_ratio"] = ratio(mean[(label, m)], mean[(base, m)])
                cell[f"{short}_ratio_min"] = min(
                    (x for x in per_seed if x is not None), default=None
                )
                cell[f"{short}_ratio_max"] = max(
                    (x for x in per_seed if x is not None), default=None
                )
            cells.append(cell)
    return cells


# -- targets -----------------------------------------------------------------------------------
CANDIDATE = "lbgr"
PREFIX_SHARING = ("gsp_random", "gsp_grouped", "multiturn", "longdoc", "mooncake")
A_LOADS, A_SLACK = (0.5, 0.75, 0.9), 1.05  # p50 and p95 <= 1.05x the best baseline's
B_LOADS, B_SPEEDUP = (0.75, 0.9), 1.3  # p50 <= cache_aware + lru's / 1.3
C_LOAD, C_THROUGHPUT = 1.1, 0.95  # throughput >= 0.95x the best baseline's; p50 <= rr's
TARGETS = {
    "A": f"p50 and p95 <= {A_SLACK}x the best baseline's at loads 50/75/90%",
    "B": f"p50 <= cache_aware+lru's / {B_SPEEDUP} at 75/90% on " + ", ".join(PREFIX_SHARING),
    "C": f"throughput >= {C_THROUGHPUT}x the best baseline's and p50 <= round_robin's at 110%",
}
FLOOR_SLACK_S = 1e-6  # the runs' percentiles are rounded to the microsecond

Where = tuple[str, float, str]  # workload, load, eviction
Find = Callable[[str, float, str, str], dict[str, Any] | None]


def target_checks(
    cells: Sequence[dict[str, Any]],
    candidate: str,
    workloads: Sequence[str],
    evictions: Sequence[str],
    floors_s: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Every check of targets A, B and C (module docstring) for ``candidate``, one row each,
    over ``workloads`` x ``evictions`` x the target's loads, whether the cell ran or not.
    ``floors_s``: the no-wait floor p50 per workload, to tell the infeasible B cells."""
    index = {(c["workload"], round(c["load"], 9), c["eviction"], c["policy"]): c for c in cells}

    def find(workload: str, load: float, eviction: str, policy: str) -> dict[str, Any] | None:
        return index.get((workload, round(load, 9), eviction, policy))

    rows: list[dict[str, Any]] = []
    grid = [(w, e) for w in workloads for e in evictions]
    for w, e in grid:
        rows += [row for load in A_LOADS for row in _target_a(find, candidate, (w, load, e))]
    for w, e in grid:
        if w in PREFIX_SHARING:
            floor = None if floors_s is None else floors_s.get(w)
            rows += [_target_b(find, candidate, (w, load, e), floor) for load in B_LOADS]
    for w, e in grid:
        rows += _target_c(find, candidate, (w, C_LOAD, e))
    return rows


def _check(
    target: str,
    check: str,
    where: Where,
    value: float | None,
    threshold: float | None,
    reference: str | None,
    at_least: bool = False,
    reason: str | None = None,
) -> dict[str, Any]:
    """One row: met only with a value, a threshold and no reason against it."""
    if reason is None and value is None:
        reason = f"no {check}"
    if reason is None and threshold is None:
        reason = "no threshold"
    met = False
    if reason is None and value is not None and threshold is not None:
        met = value >= threshold if at_least else value <= threshold
    workload, load, eviction = where
    return {
        "target": target,
        "check": check,
        "workload": workload,
        "load": load,
        "eviction": eviction,
        "value": value,
        "threshold": threshold,
        "reference": reference,
        "met": met,
        "missing": False,
        "reason": reason,
    }


def _missing(target: str, check: str, where: Where, policy: str) -> dict[str, Any]:
    row = _check(target, check, where, None, None, None, reason=f"no {policy} cell in this run")
    row["missing"] = True
    return row


def _target_a(find: Find, candidate: str, where: Where) -> list[dict[str, Any]]:
    mine = find(*where, candidate)
    rows = []
    for short in ("p50", "p95"):
        check = f"{short} / best baseline's"
        if mine is None:
            rows.append(_missing("A", check, where, candidate))
            continue
        best = mine[f"{short}_best_baseline"]
        value = mine[f"{short}_ratio"]
        reason = None if value is not None else f"no ratio: {best}'s {short} is 0 or missing"
        rows.append(_check("A", check, where, value, A_SLACK, best, reason=reason))
    return rows


def _target_b(find: Find, candidate: str, where: Where, floor_s: float | None) -> dict[str, Any]:
    workload, load, _ = where
    mine, cache_aware = find(*where, candidate), find(workload, load, "lru", "cache_aware")
    if mine is None or cache_aware is None:
        row = _missing("B", "p50 s", where, candidate if mine is None else "cache_aware+lru")
        row["floor_p50_s"] = floor_s
        return row
    reference = cache_aware["p50_latency_s"]
    threshold = reference / B_SPEEDUP if reference else None
    reason = None if threshold else "cache_aware+lru's p50 is 0 or missing"
    value = mine["p50_latency_s"]
    row = _check("B", "p50 s", where, value, threshold, "cache_aware+lru", reason=reason)
    row["floor_p50_s"] = floor_s
    if floor_s is not None and value is not None and floor_s > value + FLOOR_SLACK_S:
        row["met"] = False  # each latency is at least its floor: a bug in one of the two
        row["reason"] = f"floor p50 {floor_s:.3f} s above the measured {value:.3f} s"
    elif not row["met"] and threshold and floor_s is not None and floor_s > threshold:
        row["reason"] = (
            f"infeasible (floor p50 {floor_s:.3f} s > cache_aware/{B_SPEEDUP} = {threshold:.3f} s)"
        )
    return row


def _target_c(find: Find, candidate: str, where: Where) -> list[dict[str, Any]]:
    mine = find(*where, candidate)
    bases = {b.label: find(*where, b.label) for b in BASELINES}
    absent = [label for label, cell in bases.items() if cell is None]
    if mine is None or absent:
        policy = candidate if mine is None else " and ".join(absent)
        checks = ("throughput req/s", "p50 s vs round_robin")
        return [_missing("C", check, where, policy) for check in checks]
    present = {label: cell for label, cell in bases.items() if cell is not None}
    best = max(present, key=lambda label: present[label]["throughput_rps"])
    threshold = C_THROUGHPUT * present[best]["throughput_rps"]
    reason = None if threshold > 0 else "the baselines' throughput is 0"
    value = mine["throughput_rps"]
    throughput = _check("C", "throughput req/s", where, value, threshold, best, True, reason)
    reference = present["round_robin"]["p50_latency_s"]
    reason = None if reference else "round_robin's p50 is 0 or missing"
    value = mine["p50_latency_s"]
    p50 = _check("C", "p50 s vs round_robin", where, value, reference, "round_robin", reason=reason)
    return [throughput, p50]


def target_summary(checks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per target: checks and cells (workload, load, eviction: all its checks) met."""
    out = []
    for target in TARGETS:
        mine = [c for c in checks if c["target"] == target]
        cells: dict[Where, bool] = {}
        for c in mine:
            where = (c["workload"], c["load"], c["eviction"])
            cells[where] = cells.get(where, True) and c["met"]
        out.append(
            {
                "target": target,
                "definition": TARGETS[target],
                "checks": len(mine),
                "checks_met": sum(c["met"] for c in mine),
                "cells": len(cells),
                "cells_met": sum(cells.values()),
                "missing": sum(c["missing"] for c in mine),
                "infeasible": sum(str(c["reason"]).startswith("infeasible") for c in mine),
            }
        )
    return out


# -- output ------------------------------------------------------------------------------------
def saturation_rows(
    saturation: Sequence[dict[str, Any]],
    workloads: Sequence[WorkloadSpec],
    floors_s: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Per workload: the saturation rate of every seed, their mean, what it means, and the
    no-wait floor's p50 (mean over seeds)."""
    rows = []
    for w in workloads:
        mine = [s for s in saturation if s["workload"] == w.key]
        if not mine:
            continue
        rates = [s["saturation_rps"] for s in mine]
        knobs = [s["knob_at_saturation"] for s in mine]
        rows.append(
            {
                "workload": w.key,
                "title": w.title,
                "requests": mine[0]["probes"][0]["requests"],
                "knob": w.knob,
                "per_seed_rps": rates,
                "per_seed_text": ", ".join(
                    f"{s['saturation_rps']:.2f} (<{s['bracket_rps'][1]:.2f})" for s in mine
                ),
                "mean_rps": statistics.fmean(rates),
                "mean_knob": statistics.fmean(knobs),
                "completed_rps": statistics.fmean(s["completed_rps_at_saturation"] for s in mine),
                "p50_latency_s": statistics.fmean(s["p50_latency_s_at_saturation"] for s in mine),
                "probes": sum(len(s["probes"]) for s in mine),
                "floor_p50_s": None if floors_s is None else floors_s.get(w.key),
            }
        )
    return rows


SATURATION_COLUMNS = (
    ("workload", "workload", "{}"),
    ("requests", "requests", "{}"),
    ("knob", "knob", "{}"),
    ("saturation per seed, req/s (first rate that did not keep up)", "per_seed_text", "{}"),
    ("mean req/s", "mean_rps", "{:.2f}"),
    ("mean knob", "mean_knob", "{:.3g}"),
    ("completed req/s there", "completed_rps", "{:.2f}"),
    ("rr+lru p50 there (s)", "p50_latency_s", "{:.2f}"),
    ("no-wait floor p50 (s)", "floor_p50_s", "{:.3f}"),
    ("probes", "probes", "{}"),
)


def spread_text(cell: dict[str, Any], short: str) -> str:
    value, lo, hi = (cell[f"{short}_ratio{x}"] for x in ("", "_min", "_max"))
    if value is None:
        return "n/a"
    if len(cell["seeds"]) == 1 or lo is None or hi is None:
        return f"{value:.2f}x"
    return f"{value:.2f}x ({lo:.2f}-{hi:.2f})"


def ratio_rows(cells: Sequence[dict[str, Any]], labels: Sequence[str]) -> list[dict[str, Any]]:
    """One line per (workload, load, eviction): each policy's p50 and p95 over the best
    baseline's (mean over seeds, min-max over seeds)."""
    lines: dict[tuple[str, float, str], dict[str, Any]] = {}
    for c in cells:
        key = (c["workload"], c["load"], c["eviction"])
        line = lines.setdefault(
            key,
            {"workload": key[0], "load": f"{key[1]:.0%}", "eviction": key[2]},
        )
        if c["policy"] == c["p50_best_baseline"]:
            line["best"] = f"{c['policy']} {c['p50_latency_s']:.2f} s"
        if c["policy"] == c["p95_best_baseline"]:
            line["best95"] = f"{c['policy']} {c['p95_latency_s']:.2f} s"
        line[c["policy"]] = f"{spread_text(c, 'p50')} / {spread_text(c, 'p95')}"
    return list(lines.values())


def ratio_columns(labels: Sequence[str]) -> list[tuple[str, str, str]]:
    return [
        ("workload", "workload", "{}"),
        ("load", "load", "{}"),
        ("eviction", "eviction", "{}"),
        ("best baseline p50", "best", "{}"),
        ("best baseline p95", "best95", "{}"),
        *((f"{label}: p50 / p95 vs best", label, "{}") for label in labels),
    ]


def heatmap(
    cells: Sequence[dict[str, Any]],
    rows: Sequence[tuple[str, float]],
    columns: Sequence[tuple[str, str]],
    path: Path,
    title: str,
) -> None:
    """Rows workload x load, columns policy x eviction, colour log2 of the p50 ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.full((len(rows), len(columns)), np.nan)
    for c in cells:
        if c["p50_ratio"] is not None:
            at = rows.index((c["workload"], c["load"])), columns.index((c["policy"], c["eviction"]))
            grid[at] = c["p50_ratio"]
    fig, ax = plt.subplots(figsize=(1.2 * len(columns) + 3.0, 0.3 * len(rows) + 2.0))
    image = ax.imshow(np.log2(grid), cmap="RdYlGn_r", vmin=-2, vmax=2, aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        if not np.isnan(value):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(columns)), [f"{p}\n{e}" for p, e in columns], fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{w} {load:.0%}" for w, load in rows], fontsize=8)
    ax.xaxis.tick_top()
    for i in range(1, len(rows)):
        if rows[i][0] != rows[i - 1][0]:
            ax.axhline(i - 0.5, color="k", lw=0.8)
    for j in range(1, len(columns)):
        if columns[j][1] != columns[j - 1][1]:
            ax.axvline(j - 0.5, color="k", lw=1.5)
    bar = fig.colorbar(image, ax=ax, shrink=0.6, ticks=[-2, -1, 0, 1, 2])
    bar.ax.set_yticklabels(["<=0.25x", "0.5x", "1x", "2x", ">=4x"])
    bar.set_label("p50 latency / best baseline's (mean over seeds)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


TARGET_COLUMNS = (
    ("target", "target", "{}"),
    ("check", "check", "{}"),
    ("workload", "workload", "{}"),
    ("load", "load", "{:.0%}"),
    ("eviction", "eviction", "{}"),
    ("value", "value", "{:.3g}"),
    ("threshold", "threshold", "{:.3g}"),
    ("reference", "reference", "{}"),
    ("floor p50 (s)", "floor_p50_s", "{:.3f}"),
    ("why not met", "reason", "{}"),
)


def print_targets(candidate: str, checks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A summary line per target and the failing checks (those without a cell counted only);
    returns the summary."""
    summary = target_summary(checks)
    print(f"### Targets for {candidate} (cell means over seeds)\n")
    for t in summary:
        infeasible = f"; {t['infeasible']} infeasible by the floor" if t["infeasible"] else ""
        missing = f"; {t['missing']} checks without a cell" if t["missing"] else ""
        print(
            f"- **{t['target']}** ({t['definition']}): met in {t['cells_met']} of {t['cells']} "
            f"cells ({t['checks_met']} of {t['checks']} checks{infeasible}{missing})"
        )
    failing = [c for c in checks if not c["met"] and not c["missing"]]
    if failing:
        print(f"\nChecks not met ({len(failing)}):\n")
        print(markdown_table(failing, TARGET_COLUMNS))
    absent = sorted({(c["workload"], c["load"], c["eviction"]) for c in checks if c["missing"]})
    if absent:
        print(f"\nNot met for want of a cell (not run): {len(absent)} (workload, load, eviction)")
    print()
    return summary


# -- command line ------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = base_parser(NAME, __doc__)
    parser.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    parser.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        metavar="SPEC",
        help=f"labels of SPECS ({', '.join(SPECS)}), registered policies, or "
        "LABEL=POLICY:KEY=VALUE,... (the baselines always run)",
    )
    parser.add_argument(
        "--candidate",
        default=None,
        metavar="LABEL",
        help=f"the policy label the targets are checked for (default {CANDIDATE}; one of "
        "--policies)",
    )
    parser.add_argument("--workloads", nargs="+", choices=WORKLOAD_KEYS, default=None)
    parser.add_argument("--loads", type=float, nargs="+", default=None, help="of saturation")
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--evictions", nargs="+", choices=EVICTIONS, default=list(EVICTIONS))
    parser.add_argument("--data", type=Path, default=DATA_DIR, help="workload data directory")
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=PROFILE,
        help=f"the workers' service profile (default {PROFILE}, the one lbgr's constants "
        "come from)",
    )
    parser.add_argument(
        "--speed",
        type=float,
        nargs="+",
        default=[1.0],
        help="every worker runs this many times as fast as the profile (default 1); or one "
        "value per worker (--workers of them), a mixed fleet",
    )
    parser.add_argument(
        "--output-hint",
        choices=OUTPUT_HINTS,
        default="exact",
        help="what clients send as max_new_tokens: the answer's length (exact, the default: "
        "benchmark clients) or nothing (none: the router learns only the mean)",
    )
    parser.add_argument(
        "--figure",
        type=Path,
        default=None,
        help=f"heatmap PNG (default {FIGURE}; --quick: next to --out)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=WORKERS,
        help=f"workers in the fleet (default {WORKERS}); the cyclic workload is sized to it",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=0,
        help="the traces replay their WINDOW-th run of requests (0, the default: the first; "
        "1: the next as many); the generated workloads take other --seeds instead",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        args.policy_specs = tuple(policy_list(args.policies))
    except ValueError as exc:
        parser.error(f"--policies: {exc}")
    labels = [p.label for p in args.policy_specs]
    if args.candidate is not None and args.candidate not in labels:
        parser.error(f"--candidate {args.candidate!r} is not among --policies: {labels}")
    args.candidate = args.candidate or CANDIDATE
    args.seeds = tuple(args.seeds or (QUICK_SEEDS if args.quick else SEEDS))
    args.loads = tuple(args.loads or (QUICK_LOADS if args.quick else LOADS))
    if min(args.loads) <= 0 or args.jobs < 1 or args.workers < 1:
        parser.error("--loads must be > 0, --jobs >= 1 and --workers >= 1")
    for speed in args.speed:
        if not (speed > 0 and math.isfinite(speed)):
            parser.error(f"--speed must be a number > 0, got {speed}")
    if len(args.speed) not in (1, args.workers):
        parser.error(
            f"--speed takes one value, or one per worker ({args.workers}); got {len(args.speed)}"
        )
    args.speeds = tuple(args.speed) if len(set(args.speed)) > 1 else ()
    args.speed = max(args.speed)
    args.fleet = fleet_label(args.profile, args.speed, args.output_hint, args.speeds)
    if args.window < 0:
        parser.error(f"--window must be >= 0, got {args.window}")
    if args.window:
        args.fleet += f", trace window {args.window}"
    args.figure = args.figure or (args.out.with_suffix(".png") if args.quick else FIGURE)
    chosen = [w for w in WORKLOADS if args.workloads is None or w.key in args.workloads]
    args.chosen = [w.key for w in chosen]
    args.available = [w for w in chosen if w.data is None or (args.data / w.data).is_file()]
    args.skipped = [
        {"workload": w.key, "reason": f"data file {args.data / str(w.data)} not found"}
        for w in chosen
        if w not in args.available
    ]
    if not args.available:
        parser.error("no workload to run: " + "; ".join(s["reason"] for s in args.skipped))
    for w in args.available:
        if w.kind not in ("trace", "azure") or not args.window:
            continue
        setting = Setting(w, 0, args.quick, str(args.data), window=args.window)
        rows, size = trace_rows(Path(str(setting.path))), setting.size
        if setting.skip >= rows:
            parser.error(
                f"--window {args.window}: {w.key} has {rows} requests, {size} a window; its "
                f"last window is {(rows - 1) // size}"
            )
    return args


def trace_rows(path: Path) -> int:
    """Requests in a trace file: its non-empty lines, less a CSV's header."""
    with path.open() as lines:
        count = sum(1 for line in lines if line.strip())
    return count - 1 if path.suffix == ".csv" else count


@dataclass(slots=True)
class Results:
    saturation: list[dict[str, Any]]
    floors: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    cells: list[dict[str, Any]]
    wall_s: float
    saturation_s: float


def run_matrix(args: argparse.Namespace) -> Results:
    """Bisect every (workload, seed), then run every cell at its loads; the floors."""
    progress = not args.no_progress
    started = time.perf_counter()
    settings = [
        Setting(
            w,
            s,
            args.quick,
            str(args.data),
            args.profile,
            args.speed,
            args.output_hint,
            args.workers,
            args.speeds,
            args.window,
        )
        for w in args.available
        for s in args.seeds
    ]
    saturation = parallel_map(find_saturation, settings, args.jobs, "saturation", progress)
    saturation_s = time.perf_counter() - started
    floors = parallel_map(no_wait_floor, settings, args.jobs, "floors", progress)
    jobs = [
        Cell(setting, load, load * sat["saturation_rps"], args.policy_specs, tuple(args.evictions))
        for setting, sat in zip(settings, saturation, strict=True)
        for load in args.loads
    ]
    jobs.sort(key=lambda c: -c.load)  # overloaded cells run longest: start them first
    runs = [r for rows in parallel_map(run_cell, jobs, args.jobs, "cells", progress) for r in rows]
    labels = [p.label for p in args.policy_specs]
    cells = aggregate(runs, labels, [b.label for b in BASELINES])
    order = {w.key: i for i, w in enumerate(WORKLOADS)}
    cells.sort(
        key=lambda c: (order[c["workload"]], c["load"], c["eviction"], labels.index(c["policy"]))
    )
    wall_s = time.perf_counter() - started
    return Results(saturation, floors, runs, cells, wall_s, saturation_s)


def targets_verdict(args: argparse.Namespace, results: Results) -> dict[str, Any]:
    """The targets' checks for ``--candidate``, printed and as the JSON's ``targets``."""
    if args.candidate not in [p.label for p in args.policy_specs]:
        print(f"### Targets: {args.candidate} did not run (add it to --policies)\n")
        return {"candidate": args.candidate, "skipped": "not among the policies run"}
    floors_s = floor_means(results.floors)
    checks = target_checks(results.cells, args.candidate, args.chosen, args.evictions, floors_s)
    return {
        "candidate": args.candidate,
        "definitions": TARGETS,
        "thresholds": {
            "A": {"loads": A_LOADS, "max_ratio": A_SLACK},
            "B": {"loads": B_LOADS, "speedup": B_SPEEDUP, "workloads": PREFIX_SHARING},
            "C": {"load": C_LOAD, "min_throughput_ratio": C_THROUGHPUT},
        },
        "summary": print_targets(args.candidate, checks),
        "checks": checks,
    }


def targets_by_policy(args: argparse.Namespace, results: Results) -> dict[str, Any]:
    """Every non-baseline policy's cells met per target, side by side (the JSON's
    ``targets_by_policy``): a variant run beside the default is scored the same way."""
    baselines = {b.label for b in BASELINES}
    labels = [p.label for p in args.policy_specs if p.label not in baselines]
    floors_s = floor_means(results.floors)
    by_policy: dict[str, Any] = {}
    rows = []
    for label in labels:
        checks = target_checks(results.cells, label, args.chosen, args.evictions, floors_s)
        summary = target_summary(checks)
        by_policy[label] = summary
        row: dict[str, Any] = {"policy": label}
        for t in summary:
            row[t["target"]] = f"{t['cells_met']} of {t['cells']}"
        row["not met"] = sum(not c["met"] and not c["missing"] for c in checks)
        rows.append(row)
    if len(rows) > 1:
        columns = [("policy", "policy", "{}")]
        columns += [(f"{t} cells met", t, "{}") for t in TARGETS]
        columns.append(("checks not met", "not met", "{}"))
        print("### Targets for every policy run (cells met, as above)\n")
        print(markdown_table(rows, tuple(columns)) + "\n")
    return by_policy


def report(args: argparse.Namespace, results: Results) -> dict[str, Any]:
    """The markdown tables on stdout and the heatmap; returns the saturation summary and
    the targets' verdict."""
    labels = [p.label for p in args.policy_specs]
    sat_rows = saturation_rows(results.saturation, args.available, floor_means(results.floors))
    seeds = ", ".join(map(str, args.seeds))
    fleet = f"{args.workers} workers, {args.fleet}"
    print(f"## Robustness matrix ({fleet}, simulated; seeds {seeds})\n")
    print("### Saturation of round_robin + lru (highest rate keeping >= 95% throughput)\n")
    print(markdown_table(sat_rows, SATURATION_COLUMNS) + "\n")
    print("### p50 / p95 latency over the best baseline's, mean over seeds (min-max)\n")
    print(markdown_table(ratio_rows(results.cells, labels), ratio_columns(labels)) + "\n")
    targets = targets_verdict(args, results)
    by_policy = targets_by_policy(args, results)
    for skip in args.skipped:
        print(f"skipped {skip['workload']}: {skip['reason']}")
    probes = sum(len(s["probes"]) for s in results.saturation)
    print(
        f"{len(results.runs)} simulations + {probes} bisection probes in "
        f"{results.wall_s:.1f} s wall ({results.saturation_s:.1f} s bisecting, "
        f"{args.jobs} processes)"
    )
    rows = [(w.key, load) for w in args.available for load in args.loads]
    columns = [(label, e) for e in args.evictions for label in labels]
    title = (
        f"p50 latency / best baseline's (round_robin, power_of_two, cache_aware), {args.workers} "
        f"workers, {args.fleet}, seeds {seeds}\nload = fraction of round_robin+lru's saturation "
        "rate; baselines compared with the same eviction"
    )
    heatmap(results.cells, rows, columns, args.figure, title)
    return {"saturation_summary": sat_rows, "targets": targets, "targets_by_policy": by_policy}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for skip in args.skipped:
        print(f"skipping {skip['workload']}: {skip['reason']}", file=sys.stderr)
    results = run_matrix(args)
    summary = report(args, results)
    path = write_json(
        args.out,
        NAME,
        {
            "quick": args.quick,
            "profile": args.profile,
            "speed": args.speed,
            "speeds": list(args.speeds) or None,
            "window": args.window,
            "output_hint": args.output_hint,
            "workers": args.workers,
            "seeds": list(args.seeds),
            "loads": list(args.loads),
            "evictions": list(args.evictions),
            "policies": [p.as_dict() for p in args.policy_specs],
            "baselines": [b.label for b in BASELINES],
            "saturation_rule": {
                "policy": SATURATION_POLICY.label,
                "eviction": "lru",
                "sustained": SUSTAINED,
                "tolerance": QUICK_TOLERANCE if args.quick else TOLERANCE,
            },
            "workloads": [
                {"key": w.key, "title": w.title, "kind": w.kind, "knob": w.knob, "data": w.data}
                for w in args.available
            ],
            "skipped": args.skipped,
            "candidate": args.candidate,
            **summary,
            "saturation": results.saturation,
            "floors": results.floors,
            "cells": results.cells,
            "runs": results.runs,
            "figure": str(args.figure),
            "wall_s": round(results.wall_s, 2),
            "saturation_s": round(results.saturation_s, 2),
        },
    )
    sys.stdout.flush()
    print(f"figures written to {path} and {args.figure}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
