"""KV events vs the approximate index: index accuracy, routing, and what events cost.

Six parts, one JSON (``results/kv_events.json``) and markdown tables on stdout:

- **accuracy + routing, simulated** (``sim``): the same workload at the same load through a
  fleet routed by ``lbgr`` on the approximate index as it is (``learn_cache`` off), on the
  index discounted by what the workers' answers say survives (``lbgr``'s default,
  ``routing.survival``), then on the workers' KV events
  (``ClusterConfig.kv_events``: the reference cache's events, SGLang's wire format, the
  router's ``EventStream`` and ``BlockSets``), under LRU and RLT, for GSP and the Mooncake
  synthetic trace. Per run: the mean absolute error of the cached tokens the router
  predicted on the chosen worker against what the worker reported, the share over-predicted
  by more than a page, the hit rate, p50 and p95 latency. GSP runs four seeds, Mooncake four
  windows of the trace (three seeds each with RLT, whose random evictions make a window's
  figures move; ``sim_seeds``).
- **foresight** (``foresight``): the Mooncake runs with events again, each request's
  prediction set beside two references no router has: the worker's cache as the request
  reached it, and that cache once the requests queued ahead of it were admitted (replayed
  on a copy). Events copy a worker's cache, so no event-fed prediction does better than the
  first; where it over-predicts too, the index is not what is missing.
- **accuracy, emulated** (``emulated``): emulated SGLang workers (``kvroute emulate``, real
  processes) publish their events over ZMQ; the router's core subscribes with the service's
  ``KVEventFeed`` and routes GSP requests, then the densest 400 of the Mooncake trace (its
  answers' real lengths), as ``input_ids`` to them over HTTP. Each request is
  predicted both ways on the same decision (the approximate index is kept either way) and
  compared with the ``cached_tokens`` the worker reports.
- **cost** (``cost``): one process publishes 16 workers' events at their peak insert rate (a
  page stored and one evicted per prefilled page, prefill at the profile's speed), another
  absorbs them through the feed; its CPU time per event, and the most events per second it
  absorbs; the memory of the block sets per held page.
- **tokenization** (``tokenize``): ``--tokenizer``'s cost per request at 1k, 8k and 32k tokens
  (p50/p99), with a byte-level BPE of 32k tokens trained here on the ShareGPT sample (no
  model is downloaded), and how long the event loop is held with and without the thread.
- **hashing** (``hash``): a request's page hashes at 1k, 8k and 32k tokens, pages 1 and 16.

    python benchmarks/kv_events.py            # ~16 min on 2 cores
    python benchmarks/kv_events.py --quick    # ~3.5 min
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import DATA_DIR, base_parser, write_json
from engine_ext.cache.keys import key_to_ids
from router_service.kv_events import EventSource, KVEventFeed
from router_service.kv_wire import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    encode_seq,
)
from router_service.routing import Router, RouteRequest, WorkerStatus, make_policy
from router_service.routing.block_hash import iter_page_hashes, token_bytes
from router_service.routing.block_sets import BlockSets
from sim.cluster import ClusterConfig, RequestRecord, simulate
from sim.engine import EngineRequest
from sim.local_cluster import exit_on_sigterm, free_port, wait_healthy
from sim.profiles import get_profile
from sim.worker import SimWorker
from sim.workloads import GSPConfig, GSPWorkload, load_mooncake
from sim.workloads.base import Workload

PAGE = 16
SCALE = 4.0  # the emulated workers' time scale (ZMQ's hop then weighs 4x in emulated time)
TRACE = DATA_DIR / "mooncake_synthetic_trace.jsonl"
SHAREGPT = DATA_DIR / "mlenergy_ShareGPT_V3_filtered_1000.json"


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def accuracy(pairs: list[tuple[int, int]]) -> dict[str, float | None]:
    """(predicted, reported) cached tokens -> MAE and the share over-predicted by > a page."""
    if not pairs:
        return {"mae_tokens": None, "over_page_share": None, "requests": 0}
    errors = [p - r for p, r in pairs]
    return {
        "mae_tokens": sum(abs(e) for e in errors) / len(errors),
        "over_page_share": sum(e > PAGE for e in errors) / len(errors),
        "requests": len(errors),
    }


# -- simulated ------------------------------------------------------------------------------
# Each simulated row runs four times: GSP with seeds 0-3, the Mooncake trace on four windows
# of it (requests 0-999, 1000-1999, 2000-2999 and the last 993; with LRU a window is
# deterministic).
SIM_VARIANTS = (0, 1, 2, 3)


def sim_workload(name: str, quick: bool, variant: int = 0) -> Workload:
    if name == "gsp":
        groups, n = (32, 8) if quick else (128, 16)
        return GSPWorkload(GSPConfig(groups, n, rate=11.0 if quick else 12.0, seed=variant))
    limit = 300 if quick else 1000
    return load_mooncake(str(TRACE), time_scale=0.22, limit=limit, skip=variant * limit)


SIM_INDEXES = ("approximate", "approximate + survival", "events")


def sim_seeds(workload: str, eviction: str, variant: int) -> tuple[int, ...]:
    """The seeds of a run: one per GSP variant (its seed draws the workload too) and per
    Mooncake window with LRU (deterministic: a seed changes nothing); three per Mooncake
    window with RLT, whose draws decide which prefixes survive."""
    if workload == "mooncake" and eviction == "rlt":
        return (variant, variant + 10, variant + 20)
    return (variant,)


def sim_run(job: tuple[str, str, str, bool, int, int]) -> dict[str, Any]:
    workload_name, eviction, index, quick, variant, seed = job
    workload = sim_workload(workload_name, quick, variant)
    config = ClusterConfig(
        workers=4,
        eviction=eviction,
        page_size=PAGE,
        kv_events=index == "events",
        policy_params={"learn_cache": index != "approximate"},
        seed=seed,
    )
    started = time.perf_counter()
    run = simulate(config, workload)
    done = [r for r in run.records if r.finished_ms is not None and not r.failed]
    return {
        "workload": workload_name,
        "eviction": eviction,
        "index": index,
        "variant": variant,
        "seed": seed,
        **accuracy([(r.predicted_cached or 0, r.cached_tokens) for r in done]),
        "hit_rate": _hit_rate(done),
        "p50_ms": pct([r.latency_ms or 0.0 for r in done], 0.5),
        "p95_ms": pct([r.latency_ms or 0.0 for r in done], 0.95),
        "failed": sum(1 for r in run.records if r.failed),
        "wall_s": time.perf_counter() - started,
    }


def sim_summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, eviction and index: the mean over the variants, and the range."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["workload"], run["eviction"], run["index"]), []).append(run)
    rows = []
    for (workload, eviction, index), group in groups.items():
        row: dict[str, Any] = {"workload": workload, "eviction": eviction, "index": index}
        for key in ("mae_tokens", "over_page_share", "hit_rate", "p50_ms", "p95_ms"):
            values = [r[key] for r in group if r[key] is not None]
            row[key] = statistics.fmean(values) if values else None
            row[f"{key}_range"] = f"{min(values):.3g}-{max(values):.3g}" if values else "-"
        row["runs"] = len(group)
        rows.append(row)
    return rows


def _hit_rate(done: list[RequestRecord]) -> float:
    prompt = sum(r.prompt_tokens for r in done)
    return sum(r.cached_tokens for r in done) / prompt if prompt else 0.0


# -- foresight -----------------------------------------------------------------------------
# What an index could know at best: the events index copies a worker's cache, so no event-fed
# prediction beats the cache itself as the request reaches the worker. Two references per
# request, against the router's events prediction on the same run: the worker's cache then
# ("seen"), and that cache once the requests queued ahead of the request are admitted and
# have prefilled ("ahead": replayed on a copy, in queue order, up to the first that cannot be
# admitted before a request leaves; SGLang admits FCFS, so nothing behind it goes first).
def foresight(worker: SimWorker, req: EngineRequest) -> tuple[int, int]:
    """(seen, ahead) cached tokens of ``req`` on ``worker`` (``min(match, prompt - 1)``, as
    the worker counts them)."""
    engine = worker.engine
    seen = engine.cache.peek_prefix(req.prompt)
    cache = copy.deepcopy(engine.cache) if engine.waiting and seen else None
    for queued in engine.waiting if cache is not None else ():
        match = cache.match_prefix(queued.prompt)
        cache.lock(match.node)
        new = queued.prompt_tokens - min(match.length, queued.prompt_tokens - 1)
        if not cache.ensure_free(new + queued.max_new_tokens):
            break
        cache.reserve(queued.max_new_tokens)  # its prompt's KV enters the tree, locked
        cache.lock(cache.insert(queued.prompt).node)
    ahead = seen if cache is None else cache.peek_prefix(req.prompt)
    last = req.prompt_tokens - 1
    return min(seen, last), min(ahead, last)


def foresight_run(job: tuple[str, bool, int, int]) -> dict[str, Any]:
    """The Mooncake trace with events, one window: the router's prediction, the worker's cache
    as the request reached it, and that cache after the queue ahead: each against what the
    worker then found."""
    eviction, quick, variant, seed = job
    refs: dict[str, tuple[int, int]] = {}
    run = simulate(
        ClusterConfig(workers=4, eviction=eviction, page_size=PAGE, kv_events=True, seed=seed),
        sim_workload("mooncake", quick, variant),
        on_submit=lambda worker, req: refs.__setitem__(req.rid, foresight(worker, req)),
    )
    done = [r for r in run.records if r.finished_ms is not None and not r.failed]
    row: dict[str, Any] = {"eviction": eviction, "variant": variant, "seed": seed}
    for name, predicted in (
        ("events", lambda r: r.predicted_cached or 0),
        ("seen", lambda r: refs[r.rid][0]),
        ("ahead", lambda r: refs[r.rid][1]),
    ):
        pairs = [(predicted(r), r.cached_tokens) for r in done]
        row[name] = {
            **accuracy(pairs),
            "under_page_share": sum(rep - p > PAGE for p, rep in pairs) / len(pairs),
        }
    return row


# -- emulated -------------------------------------------------------------------------------
def emulated_workload(name: str, quick: bool) -> tuple[list[Any], int]:
    """The requests an emulated run replays, and its workers' KV capacity: GSP at 8 req/s on
    60k-token pools, or Mooncake's densest stretch (the start of its last window, requests
    3,000 on, at time scale 0.22 as in ``sim``) on the L40 profile's pools, without the few
    prompts too large for one."""
    if name == "gsp":
        groups, n = (16, 8) if quick else (48, 12)
        return list(GSPWorkload(GSPConfig(groups, n, rate=8.0, seed=1))), 60_000
    capacity = get_profile("llama3.1-8b-l40").kv_capacity_tokens
    trace = load_mooncake(str(TRACE), time_scale=0.22, limit=100 if quick else 400, skip=3000)
    return [r for r in trace if len(r.prompt) + r.max_new_tokens <= capacity], capacity


async def emulated(eviction: str, quick: bool, workload_name: str = "gsp") -> dict[str, Any]:
    """Four emulated workers over real ZMQ; the router's core routes and predicts."""
    import aiohttp

    workers, procs, feed_sources = [], [], {}
    workload, capacity = emulated_workload(workload_name, quick)
    for _ in range(4):
        port, events, replay = free_port(), free_port(), free_port()
        kv = json.dumps(
            {
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{events}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            }
        )
        cmd = [sys.executable, "-m", "kvroute", "emulate", "--port", str(port)]
        cmd += ["--eviction", eviction, "--page-size", str(PAGE), "--time-scale", str(SCALE)]
        cmd += ["--capacity-tokens", str(capacity), "--kv-events-config", kv]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}"
        workers.append(url)
        feed_sources[url] = EventSource(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")
    try:
        for url, proc in zip(workers, procs, strict=True):
            await asyncio.to_thread(wait_healthy, url, 90.0, proc)
        blocks = BlockSets()
        router = Router(make_policy("lbgr"), blocks=blocks, time_scale=SCALE)
        info = aiohttp.ClientSession()  # the feed reads each worker's chunk size, as the service's
        feed = KVEventFeed(blocks, lambda: time.monotonic() * 1000.0, session=lambda: info)
        for url, source in feed_sources.items():
            feed.add(url, source)
        feed.start()
        deadline = time.monotonic() + 10
        while any(
            blocks.workers[u].status != "live" or blocks.workers[u].chunk_tokens is None
            for u in workers
        ):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        exact, approx, fell_back = [], [], []
        statuses = [WorkerStatus(u) for u in workers]
        async with aiohttp.ClientSession() as session:

            async def one(item: Any) -> None:
                now = time.monotonic() * 1000.0
                out = item.max_new_tokens if workload_name == "mooncake" else 1
                request = RouteRequest(item.rid, item.prompt, len(item.prompt), out, tokens=True)
                _, guessed = router.index.match(router.index_key(request))
                decision = router.route(request, statuses, now)
                chosen = decision.chosen
                predicted = decision.candidate(chosen).cached or 0
                body = {
                    "input_ids": key_to_ids(item.prompt),
                    "sampling_params": {"max_new_tokens": out},
                }
                async with session.post(f"{chosen}/generate", json=body) as resp:
                    meta = (await resp.json())["meta_info"]
                reported = int(meta["cached_tokens"])
                source = (decision.cache_sources or {}).get(chosen)
                (exact if source == "events" else fell_back).append((predicted, reported))
                approx.append((min(guessed.get(chosen, 0), request.units), reported))
                router.complete(decision, _ok(), time.monotonic() * 1000.0)

            start = time.monotonic()
            tasks = []
            for item in workload:
                wait = start + item.arrival_ms / 1000.0 / SCALE - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(one(item)))
            await asyncio.gather(*tasks)
        status = feed.status()
        if os.environ.get("KV_DEBUG"):
            print(json.dumps(status, indent=0), file=sys.stderr)
            probe = workload[-1]
            print(blocks.match("dbg", probe.prompt, workers), len(blocks.holders), file=sys.stderr)
        await feed.stop()
        await info.close()
        return {
            "workload": workload_name,
            "eviction": eviction,
            "events": accuracy(exact),  # requests whose worker was read from its events
            "fell_back": accuracy(fell_back),  # before a worker's first store named its pages
            "approximate": accuracy(approx),  # every request, as the approximate index guessed
            "batches": sum(s["applied"] for s in status.values()),
            "lost": sum(s["lost"] for s in status.values()),
        }
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def _ok() -> Any:
    from router_service.routing import Outcome

    return Outcome(True, 1.0, 1.0)


