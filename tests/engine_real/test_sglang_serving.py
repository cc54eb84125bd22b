"""Two real SGLang CPU workers (one ``rlt``, one SGLang's LRU) behind ``kvroute serve``.

The workers serve the tiny model (``scripts/make_tiny_model.py``) with a KV pool of
``POOL_TOKENS`` each, smaller than the prefixes the prefix-sharing traffic keeps in play, so
both caches evict for real. The tests run in definition order on one pair of workers (a start
costs ~30-60 s on two cores); the last one kills a worker.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from real_traffic import (
    Answer,
    gsp_bodies,
    hit_rate,
    metric_totals,
    openai_answers,
    post_json,
    send_all,
)

from kvroute.engine_launch import (
    EngineCluster,
    EngineSpec,
    engine_env,
    engine_python,
    model_dir,
    vocab_size,
)
from sim.workloads.gsp import GSPConfig, GSPWorkload

POOL_TOKENS = 2400
# 12 groups x 300 shared tokens: 3,600 prefix tokens, more than one worker's pool and less
# than two. A router that keeps groups together needs ~1,800 per worker; one that sprays
# them makes each worker hold all 3,600 and evict. Random order: round_robin's turns do not
# line up with the groups by chance.
GSP = GSPConfig(
    num_groups=12,
    prompts_per_group=8,
    prefix_ratio=0.9,
    total_lens=(330,),
    output_len=4,
    order="random",
    seed=0,
)
COUNTERS = (
    "sglang:prompt_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:evicted_tokens_total",
    "sglang:num_requests_total",
)
PROMPTS = (
    "The router keeps every group of prompts on one worker",
    "Red river stone and the blue light of the morning city",
    "Which worker serves the next request from the queue",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineCluster]:
    with pytest.MonkeyPatch.context() as mp:
        # The router's answers name workers by URL, so tests can compare with the fleet.
        mp.setenv("KVROUTE_EXPOSE_WORKER_URLS", "true")
        specs = (
            EngineSpec(radix_cache_backend="rlt", max_total_tokens=POOL_TOKENS),
            EngineSpec(radix_cache_backend=None, max_total_tokens=POOL_TOKENS),
        )
        with EngineCluster(specs=specs, log_dir=str(tmp_path_factory.mktemp("engines"))) as engines:
            engines.start_workers()
            print(f"\nSGLang workers healthy after {[round(s, 1) for s in engines.startup_s]} s")
            yield engines


def _sse_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp:
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                events.append(json.loads(line[5:]))
    return events


def test_routing_never_changes_an_answer(cluster: EngineCluster) -> None:
    """Greedy answers through the router equal the worker's own, on every API and mode."""
    router = cluster.start_router("kvroute", "lbgr")
    worker = cluster.worker_urls[0]
    for prompt in PROMPTS:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        direct = [post_json(url + "/generate", body)["text"] for url in cluster.worker_urls]
        assert direct[0] == direct[1], "the two workers disagree: not the same model?"
        routed = post_json(router + "/generate", body)
        assert routed["text"] == direct[0]
        assert routed["meta_info"]["completion_tokens"] >= 1
        events = _sse_events(router + "/generate", {**body, "stream": True})
        assert events, "no SSE event through the router"
        assert events[-1]["text"] == direct[0]
        want = openai_answers(worker, prompt)
        got = openai_answers(router, prompt)
        assert got == want
        assert want["completions"] == want["completions stream"]
        assert want["chat"] == want["chat stream"]


HF_CHECK = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, prompts = sys.argv[1], json.loads(sys.argv[2])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
if prompts and isinstance(prompts[0], str):  # tokenize as the worker does
    print(json.dumps([tok(p)["input_ids"] for p in prompts]))
    sys.exit()
out = []
for ids, generated in prompts:  # teacher-forced on the worker's own answer
    with torch.no_grad():
        logits = model(torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1]
    best = logits.max(dim=-1).values
    chosen = logits[torch.arange(len(generated)), torch.tensor(generated)]
    spread = best - logits.min(dim=-1).values
    out.append(((best - chosen) / spread).tolist())
