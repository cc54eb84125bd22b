"""What the OpenAPI schema says about bodies and answers: documentation, not validation.

The data plane reads its bodies itself (request_parsing) and passes every field it does not
need through to the worker, and the endpoints answer with ``JSONResponse`` directly, so
nothing here runs on a request. The schema is kept honest by a fuzz test
(``tests/router_service/test_schema_fuzz.py``): every answer must conform to what is
declared here, and every error is one of the listed statuses with an ``ErrorBody``.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field

from engine_ext.cache.keys import MAX_TOKEN_ID
from router_service.request_parsing import MAX_NEW_TOKENS

__all__ = [
    "CHAT_BODY",
    "COMPLETIONS_BODY",
    "EXPLAIN_BODY",
    "GENERATE_BODY",
    "ErrorBody",
    "ExplainAnswer",
    "HealthAnswer",
    "PolicyAnswer",
    "WorkerAnswer",
    "WorkerListAnswer",
    "WorkerRemovedAnswer",
    "data_plane_doc",
    "errors",
    "install_openapi",
    "request_body",
]


class ErrorDetail(BaseModel):
    message: str = Field(description="what was wrong and how to fix it")
    type: str = Field(description="machine-readable kind, e.g. invalid_request_error")
    param: str | None = Field(description="the offending field, when there is one")
    code: int = Field(description="the HTTP status again")


class ErrorBody(BaseModel):
    """Every refusal of the router, in OpenAI's shape."""

    error: ErrorDetail


_ERROR_TEXT = {
    400: "bad input: the body or a parameter is invalid (the message names the field)",
    401: "the control plane needs 'Authorization: Bearer <admin token>'",
    403: "the worker URL is not on the allow-list, or the control plane is off (no admin token)",
    404: "not found",
    408: "the request body did not arrive within body_timeout_s",
    409: "conflicts with the current state",
    413: "the request body is larger than max_body_bytes",
    429: "this client's rate limit exceeded; see Retry-After",
    502: "the worker is unreachable or broke off (after retries on other workers)",
    503: "no worker can take the request, or the router is overloaded (requests or request "
    "bodies in flight); see Retry-After",
    504: "the worker did not answer in time (after retries on other workers)",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these statuses, each with an ``ErrorBody``."""
    return {code: {"model": ErrorBody, "description": _ERROR_TEXT[code]} for code in codes}


# OpenAPI 3.1 has the schema of text/event-stream describe one event.
_SSE_EVENT = {
    "type": "object",
    "description": "one SSE event: `data` holds a JSON chunk from the worker, `[DONE]` at "
    'the end, or the router\'s `{"error": {...}}` when the worker broke off mid-stream',
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def data_plane_doc(body: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` for a proxied route: its body, and answers relayed from the worker."""
    return {
        **request_body(body),
        "responses": {
            "200": {
                "description": "the worker's answer, relayed unchanged: JSON, or with "
                '"stream": true an SSE stream (text/event-stream) of `data: {...}` events; '
                'a stream that breaks mid-way ends with a `data: {"error": {...}}` event '
                "and no [DONE]",
                "content": {
                    "application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {"schema": _SSE_EVENT},
                },
            },
            "default": {
                "description": "any other status is the worker's own answer, relayed unchanged",
            },
        },
    }


def request_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_TOKEN_IDS = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
}
_PROMPT = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        _TOKEN_IDS,
        {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
    ],
    "description": "text, token ids, or a batch of either (routed by its first prompt)",
}
_MAX_TOKENS = {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_NEW_TOKENS}
_STREAM = {"type": "boolean", "description": "answer as an SSE stream"}

GENERATE_BODY: dict[str, Any] = {
    "type": "object",
    "description": "SGLang's native API: exactly one of text or input_ids; every other "
    "field passes through to the worker",
    "properties": {
        "text": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            ]
        },
        "input_ids": {"anyOf": [_TOKEN_IDS, {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]},
        "sampling_params": {
            "type": ["object", "null"],
            "properties": {"max_new_tokens": _MAX_TOKENS},
        },
        "stream": _STREAM,
    },
    "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}],
}
COMPLETIONS_BODY: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI completions; every other field passes through to the worker",
    "properties": {
        "model": {"type": "string"},
        "prompt": _PROMPT,
        "max_tokens": _MAX_TOKENS,
        "stream": _STREAM,
    },
    "required": ["prompt"],
}
CHAT_BODY: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI chat completions; every other field passes through to the worker",
    "properties": {
        "model": {"type": "string"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"role": {"type": "string"}},
                "required": ["role"],
            },
        },
        "max_tokens": _MAX_TOKENS,
        "max_completion_tokens": _MAX_TOKENS,
        "stream": _STREAM,
    },
    "required": ["messages"],
}
# /explain tells the kinds apart by their keys: messages, then prompt, then text/input_ids.
EXPLAIN_BODY: dict[str, Any] = {
    "description": "a /generate, /v1/completions or /v1/chat/completions body",
    "anyOf": [
        CHAT_BODY,
        {**COMPLETIONS_BODY, "not": {"required": ["messages"]}},
        {**GENERATE_BODY, "not": {"anyOf": [{"required": ["messages"]}, {"required": ["prompt"]}]}},
    ],
}