# -- cost -----------------------------------------------------------------------------------
def peak_rate_pages_per_s() -> float:
    """One worker's peak insert rate in pages: prefill at the profile's speed, all uncached."""
    profile = get_profile("llama3.1-8b-l40")
    tokens_per_s = 1000.0 / profile.prefill_ms_per_token
    return tokens_per_s / PAGE


def publisher_main(ports: list[int], batches_per_s: float, pages: int, seconds: float) -> None:
    """Child process: each port publishes stores and removals of ``pages`` pages a batch."""
    import zmq

    ctx = zmq.Context()
    socks = []
    for port in ports:
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 1_000_000)
        sock.bind(f"tcp://127.0.0.1:{port}")
        socks.append(sock)
    time.sleep(1.0)  # the subscribers connect
    print("publishing", flush=True)
    rng = random.Random(0)
    held: list[list[int]] = [[] for _ in ports]
    seqs = [0] * len(ports)
    interval = 1.0 / batches_per_s if batches_per_s > 0 else 0.0
    end = time.monotonic() + seconds
    tick = time.monotonic()
    while time.monotonic() < end:
        for i, sock in enumerate(socks):
            new = [rng.getrandbits(63) for _ in range(pages)]
            events: list[Any] = [BlockStored(new, None, [1] * (pages * PAGE), PAGE, None)]
            held[i] += new
            if len(held[i]) > 4 * pages:  # a full cache: one page out per page in
                events.append(BlockRemoved(held[i][:pages]))
                del held[i][:pages]
            payload = encode_batch(EventBatch(time.time(), events))
            sock.send_multipart([b"", encode_seq(seqs[i]), payload])
            seqs[i] += 1
        if interval:
            tick += interval
            time.sleep(max(0.0, tick - time.monotonic()))
    time.sleep(0.5)
    ctx.destroy(linger=1000)


