"""Tokenize prompts the way the worker will, from a local Hugging Face tokenizer directory.

``--tokenizer PATH`` names a directory holding ``tokenizer.json`` (and usually
``tokenizer_config.json``, and the chat template there or in ``chat_template.jinja``);
nothing is downloaded. The router then routes on token ids: ``/generate`` text and
``/v1/completions`` prompts are encoded with the tokenizer's special tokens (SGLang's
``tokenizer.encode(text)``), and ``/v1/chat/completions`` messages are rendered through the
chat template with the generation prompt and encoded without adding special tokens again
(``apply_chat_template(..., tokenize=True, add_generation_prompt=True)``). The template runs
in Jinja's immutable sandbox with the globals and filters Transformers gives it
(``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML, loop
controls, ``{% generation %}`` blocks).

Token ids then drive both the approximate index and the block hashes of the workers' KV
events. A prompt longer than ``inline_chars`` is encoded on a worker thread
(``encode_batch`` releases the GIL), so a long prompt never holds the event loop; shorter
ones cost less inline than the hand-over would (``benchmarks/kv_events.py`` measures both).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from engine_ext.cache.keys import ids_to_key
from router_service.errors import ServiceError
from router_service.request_parsing import ParsedRequest
from router_service.routing import RouteRequest

__all__ = ["INLINE_CHARS", "PromptTokenizer", "TokenizerError", "load_tokenizer", "tokenized"]

# Prompts up to this many characters (1,500-2,000 tokens of English) are tokenized on the event
# loop, longer ones on a worker thread: a 1k-token prompt holds the loop for about a
# millisecond, a 32k-token one for tens (benchmarks/kv_events.py; several times that on
# a busy machine), while the hand-over costs tens of microseconds.
INLINE_CHARS = 8_000


class TokenizerError(ValueError):
    """The tokenizer directory cannot be used, or a prompt cannot be rendered with it."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: Transformers marks assistant text with it
    for training masks; rendering a prompt keeps the text and nothing else."""

    tags = {"generation"}  # noqa: RUF012 (Jinja's class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_keep")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _keep(self, caller: Any) -> str:
        return str(caller())


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class PromptTokenizer:
    """A tokenizer and its chat template, loaded once from a local directory."""

    def __init__(self, path: str | Path, inline_chars: int = INLINE_CHARS) -> None:
        self.path = Path(path)
        self.inline_chars = inline_chars
        if not (self.path / "tokenizer.json").is_file():
            raise TokenizerError(
                f"--tokenizer {self.path}: no tokenizer.json there; give a local Hugging Face "
                "tokenizer directory (the model's, as the workers load it)"
            )
        try:
            self.tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 (the Rust loader raises plain Exceptions)
            raise TokenizerError(
                f"--tokenizer {self.path}: cannot load tokenizer.json: {exc}"
            ) from None
        config = self._config()
        self.special_tokens = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(name))) is not None
        }
        self.template = self._template(config)

    def _config(self) -> dict[str, Any]:
        file = self.path / "tokenizer_config.json"
        if not file.is_file():
            return {}
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"cannot read {file}: {exc}") from None
        return config if isinstance(config, dict) else {}

    def _template(self, config: dict[str, Any]) -> jinja2.Template | None:
        source: Any = config.get("chat_template")
        jinja_file = self.path / "chat_template.jinja"
        if jinja_file.is_file():
            source = jinja_file.read_text()
        if isinstance(source, list):  # named templates: the "default" one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            return None
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_Generation, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise TokenizerError(
                f"the chat template of {self.path} does not compile: {exc}"
            ) from None

    # -- encoding --------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """Token ids of a prompt, with the tokenizer's special tokens (BOS)."""
        return list(self.tokenizer.encode_batch([text], add_special_tokens=True)[0].ids)

    def render_chat(self, body: dict[str, Any]) -> str:
        """The prompt text a chat body becomes (the template, with the generation prompt)."""
        if self.template is None:
            raise TokenizerError(
                f"the tokenizer at {self.path} has no chat template: chat requests cannot be "
                "tokenized (route them on text, without --tokenizer)"
            )
        kwargs = body.get("chat_template_kwargs")
        extra = dict(kwargs) if isinstance(kwargs, dict) else {}
        try:
            return self.template.render(
                messages=body["messages"],
                tools=body.get("tools"),
                documents=None,
                add_generation_prompt=True,
                **self.special_tokens,
                **extra,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TokenizerError(f"messages: the chat template refused them: {exc}") from None

    def encode_chat(self, body: dict[str, Any]) -> list[int]:
        text = self.render_chat(body)
        return list(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)

    def encode_body(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        """Token ids of a data-plane body's prompt; None when it carries ids already."""
        if kind == "chat":
            return self.encode_chat(body)
        prompt = body.get("text") if kind == "generate" else body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch routes by its first prompt
        if isinstance(prompt, str):
            return self.encode_text(prompt)
        return None

    async def route_request(
        self, kind: str, body: dict[str, Any], route: RouteRequest
    ) -> RouteRequest:
        """``route`` keyed by the prompt's token ids (unchanged when it has ids already)."""
        if route.tokens:
            return route
        if len(route.key) <= self.inline_chars:
            ids = self.encode_body(kind, body)
        else:
            ids = await asyncio.to_thread(self.encode_body, kind, body)
        if not ids:
            return route
        return replace(route, key=ids_to_key(ids), prompt_tokens=len(ids), tokens=True)


def load_tokenizer(path: str | Path | None) -> PromptTokenizer | None:
    """The ``--tokenizer`` of the settings, or None; a bad directory is a start-up error."""
    if path is None:
        return None
    try:
        return PromptTokenizer(path)
    except TokenizerError as exc:
        raise ServiceError(400, str(exc), field="tokenizer") from None


async def tokenized(tokenizer: PromptTokenizer | None, parsed: ParsedRequest) -> ParsedRequest:
    """``parsed`` routed on its token ids when the router has a tokenizer (a 400 when the
    chat template refuses the messages, as the worker would)."""
    if tokenizer is None:
        return parsed
    try:
        route = await tokenizer.route_request(parsed.kind, parsed.body, parsed.route)
    except TokenizerError as exc:
        raise ServiceError(400, str(exc), field="messages") from None
    return replace(parsed, route=route)