class CandidateAnswer(BaseModel):
    """One worker's line of a decision; fields the policy does not use are null."""

    worker: str
    cached: int | None
    uncached: int | None
    base_ms: float | None
    queue_ms: float | None
    residual_ms: float | None
    predicted_ms: float | None
    in_flight: int | None
    impact_ms: float | None = Field(
        None, description="lbgr: the delay this request would add to the worker's others"
    )
    evict_ms: float | None = Field(
        None,
        description="lbgr: of impact_ms, what storing a second copy of a prefix another "
        "worker caches is expected to cost again (what it evicts that comes back)",
    )
    stall_ms: float | None = Field(
        None,
        description="lbgr: of queue_ms, how much longer its decode would take for the "
        "prefills that arrive meanwhile (at the share of the worker's time prefill took lately)",
    )
    cost_ms: float | None = Field(None, description="lbgr: what the argmin ranks")
    eligible: bool
    reason: str | None


class ModelAnswer(BaseModel):
    kind: str
    version: int


class ExplainAnswer(BaseModel):
    """A routing decision (docs/explain.md); recorded ones carry their outcome and attempt."""

    decision_id: str
    policy: str
    chosen: str
    branch: str | None
    units: int
    reserve_ms: float | None
    model: ModelAnswer | None
    candidates: list[CandidateAnswer]
    dry_run: bool
    replica_id: str | None = None
    attempt: int | None = Field(None, description="1 for the first try, 2+ for retries")
    outcome: dict[str, Any] | None = Field(
        description="status, latency_ms, ttft_ms, residual_target_ms, model_error_ms, "
        "estimate_ms; "
        "null while in flight and for dry runs"
    )


class HealthWorker(BaseModel):
    healthy: bool = Field(description="answers its /health checks")
    reason: str | None
    circuit: Literal["closed", "open", "half_open"]
    routable: bool = Field(description="healthy and its circuit lets a request through now")


class HealthAnswer(BaseModel):
    """The router's health; the same body comes with 503 when unavailable or draining."""

    status: Literal["ok", "degraded", "unavailable", "draining"]
    replica_id: str
    policy: str
    healthy_workers: int
    routable_workers: int = Field(description="healthy workers whose circuit is not open")
    workers: dict[str, HealthWorker]
    store: dict[str, Any] = Field(description="load store mode and Redis fallback figures")
    index_sync: dict[str, Any] | None
    draining: bool


class WorkerAnswer(BaseModel):
    url: str
    label: str = Field(description="how client-facing answers name the worker (w0, w1, ...)")
    healthy: bool
    reason: str | None
    consecutive_failures: int
    last_check_s: float | None
    circuit: Literal["closed", "open", "half_open"]
    circuit_opens: int
    in_flight: int
    pending_units: int
    prefill_tokens: float = Field(description="prompt tokens routed here, not yet prefilled")
    kv_tokens: float = Field(description="KV tokens this router's requests hold or will hold")
    other_requests: float = Field(description="requests in the worker this router did not send")
    other_kv_tokens: float = Field(description="their KV tokens, by the worker's /metrics")
    queue_ms: float
    index_units: int
    cache_survival: dict[str, Any] = Field(
        description="what of the prefix index's belief the worker's answers say survives: "
        "answers learned from, the share by octave of age (under 250 ms, 250-500 ms, ...) "
        "and horizon_ms, the age from which less than half survives (null: none learned); "
        "refetch_share, of what the worker prefilled lately the share it had held before "
        "and evicted"
    )
    kv_events: dict[str, Any] | None = Field(
        None,
        description="the worker's KV-event stream (endpoint, replay, status, page_size, "
        "chunk_tokens, blocks, "
        "counters); null without one",
    )
    kv_events_discovery: str | None = Field(
        None,
        description="with --kv-events-discover: 'subscribed', or why the worker's /server_info "
        "named no publisher the router could use; null when off, not asked yet, or not asked "
        "at all (the worker's endpoints are configured)",
    )


class WorkerListAnswer(BaseModel):
    workers: list[WorkerAnswer]


class WorkerRemovedAnswer(BaseModel):
    removed: str
    workers: list[str]


class PolicyAnswer(BaseModel):
    name: str
    params: dict[str, Any]


def install_openapi(app: FastAPI) -> None:
    """Serve the schema without FastAPI's generated 422 answers: validation errors are 400s
    with an ``ErrorBody`` here (app.py), and every route lists the 400 it can give."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for item in schema.get("paths", {}).values():
                for operation in item.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
