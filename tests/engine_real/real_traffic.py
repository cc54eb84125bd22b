"""Traffic for the real-engine tier: send bodies, keep what the worker said about its cache.

Requests here are not streamed (except where a test streams on purpose), so every answer
carries the worker's own ``cached_tokens`` and prompt length, and the router's headers name
the worker and the decision (``/explain/{id}`` holds what the router predicted).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai

from engine_ext.cache.keys import key_to_ids
from kvroute.engine_launch import fit_to_vocab
from sim.workloads.gsp import GSPConfig, GSPWorkload

__all__ = [
    "Answer",
    "gsp_bodies",
    "hit_rate",
    "metric_totals",
    "openai_answers",
    "post_json",
    "send_all",
]


@dataclass
class Answer:
    index: int
    status: int
    body: dict[str, Any] | None
    worker: str | None
    decision_id: str | None
    latency_s: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.body is not None

    @property
    def cached_tokens(self) -> int:
        return int((self.body or {})["meta_info"]["cached_tokens"])

    @property
    def prompt_tokens(self) -> int:
        return int((self.body or {})["meta_info"]["prompt_tokens"])


def post_json(url: str, body: dict[str, Any], timeout_s: float = 60) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # loopback
        return json.loads(resp.read())


def gsp_bodies(config: GSPConfig, vocab: int, max_new_tokens: int = 4) -> list[dict[str, Any]]:
    """GSP's prompts as ``/generate`` bodies of token ids in the tiny model's vocabulary."""
    return [
        {
            "input_ids": fit_to_vocab(key_to_ids(item.prompt), vocab),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        }
        for item in GSPWorkload(config)
    ]


async def _send(
    session: aiohttp.ClientSession, url: str, index: int, body: dict[str, Any]
) -> Answer:
    started = time.perf_counter()
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
            raw = await r.read()
            answer = Answer(
                index,
                r.status,
                None,
                r.headers.get("X-KVRoute-Worker"),
                r.headers.get("X-KVRoute-Decision-Id"),
                time.perf_counter() - started,
            )
            try:
                answer.body = json.loads(raw)
            except ValueError:
                answer.error = raw[:200].decode(errors="replace")
            if r.status != 200:
                answer.error = raw[:300].decode(errors="replace")
            return answer
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return Answer(index, 0, None, None, None, time.perf_counter() - started, repr(exc))


def send_all(url: str, bodies: Sequence[dict[str, Any]], concurrency: int) -> list[Answer]:
    """POST every body to ``url`` with at most ``concurrency`` in flight; answers in order."""

    async def run() -> list[Answer]:
        gate = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession() as session:

            async def one(index: int, body: dict[str, Any]) -> Answer:
                async with gate:
                    return await _send(session, url, index, body)

            return list(await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies))))

    return asyncio.run(run())


def metric_totals(worker_url: str, names: Sequence[str]) -> dict[str, float]:
    """A worker's Prometheus counters, summed over label sets (0 when absent)."""
    with urllib.request.urlopen(worker_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float:
    """``sglang:cached_tokens_total / sglang:prompt_tokens_total`` over a run (the paper's)."""
    prompt = after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"]
    cached = after["sglang:cached_tokens_total"] - before["sglang:cached_tokens_total"]
    return cached / prompt if prompt else 0.0


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def openai_answers(base: str, prompt: str) -> dict[str, str]:
    """Greedy answers from the official client: completions and chat, whole and streamed."""
    client = _client(base)
    kw: dict[str, Any] = {"model": "tiny-llama", "max_tokens": 12, "temperature": 0}
    messages = [{"role": "user", "content": prompt}]
    completion = client.completions.create(prompt=prompt, **kw)
    chat = client.chat.completions.create(messages=messages, **kw)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **kw)
    )
    chat_streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(messages=messages, stream=True, **kw)
        if c.choices
    )
    return {
        "completions": completion.choices[0].text,
        "completions stream": streamed,
        "chat": chat.choices[0].message.content or "",
        "chat stream": chat_streamed,
    }
