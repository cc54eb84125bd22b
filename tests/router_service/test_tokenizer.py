"""``--tokenizer``: prompts tokenized as the worker will, from a tokenizer made here.

The tokenizer is built in the test with the ``tokenizers`` library (a word-level vocabulary,
``<s>`` added in front of every text as Llama's post-processor does) and saved as a Hugging
Face directory with a chat template in ``tokenizer_config.json``: nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from engine_ext.cache.keys import key_to_ids
from router_service.routing import RouteRequest
from router_service.tokenizer import PromptTokenizer, TokenizerError

WORDS = [
    *("you", "are", "a", "helpful", "assistant", "hi", "there", "how", "is", "the"),
    *("cache", "today", "tell", "me", "more"),
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|> {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(path: Path, template: str | None = TEMPLATE) -> Path:
    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def tokenizer(tmp_path: Path) -> PromptTokenizer:
    return PromptTokenizer(make_tokenizer(tmp_path / "tok"))


def test_text_gets_the_special_tokens_as_the_engine_adds_them(tokenizer: PromptTokenizer) -> None:
    raw = Tokenizer.from_file(str(tokenizer.path / "tokenizer.json"))
    assert tokenizer.encode_text("hi there") == raw.encode("hi there").ids
    assert tokenizer.encode_text("hi there")[0] == raw.token_to_id("<s>")


def test_a_chat_request_goes_through_the_chat_template(tokenizer: PromptTokenizer) -> None:
    body = {
        "messages": [
            {"role": "system", "content": "you are a helpful assistant"},
            {"role": "user", "content": "hi how is the cache today"},
        ]
    }
    text = tokenizer.render_chat(body)
    assert text == (
        "<s><|system|> you are a helpful assistant\n"
        "<|user|> hi how is the cache today\n<|assistant|>"
    )
    raw = Tokenizer.from_file(str(tokenizer.path / "tokenizer.json"))
    ids = tokenizer.encode_chat(body)
    # The template wrote the BOS already: encoded without adding special tokens again.
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert ids.count(raw.token_to_id("<s>")) == 1
    # A longer conversation extends the token ids of the shorter one (prefix caching).
    longer = {"messages": [*body["messages"], {"role": "assistant", "content": "tell me more"}]}
    assert tokenizer.encode_chat(longer)[: len(ids) - 1] == ids[:-1]


def test_the_templates_own_errors_name_the_messages(tokenizer: PromptTokenizer) -> None:
    with pytest.raises(TokenizerError, match="messages: the chat template refused them"):
        tokenizer.encode_chat({"messages": [{"role": "robot", "content": "hi"}]})


def test_the_sandbox_refuses_unsafe_templates(tmp_path: Path) -> None:
    unsafe = "{{ messages.__class__.__mro__ }}"
    tok = PromptTokenizer(make_tokenizer(tmp_path / "t", template=unsafe))
    with pytest.raises((TokenizerError, jinja2.exceptions.SecurityError)):
        tok.render_chat({"messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize("inline_chars", [10_000, 0])  # inline, and on a worker thread
def test_route_requests_are_keyed_by_token_ids(tmp_path: Path, inline_chars: int) -> None:
    tok = PromptTokenizer(make_tokenizer(tmp_path / "t"), inline_chars=inline_chars)
    body = {"messages": [{"role": "user", "content": "hi there"}]}
    route = RouteRequest("r1", json.dumps(body["messages"]), None, 8)
    routed = asyncio.run(tok.route_request("chat", body, route))
    assert routed.tokens
    assert key_to_ids(str(routed.key)) == tok.encode_chat(body)
    assert routed.prompt_tokens == len(tok.encode_chat(body))
    assert (routed.request_id, routed.max_new_tokens) == ("r1", 8)
    ids = RouteRequest("r2", "\x05\x06", 2, None, tokens=True)  # input_ids: kept as they are
    assert asyncio.run(tok.route_request("generate", {"input_ids": [5, 6]}, ids)) is ids
    text = asyncio.run(
        tok.route_request("completions", {"prompt": ["hi there", "x"]}, RouteRequest("r3", "x"))
    )
    assert key_to_ids(str(text.key)) == tok.encode_text("hi there")  # a batch: its first


def test_a_directory_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        PromptTokenizer(tmp_path)
    no_template = PromptTokenizer(make_tokenizer(tmp_path / "t", template=None))
    with pytest.raises(TokenizerError, match="has no chat template"):
        no_template.encode_chat({"messages": [{"role": "user", "content": "hi"}]})
