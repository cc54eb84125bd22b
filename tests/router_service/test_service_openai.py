"""The official ``openai`` client against the router: completions and chat, stream and not."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from fake_worker import FakeWorker
from router_harness import RouterServer, http_client

Shared = tuple[RouterServer, tuple[FakeWorker, FakeWorker]]


@pytest.fixture(scope="module")
def client(shared_router: Shared) -> Iterator[openai.OpenAI]:
    router, _ = shared_router
    with openai.OpenAI(
        base_url=f"{router.url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=http_client(f"{router.url}/v1"),
    ) as client:
        yield client


def _names(shared_router: Shared) -> dict[str, str]:
    return {w.url: w.name for w in shared_router[1]}


def test_completion(client: openai.OpenAI, shared_router: Shared) -> None:
    raw = client.completions.with_raw_response.create(
        model="fake-model", prompt="Once upon a time", max_tokens=8
    )
    worker = _names(shared_router)[raw.headers["X-KVRoute-Worker"]]
    assert raw.headers["X-KVRoute-Decision-Id"]
    completion = raw.parse()
    assert completion.object == "text_completion"
    assert completion.choices[0].text == f"tok0-{worker} tok1-{worker} tok2-{worker} "
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.total_tokens == 8


def test_completion_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="fake-model", prompt="Once upon a time", max_tokens=8, stream=True
    )
    chunks = list(stream)
    assert len(chunks) == 3
    text = "".join(c.choices[0].text for c in chunks)
    assert text.startswith("tok0-")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat(client: openai.OpenAI, shared_router: Shared) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=[{"role": "user", "content": "Say hello"}]
    )
    worker = _names(shared_router)[raw.headers["X-KVRoute-Worker"]]
    chat = raw.parse()
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == f"tok0-{worker} tok1-{worker} tok2-{worker} "


def test_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text.count("tok") == 3
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["fake-model"]


def test_client_sees_router_errors_as_api_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="fake-model", messages=[])
    assert caught.value.status_code == 400
    assert "messages" in caught.value.message