async def absorb(workers: int, batches_per_s: float, pages: int, seconds: float) -> dict[str, Any]:
    ports = [free_port() for _ in range(workers)]
    blocks = BlockSets()
    feed = KVEventFeed(blocks, lambda: time.monotonic() * 1000.0)
    for i, port in enumerate(ports):
        feed.add(f"http://w{i}", EventSource(f"tcp://127.0.0.1:{port}"))
    feed.start()
    root = str(Path(__file__).resolve().parent.parent)
    code = (
        f"import sys; sys.path.insert(0, {root!r}); "
        "from benchmarks.kv_events import publisher_main; "
        f"publisher_main({ports!r}, {batches_per_s!r}, {pages!r}, {seconds!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    await asyncio.to_thread(proc.stdout.readline)  # it starts publishing now
    await asyncio.sleep(0.5)
    cpu0, wall0 = time.process_time(), time.monotonic()
    applied0 = sum(s.counters.applied for s in feed.streams.values())
    blocks0 = sum(w.stored + w.removed for w in blocks.workers.values())
    await asyncio.sleep(seconds - 1.0)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    batches = sum(s.counters.applied for s in feed.streams.values()) - applied0
    events = sum(w.stored + w.removed for w in blocks.workers.values()) - blocks0
    await asyncio.to_thread(proc.wait, 30)
    lost = sum(s.counters.lost for s in feed.streams.values())
    await feed.stop()
    return {
        "workers": workers,
        "offered_batches_per_s": batches_per_s * workers if batches_per_s else None,
        "batches_per_s": batches / wall,
        "page_events_per_s": events / wall,
        "cpu_share_of_a_core": cpu / wall,
        "cpu_us_per_page_event": cpu / events * 1e6 if events else None,
        "cpu_us_per_batch": cpu / batches * 1e6 if batches else None,
        "lost": lost,
    }


def memory_per_block(workers: int = 16, per_worker: int = 20_000) -> dict[str, float]:
    """Bytes the block sets hold per (page, worker): half of each worker's pages shared."""
    rng = random.Random(0)
    shared = [rng.getrandbits(63) for _ in range(per_worker // 2)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    sets = BlockSets()
    for w in range(workers):
        url = f"http://w{w}"
        sets.add(url)
        own = [rng.getrandbits(63) for _ in range(per_worker // 2)]
        batch = EventBatch(0.0, [BlockStored(shared + own, None, [], PAGE, None)])
        sets.apply(url, batch, 0.0)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    held = sum(w.blocks for w in sets.workers.values())
    return {
        "workers": workers,
        "pages_held": held,
        "distinct_pages": len(sets.holders),
        "bytes_per_held_page": used / held,
        "bytes_per_distinct_page": used / len(sets.holders),
    }


# -- tokenization and hashing ---------------------------------------------------------------
def train_tokenizer(where: Path) -> Path:
    """A byte-level BPE of 32k tokens on the ShareGPT sample, as a HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts = []
    for row in json.loads(SHAREGPT.read_text()):
        texts += [turn["value"] for turn in row.get("conversations", [])]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32_000, special_tokens=["<s>", "</s>"])
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    where.mkdir(parents=True, exist_ok=True)
    tok.save(str(where / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (where / "tokenizer_config.json").write_text(json.dumps(config))
    return where


def tokenization(quick: bool) -> dict[str, Any]:
    from router_service.tokenizer import PromptTokenizer

    path = train_tokenizer(Path(os.environ.get("TMPDIR", "/tmp")) / "kvroute-bench-bpe32k")
    tok = PromptTokenizer(path)
    corpus = " ".join(
        turn["value"]
        for row in json.loads(SHAREGPT.read_text())
        for turn in row.get("conversations", [])
    )
    out: dict[str, Any] = {"vocab": tok.tokenizer.get_vocab_size()}
    reps = 10 if quick else 40
    for target in (1_000, 8_000, 32_000):
        text = _text_of(tok, corpus, target)
        times, chat = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            tok.encode_text(text)
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tok.encode_chat({"messages": [{"role": "user", "content": text}]})
            chat.append(time.perf_counter() - t0)
        out[f"{target // 1000}k"] = {
            "tokens": len(tok.encode_text(text)),
            "chars": len(text),
            "text_p50_ms": pct(times, 0.5) * 1000,  # type: ignore[operator]
            "text_p99_ms": pct(times, 0.99) * 1000,  # type: ignore[operator]
            "chat_p50_ms": pct(chat, 0.5) * 1000,  # type: ignore[operator]
            "chat_p99_ms": pct(chat, 0.99) * 1000,  # type: ignore[operator]
            "loop_held_inline_ms": asyncio.run(_loop_held(tok, text, threaded=False)),
            "loop_held_thread_ms": asyncio.run(_loop_held(tok, text, threaded=True)),
        }
    return out


def _text_of(tok: Any, corpus: str, tokens: int) -> str:
    chars = tokens * 4
    while len(tok.encode_text(corpus[:chars])) < tokens and chars < len(corpus):
        chars = int(chars * 1.1)
    return corpus[:chars]


async def _loop_held(tok: Any, text: str, threaded: bool) -> float:
    """The longest the event loop went without running a 1 ms ticker while encoding."""
    gaps: list[float] = []
    stop = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    for _ in range(5):
        if threaded:
            await asyncio.to_thread(tok.encode_text, text)
        else:
            tok.encode_text(text)
        await asyncio.sleep(0.005)
    stop = True
    await task
    return max(gaps) * 1000.0


def hashing() -> dict[str, Any]:
    rng = random.Random(0)
    out: dict[str, Any] = {}
    for tokens in (1_000, 8_000, 32_000):
        data = token_bytes([rng.randrange(128_256) for _ in range(tokens)])
        for page in (1, 16):
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in iter_page_hashes(data, page):
                    pass
                times.append(time.perf_counter() - t0)
            out[f"{tokens // 1000}k_page{page}_ms"] = statistics.median(times) * 1000
    return out


# -- report ---------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = []
        for col in cols:
            value = row.get(col)
            cells.append(f"{value:.3g}" if isinstance(value, float) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    exit_on_sigterm()  # so the finally blocks stop the workers this started
    parser = base_parser("kv_events", __doc__)
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["sim", "foresight", "emulated", "cost", "tokenize", "hash"],
        choices=["sim", "foresight", "emulated", "cost", "tokenize", "hash"],
        help="which parts to run (default: all)",
    )
    args = parser.parse_args()
    figures: dict[str, Any] = {"page_size": PAGE}
    if "hash" in args.parts:
        figures["hash"] = hashing()
        print(json.dumps(figures["hash"], indent=1))
    if "sim" in args.parts:
        jobs = [
            (w, e, index, args.quick, variant, seed)
            for w in ("gsp", "mooncake")
            if w == "gsp" or TRACE.exists()
            for e in ("lru", "rlt")
            for index in SIM_INDEXES
            for variant in SIM_VARIANTS
            for seed in sim_seeds(w, e, variant)
        ]
        figures["sim"] = [sim_run(job) for job in jobs]
        figures["sim_summary"] = sim_summary(figures["sim"])
        cols = ["workload", "eviction", "index", "mae_tokens", "over_page_share", "hit_rate"]
        print(table(figures["sim"], ["variant", "seed", *cols, "p50_ms", "p95_ms", "failed"]))
        ranged = [f"{c}_range" for c in ("over_page_share", "hit_rate", "p50_ms", "p95_ms")]
        print(table(figures["sim_summary"], [*cols, "p50_ms", "p95_ms", *ranged, "runs"]))
    if "foresight" in args.parts and TRACE.exists():
        figures["foresight"] = [
            foresight_run((e, args.quick, variant, seed))
            for e in ("lru", "rlt")
            for variant in SIM_VARIANTS
            for seed in sim_seeds("mooncake", e, variant)
        ]
        rows = [
            {**{c: r[c] for c in ("eviction", "variant", "seed")}, "index": k, **r[k]}
            for r in figures["foresight"]
            for k in ("events", "seen", "ahead")
        ]
        cols = ["eviction", "variant", "seed", "index", "mae_tokens", "over_page_share"]
        print(table(rows, [*cols, "under_page_share", "requests"]))
    if "emulated" in args.parts:
        figures["emulated"] = [
            asyncio.run(emulated(e, args.quick, w))
            for w in ("gsp", "mooncake")
            if w == "gsp" or TRACE.exists()
            for e in ("lru", "rlt")
        ]
        rows = [
            {"workload": r["workload"], "eviction": r["eviction"], "index": kind, **r[kind]}
            for r in figures["emulated"]
            for kind in ("approximate", "events", "fell_back")
        ]
        cols = ["workload", "eviction", "index", "mae_tokens", "over_page_share", "requests"]
        print(table(rows, cols))
    if "cost" in args.parts:
        peak = peak_rate_pages_per_s()
        seconds = 6.0 if args.quick else 15.0
        batches_per_s = 20.0  # SGLang publishes per scheduler step: a few tens a second
        pages = max(1, round(peak / batches_per_s))
        figures["cost"] = {
            "peak_pages_per_s_per_worker": peak,
            "at_peak": asyncio.run(absorb(16, batches_per_s, pages, seconds)),
            "flat_out": asyncio.run(absorb(16, 0.0, pages, seconds)),
            "memory": memory_per_block(),
        }
        print(json.dumps(figures["cost"], indent=1))
    if "tokenize" in args.parts and SHAREGPT.exists():
        figures["tokenize"] = tokenization(args.quick)
        print(json.dumps(figures["tokenize"], indent=1))
    print(f"wrote {write_json(args.out, 'kv_events', figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