print(json.dumps(out))
"""


def _hf(*args: str) -> Any:
    done = subprocess.run(
        [str(engine_python("sglang")), "-c", HF_CHECK, str(model_dir()), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=engine_env("sglang"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sglang_on_a_cpu_decodes_as_transformers_does(cluster: EngineCluster) -> None:
    """Every token SGLang's CPU path (with kvroute's sgl_kernel stand-in) picks greedily is
    transformers' argmax for the same model, teacher-forced on SGLang's answer.

    Up to rounding: SGLang keeps the bf16 weights and KV cache and computes norms and logits
    in float32, transformers runs in float32 here, and a random model's top logits nearly
    tie, so a pick may differ from transformers' by a hair (a gap below 1% of that step's
    logit range); a wrong KV slot or position would pick a token far down the ranking.
    """
    prompt_ids: list[list[int]] = _hf(json.dumps(PROMPTS))
    answers = []
    for ids in prompt_ids:
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        }
        picks = [
            [e[1] for e in post_json(url + "/generate", body)["meta_info"]["output_token_logprobs"]]
            for url in cluster.worker_urls
        ]
        assert picks[0] == picks[1]
        answers.append([ids, picks[0]])
    gaps: list[list[float]] = _hf(json.dumps(answers))
    exact = sum(g == 0 for row in gaps for g in row)
    total = sum(len(row) for row in gaps)
    print(f"\nSGLang's greedy picks that are transformers' exact argmax: {exact}/{total}")
    for row in gaps:
        assert row[0] == 0  # the prefill's token
        assert max(row) < 0.01
    assert exact >= 0.75 * total


def _run(
    cluster: EngineCluster, policy: str, bodies: list[dict[str, Any]], *, explain: bool = False
) -> dict[str, Any]:
    cluster.flush()
    router = cluster.start_router("kvroute", policy)
    before = {w: metric_totals(w, COUNTERS) for w in cluster.worker_urls}
    started = time.perf_counter()
    answers = send_all(router + "/generate", bodies, concurrency=2)
    wall_s = time.perf_counter() - started
    after = {w: metric_totals(w, COUNTERS) for w in cluster.worker_urls}
    failed = [a for a in answers if not a.ok]
    assert not failed, f"{policy}: {len(failed)} failed, first: {failed[0].error}"
    labels = [spec.label for spec in cluster.specs]
    token = getattr(cluster, "admin_token", None)  # the router's, where LocalCluster sets one
    return {
        "policy": policy,
        "answers": answers,
        "prediction_errors": _prediction_errors(router, token, answers) if explain else [],
        "wall_s": wall_s,
        "hit_rate": hit_rate(
            {k: sum(b[k] for b in before.values()) for k in COUNTERS},
            {k: sum(a[k] for a in after.values()) for k in COUNTERS},
        ),
        "worker_hit_rate": {
            label: hit_rate(before[w], after[w])
            for label, w in zip(labels, cluster.worker_urls, strict=True)
        },
        "evicted_tokens": _deltas(labels, cluster, before, after, "sglang:evicted_tokens_total"),
        "requests": _deltas(labels, cluster, before, after, "sglang:num_requests_total"),
    }


def _deltas(
    labels: list[str],
    cluster: EngineCluster,
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    name: str,
) -> dict[str, float]:
    return {
        label: after[w][name] - before[w][name]
        for label, w in zip(labels, cluster.worker_urls, strict=True)
    }


def _together(answers: list[Answer], groups: list[int | None]) -> float:
    """Share of requests that went to their group's most used worker."""
    by_group: dict[int | None, Counter[str | None]] = {}
    for answer, group in zip(answers, groups, strict=True):
        by_group.setdefault(group, Counter())[answer.worker] += 1
    return sum(c.most_common(1)[0][1] for c in by_group.values()) / len(answers)


