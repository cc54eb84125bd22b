"""An emulated SGLang worker over HTTP: enough of SGLang's API for kvroute and sglang-router.

Routes: ``POST /generate`` (SGLang native, ``text`` or ``input_ids``, streaming),
``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI, streaming),
``GET /v1/models``, ``GET /health``, ``GET /health_generate``, ``GET /get_model_info``,
``GET /get_server_info``, ``GET|POST /flush_cache``, ``GET /metrics`` (Prometheus text with
``sglang:prompt_tokens_total`` and ``sglang:cached_tokens_total``, from which the paper computes
the hit rate). Time comes from the service model (``sim.profiles``), scaled by ``time_scale``;
``meta_info.e2e_latency`` is in emulated seconds, so it does not depend on the scale.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine_ext.cache.keys import MAX_TOKEN_ID, ids_to_key
from router_service.tokenizer import PromptTokenizer, TokenizerError
from sim.emulator.runtime import EmulatedRuntime, Submission
from sim.emulator.tokenizer import decode_filler, encode
from sim.engine import EngineRequest, RequestTooLarge

__all__ = ["CONFIG", "RUNTIME", "TOKENIZER", "EmulatorConfig", "handle"]

RUNTIME = web.AppKey("runtime", EmulatedRuntime)
# With ``EmulatorConfig.tokenizer``: text is tokenized as SGLang would with that tokenizer
# (the router's ``--tokenizer`` code), instead of the built-in word tokenizer.
TOKENIZER = web.AppKey("tokenizer", PromptTokenizer)


@dataclass(frozen=True)
class EmulatorConfig:
    profile: str = "llama3.1-8b-l40"
    eviction: str = "lru"
    capacity_tokens: int | None = None
    time_scale: float = 1.0
    page_size: int = 1
    seed: int = 0
    model_name: str = "kvroute-emulated"
    default_max_new_tokens: int = 16
    kv_events_config: str | None = None  # SGLang's --kv-events-config JSON: publish KV events
    tokenizer: str | None = None  # a local Hugging Face tokenizer directory: text is tokenized
    # as the router's --tokenizer does (router_service.tokenizer), not by sim.emulator.tokenizer


CONFIG = web.AppKey("config", EmulatorConfig)


class BadRequest(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _error(status: int, message: str) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": "BadRequestError" if status == 400 else "ServerError",
            "code": status,
        },
        "object": "error",
        "message": message,
    }
    return web.json_response(body, status=status)


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _ids(value: Any, field: str) -> list[int]:
    if isinstance(value, list) and value and isinstance(value[0], list):
        value = value[0]  # batch: the emulator serves the first prompt
    if not isinstance(value, list) or not value or not all(type(t) is int for t in value):
        raise BadRequest(f"{field} must be a non-empty list of token ids")
    if min(value) < 0 or max(value) > MAX_TOKEN_ID:
        raise BadRequest(f"{field}: token ids out of range")
    return value


def _prompt_ids(value: Any, field: str, tokenizer: PromptTokenizer | None = None) -> list[int]:
    if isinstance(value, list) and value and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        ids = encode(value) if tokenizer is None else tokenizer.encode_text(value)
        if not ids:
            raise BadRequest(f"{field} must not be empty")
        return ids
    if not isinstance(value, list):
        raise BadRequest(f"{field} must be a string or a list of token ids")
    return _ids(value, field)


def _max_new(value: Any, default: int, field: str) -> int:
    if value is None:
        return default
    if type(value) is not int or value < 1:
        raise BadRequest(f"{field} must be a positive integer")
    return value


@dataclass
class _Job:
    rid: str
    prompt_ids: list[int]
    max_new: int
    stream: bool


def _job(
    body: dict[str, Any], kind: str, default_new: int, tokenizer: PromptTokenizer | None = None
) -> _Job:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean")
    if kind == "generate":
        if (body.get("text") is None) == (body.get("input_ids") is None):
            raise BadRequest("give exactly one of text or input_ids")
        ids = (
            _ids(body["input_ids"], "input_ids")
            if body.get("input_ids") is not None
            else _prompt_ids(body["text"], "text", tokenizer)
        )
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object")
        max_new = _max_new(params.get("max_new_tokens"), default_new, "max_new_tokens")
    elif kind == "completions":
        if body.get("prompt") is None:
            raise BadRequest("prompt is required")
        ids = _prompt_ids(body["prompt"], "prompt", tokenizer)
        max_new = _max_new(body.get("max_tokens"), default_new, "max_tokens")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        text = "".join(
            f"<|{m.get('role', 'user')}|> {_content(m.get('content'))}\n"
            for m in messages
            if isinstance(m, dict)
        )
        if tokenizer is not None:
            try:
                ids = tokenizer.encode_chat(body)
            except TokenizerError as exc:
                raise BadRequest(str(exc)) from None
        else:
            ids = encode(text + "<|assistant|>")
        max_new = _max_new(
            body.get("max_completion_tokens", body.get("max_tokens")), default_new, "max_tokens"
        )
    return _Job(uuid.uuid4().hex, ids, max_new, stream)


def _content(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")


async def _run(runtime: EmulatedRuntime, job: _Job, arrived_s: float) -> Submission:
    req = EngineRequest(job.rid, ids_to_key(job.prompt_ids), job.max_new)
    await runtime.overhead(spent_s=time.monotonic() - arrived_s)
    try:
        return runtime.submit(req)
    except RequestTooLarge as exc:
        raise BadRequest(str(exc)) from None


def _meta(sub: Submission, produced: int, e2e_s: float, done: bool) -> dict[str, Any]:
    req = sub.request
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": produced,
        "cached_tokens": req.cached,
        "e2e_latency": e2e_s,
    }
    meta["finish_reason"] = {"type": "length", "length": produced} if done else None
    return meta


async def _tokens(sub: Submission) -> AsyncIterator[int]:
    while True:
        count = await sub.tokens.get()
        if count is None:
            return
        yield count


def _text(n: int) -> str:
    return "".join(decode_filler(i) for i in range(n))


async def handle(request: web.Request, kind: str) -> web.StreamResponse:
    runtime, config = request.app[RUNTIME], request.app[CONFIG]
    arrived_s, started_ms = time.monotonic(), runtime.now_ms()
    try:
        job = _job(
            await _json(request),
            kind,
            config.default_max_new_tokens,
            request.app.get(TOKENIZER),
        )
        sub = await _run(runtime, job, arrived_s)
    except BadRequest as exc:
        return _error(400, exc.message)

    def e2e_s() -> float:
        """Emulated seconds since the request arrived (wall time x time_scale)."""
        return (runtime.now_ms() - started_ms) / 1000.0

    if not job.stream:
        produced = 0
        async for count in _tokens(sub):
            produced = count
        return web.json_response(_final(kind, sub, produced, e2e_s(), config))
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    produced = 0
    async for produced in _tokens(sub):
        chunk = _chunk(kind, sub, produced, e2e_s(), config)
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    if kind != "generate":
        await resp.write(
            b"data: " + json.dumps(_last_chunk(kind, sub, produced, config)).encode() + b"\n\n"
        )
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _usage(sub: Submission, produced: int) -> dict[str, Any]:
    req = sub.request
    return {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": produced,
        "total_tokens": req.prompt_tokens + produced,
        "prompt_tokens_details": {"cached_tokens": req.cached},
    }


def _final(
    kind: str, sub: Submission, produced: int, e2e_s: float, config: EmulatorConfig
) -> dict[str, Any]:
    text, rid, created = _text(produced), sub.request.rid, int(time.time())
    if kind == "generate":
        return {
            "text": text,
            "output_ids": list(range(produced)),
            "meta_info": _meta(sub, produced, e2e_s, True),
        }
    if kind == "completions":
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": config.model_name,
            "usage": _usage(sub, produced),
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
        }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": config.model_name,
        "usage": _usage(sub, produced),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
    }


def _chunk(
    kind: str, sub: Submission, produced: int, e2e_s: float, config: EmulatorConfig
) -> dict[str, Any]:
    rid, created = sub.request.rid, int(time.time())
    if kind == "generate":
        return {
            "text": _text(produced),
            "output_ids": list(range(produced)),
            "meta_info": _meta(sub, produced, e2e_s, False),
        }
    delta = decode_filler(produced - 1)
    if kind == "completions":
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": config.model_name,
            "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": None}],
        }
    message = {"role": "assistant", "content": delta} if produced == 1 else {"content": delta}
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": config.model_name,
        "choices": [{"index": 0, "delta": message, "logprobs": None, "finish_reason": None}],
    }


def _last_chunk(
    kind: str, sub: Submission, produced: int, config: EmulatorConfig
) -> dict[str, Any]:
    rid, created = sub.request.rid, int(time.time())
    if kind == "completions":
        choice: dict[str, Any] = {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": "length",
        }
        obj = "text_completion"
    else:
        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
        obj = "chat.completion.chunk"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": config.model_name,
        "choices": [choice],
        "usage": _usage(sub, produced),
    }
