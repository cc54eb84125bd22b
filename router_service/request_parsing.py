"""Read data-plane bodies: validate what routing needs and build the RouteRequest.

Only what the router relies on is checked (a clear 400 naming the field otherwise); every
other field passes through to the worker untouched, which validates its own API. Routing
units: token ids when the request carries them (``input_ids``, or a token-id ``prompt``),
else the prompt's characters; for chat, the JSON of ``messages`` (as SGLang's router).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine_ext.cache.keys import MAX_TOKEN_ID, ids_to_key
from router_service.errors import ServiceError
from router_service.routing import RouteRequest

__all__ = ["KINDS", "MAX_NEW_TOKENS", "ParsedRequest", "detect_kind", "parse_body"]

KINDS = ("generate", "completions", "chat")
# No engine generates 2**31 tokens; past it a count is a mistake (and past ~1e308 it cannot
# even become a float for the residual models' features).
MAX_NEW_TOKENS = 2**31 - 1


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: str
    route: RouteRequest
    stream: bool
    body: dict[str, Any]


def _bad(field: str, message: str) -> ServiceError:
    return ServiceError(400, f"{field}: {message}", field=field)


def load_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise ServiceError(400, "request body is not valid UTF-8", field="body") from None
    except json.JSONDecodeError as exc:
        raise ServiceError(
            400, f"request body is not valid JSON ({exc.msg} at char {exc.pos})", field="body"
        ) from None
    except ValueError:  # an integer literal past Python's 4300-digit conversion limit
        raise ServiceError(
            400, "request body holds a number too long to read", field="body"
        ) from None
    except RecursionError:  # arrays or objects nested past the decoder's recursion limit
        raise ServiceError(400, "request body is nested too deeply", field="body") from None
    if not isinstance(body, dict):
        raise ServiceError(400, "request body must be a JSON object", field="body")
    if _SURROGATE_ESCAPE.search(raw) is not None:
        where = _lone_surrogate(body, "body")
        if where is not None:
            raise ServiceError(
                400,
                f"{where}: holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its "
                "pair), which is not a Unicode character; send valid text",
                field=where,
            )
    return body


# JSON's \uXXXX escapes for UTF-16 surrogates. A valid pair decodes to one character; a lone
# one survives json.loads as a string no UTF-8 encoder (nor the worker) accepts.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: Any, where: str) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, else None."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            for key, sub in item.items():
                if _lone_surrogate(key, path) is not None:
                    return path
                stack.append((sub, f"{path}.{key}" if path != "body" else key))
        elif isinstance(item, list):
            stack.extend((sub, f"{path}[{i}]") for i, sub in enumerate(item))
    return None


def detect_kind(body: dict[str, Any]) -> str:
    """Which API a body is for (``/explain`` takes all three)."""
    if "messages" in body:
        return "chat"
    if "prompt" in body:
        return "completions"
    if "text" in body or "input_ids" in body:
        return "generate"
    raise _bad("body", "expected 'messages' (chat), 'prompt' (completions), or 'text'/'input_ids'")


def _token_ids(value: Any, field: str) -> list[int]:
    if not value or not all(type(t) is int for t in value):
        raise _bad(field, "must be a non-empty list of integer token ids")
    if min(value) < 0 or max(value) > MAX_TOKEN_ID:
        raise _bad(field, f"token ids must be in [0, {MAX_TOKEN_ID}]")
    return list(value)


def _units(value: Any, field: str) -> tuple[str, int | None]:
    """Routing key and token count for a prompt given as text, ids, or a batch of either."""
    if isinstance(value, str):
        if not value:
            raise _bad(field, "must not be empty")
        return value, None
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            if not all(isinstance(v, str) for v in value):
                raise _bad(field, "a batch must be all strings or all token-id lists")
            return _units(first, f"{field}[0]")  # batches route by their first prompt
        if isinstance(first, list):
            ids = _token_ids(first, f"{field}[0]")
            return ids_to_key(ids), len(ids)
        ids = _token_ids(value, field)
        return ids_to_key(ids), len(ids)
    raise _bad(field, "must be a string, a list of strings, or a list of token ids")


def _max_tokens(container: dict[str, Any], names: tuple[str, ...], prefix: str) -> int | None:
    for name in names:
        if name in container and container[name] is not None:
            value = container[name]
            if type(value) is not int or not 0 <= value <= MAX_NEW_TOKENS:
                raise _bad(f"{prefix}{name}", f"must be an integer in [0, {MAX_NEW_TOKENS}]")
            return value
    return None


def _stream(body: dict[str, Any]) -> bool:
    value = body.get("stream", False)
    if not isinstance(value, bool):
        raise _bad("stream", "must be true or false")
    return value


def parse_body(body: dict[str, Any], kind: str, request_id: str) -> ParsedRequest:
    if kind == "generate":
        has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
        if has_text == has_ids:
            raise _bad("text", "give exactly one of 'text' or 'input_ids'")
        key, tokens = _units(
            body["text"] if has_text else body["input_ids"], "text" if has_text else "input_ids"
        )
        params = body.get("sampling_params")
        params = {} if params is None else params  # `or {}` would let [] and "" through
        if not isinstance(params, dict):
            raise _bad("sampling_params", "must be an object")
        max_new = _max_tokens(params, ("max_new_tokens",), "sampling_params.")
    elif kind == "completions":
        if body.get("prompt") is None:
            raise _bad("prompt", "is required")
        key, tokens = _units(body["prompt"], "prompt")
        max_new = _max_tokens(body, ("max_tokens",), "")
    elif kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "must be a non-empty list of {role, content} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise _bad(f"messages[{i}]", "must be an object with a string 'role'")
        key = json.dumps(messages, separators=(",", ":"), ensure_ascii=False)
        tokens = None
        max_new = _max_tokens(body, ("max_completion_tokens", "max_tokens"), "")
    else:  # pragma: no cover - callers pass one of KINDS
        raise ValueError(kind)
    route = RouteRequest(request_id, key, tokens, max_new, tokens=tokens is not None)
    return ParsedRequest(kind, route, _stream(body), body)