def _prediction_errors(router: str, token: str | None, answers: list[Answer]) -> list[int]:
    """Per decision: the router's predicted cached tokens on the chosen worker minus the
    worker's reported ``cached_tokens`` (a decision's cache figures need the admin token)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    errors = []
    for answer in answers:
        req = urllib.request.Request(f"{router}/explain/{answer.decision_id}", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            decision = json.loads(r.read())
        chosen = next(c for c in decision["candidates"] if c["worker"] == decision["chosen"])
        assert decision["chosen"] == answer.worker
        errors.append(int(chosen["cached"]) - answer.cached_tokens)
    return errors


def test_lbgr_keeps_groups_together_under_eviction(cluster: EngineCluster) -> None:
    """On the same prefix-sharing requests, lbgr's hit rate (the workers' own count) is well
    above round_robin's; both pools evict (RLT for real), and nothing fails or is lost."""
    vocab = vocab_size(model_dir())
    bodies = gsp_bodies(GSP, vocab)
    groups = [item.group for item in GSPWorkload(GSP)]
    rows = {
        "lbgr": _run(cluster, "lbgr", bodies, explain=True),
        "round_robin": _run(cluster, "round_robin", bodies),
    }
    for row in rows.values():
        answers: list[Answer] = row["answers"]
        assert len(answers) == len(bodies)
        reported = sum(a.cached_tokens for a in answers) / sum(a.prompt_tokens for a in answers)
        row["together"] = _together(answers, groups)
        print(
            f"\n{row['policy']}: hit rate {row['hit_rate']:.3f} (/metrics; from answers "
            f"{reported:.3f}), per worker {_fmt(row['worker_hit_rate'])}, evicted tokens "
            f"{_fmt(row['evicted_tokens'], 0)}, requests {_fmt(row['requests'], 0)}, "
            f"groups kept together {row['together']:.2f}, {row['wall_s']:.1f} s"
        )
        assert sum(row["requests"].values()) == len(bodies)
        assert abs(reported - row["hit_rate"]) < 0.02
    lbgr, rr = rows["lbgr"], rows["round_robin"]
    # lbgr moves a group when the other worker is less busy (its trade: 73-100% of each
    # group's requests on one worker in these runs), round_robin sprays them (~60%).
    assert lbgr["together"] >= rr["together"] + 0.05
    assert lbgr["hit_rate"] >= rr["hit_rate"] + 0.1
    # Sprayed groups overflow both pools: the RLT worker and the LRU one both evicted.
    assert all(n > 0 for n in rr["evicted_tokens"].values())

    errors: list[int] = lbgr["prediction_errors"]
    absolute = [abs(e) for e in errors]
    print(
        f"router's predicted cached tokens - worker's cached_tokens, over {len(errors)} lbgr "
        f"decisions: mean {statistics.fmean(errors):+.1f}, mean |error| "
        f"{statistics.fmean(absolute):.1f}, median |error| {statistics.median(absolute):.0f}, "
        f"max |error| {max(absolute)}, exact within 1 token: "
        f"{sum(a <= 1 for a in absolute) / len(absolute):.2f} (prompts are "
        f"{GSP.total_lens[0]} tokens)"
    )
    # The router's index does not see evictions: it can only over-predict, by at most a
    # prompt. Most decisions (the group's prefix cached where the router thinks) are close.
    assert max(absolute) <= GSP.total_lens[0] + 1
    assert statistics.median(absolute) <= 40


def _fmt(values: dict[str, float], digits: int = 3) -> str:
    return ", ".join(f"{k} {v:.{digits}f}" for k, v in values.items())


def test_a_worker_killed_mid_run_loses_nothing(cluster: EngineCluster) -> None:
    """SIGKILL one worker while requests are in flight on it: every request still gets its
    answer (the router retries what never reached the client on the other worker).

    round_robin keeps sending to the dead worker until its health check fails, so both kinds
    of failure are retried: the requests it was serving, and new ones it refuses.
    """
    router = cluster.start_router("kvroute", "round_robin")
    victim = cluster.worker_urls[1]
    vocab = vocab_size(model_dir())
    config = GSPConfig(
        num_groups=8, prompts_per_group=10, prefix_ratio=0.8, total_lens=(200,), seed=1
    )
    bodies = gsp_bodies(config, vocab, max_new_tokens=32)
    served_before = metric_totals(victim, COUNTERS)["sglang:num_requests_total"]
    killed_after: list[float] = []

    def kill_mid_run() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # polls the victim until it has served a few
            served = metric_totals(victim, COUNTERS)["sglang:num_requests_total"]
            if served - served_before >= 5:
                cluster.kill_worker(1)
                killed_after.append(served - served_before)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_mid_run)
    killer.start()
    started = time.perf_counter()
    answers = send_all(router + "/generate", bodies, concurrency=4)
    killer.join()
    assert killed_after, "the victim never served 5 requests"
    assert cluster.alive() == [True, False]
    failed = [a for a in answers if not a.ok]
    by_worker = Counter(a.worker for a in answers)
    print(
        f"\nkilled {cluster.specs[1].label} after it served {killed_after[0]:.0f}: "
        f"{len(answers) - len(failed)}/{len(answers)} answered in "
        f"{time.perf_counter() - started:.1f} s, by worker {dict(by_worker)}"
    )
    assert not failed, f"{len(failed)} lost, first: {failed[0].error}"
    assert all(a.body is not None and a.body["meta_info"]["completion_tokens"] for a in answers)
    assert by_worker[victim] < len(answers) / 2  # round_robin's half, less what failed over
    assert by_worker[cluster.worker_urls[0]] + by_worker[victim] == len(answers)
