"""The emulated worker's HTTP API: SGLang-like 400s, and OpenAI shapes the official client reads."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai
import pytest
from emulator_server import EmulatorServer


@pytest.fixture
def server(emulator: Callable[..., EmulatorServer]) -> EmulatorServer:
    return emulator(time_scale=50.0, model_name="emu-model")


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/generate", b"{not json", "not valid JSON"),
        ("/generate", b"[1, 2]", "must be a JSON object"),
        ("/generate", {"text": 5}, "text must be a string or a list of token ids"),
        ("/generate", {"text": "hi", "input_ids": [1, 2]}, "exactly one of text or input_ids"),
        ("/generate", {"sampling_params": {}}, "exactly one of text or input_ids"),
        ("/generate", {"input_ids": [1, "2"]}, "input_ids must be a non-empty list"),
        ("/generate", {"input_ids": [1, -2]}, "input_ids: token ids out of range"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
            "max_new_tokens must be a positive integer",
        ),
        ("/generate", {"text": "hi", "stream": "yes"}, "stream must be a boolean"),
        ("/generate", {"text": "hi", "sampling_params": [1]}, "sampling_params must be an object"),
        ("/v1/completions", {"model": "m"}, "prompt is required"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens must be a positive"),
        ("/v1/chat/completions", {"messages": []}, "messages must be a non-empty list"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages must be a non-empty list"),
    ],
)
def test_malformed_requests_get_sglang_like_400s(
    server: EmulatorServer, path: str, body: Any, message: str
) -> None:
    raw = body if isinstance(body, bytes) else None
    status, payload = server.post(path, body if raw is None else None, raw=raw)
    assert status == 400, payload
    # SGLang's OpenAI-style error object: {"object": "error", "message", "error": {...}}.
    assert payload["object"] == "error"
    assert payload["error"]["code"] == 400
    assert payload["error"]["type"] == "BadRequestError"
    assert message in payload["message"]
    assert server.metrics()["sglang:num_requests_total"] == 0  # nothing reached the engine


def test_a_request_larger_than_the_cache_is_a_400(
    emulator: Callable[..., EmulatorServer],
) -> None:
    server = emulator(time_scale=50.0, capacity_tokens=100)
    status, payload = server.post(
        "/generate", {"input_ids": list(range(200)), "sampling_params": {"max_new_tokens": 4}}
    )
    assert status == 400
    assert "the cache holds 100" in payload["message"]


def test_generate_streams_sglang_chunks(server: EmulatorServer) -> None:
    import urllib.request

    body = {"text": "You are helpful. Hi", "stream": True, "sampling_params": {"max_new_tokens": 3}}
    req = urllib.request.Request(
        server.url + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.read().decode().splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert chunks[-1]["text"] == " tok0 tok1 tok2"  # SGLang streams the text so far
    assert chunks[-1]["meta_info"]["prompt_tokens"] == 4  # the emulator's tokenizer


@pytest.fixture
def client(server: EmulatorServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_reads_completions(client: openai.OpenAI) -> None:
    out = client.completions.create(model="emu-model", prompt="Once upon a time", max_tokens=5)
    assert out.object == "text_completion"
    assert out.choices[0].text == " tok0 tok1 tok2 tok3 tok4"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (4, 5)
    assert out.usage.total_tokens == 9
    # The same prompt again is a cache hit (all but the last token).
    again = client.completions.create(model="emu-model", prompt="Once upon a time", max_tokens=1)
    assert again.usage is not None
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 3


def test_openai_client_reads_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="emu-model",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello there"},
        ],
        max_tokens=3,
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == " tok0 tok1 tok2"
    assert out.usage is not None
    assert out.usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == ["emu-model"]


def test_openai_client_streams_completions(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="emu-model", prompt="Stream me", max_tokens=4, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == " tok0 tok1 tok2 tok3"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


def test_openai_client_streams_chat(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="emu-model",
        messages=[{"role": "user", "content": "Stream me"}],
        max_tokens=4,
        stream=True,
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == " tok0 tok1 tok2 tok3"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens > 0
