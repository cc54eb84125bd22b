"""A tiny SGLang-like worker for the router's tests: real HTTP on loopback, no mocks.

It speaks what the router forwards to: ``GET /health``, ``POST /generate`` (``text`` or
``input_ids``), ``POST /v1/completions`` and ``POST /v1/chat/completions`` in OpenAI's shapes
(the official ``openai`` client parses them), streaming as SSE ``data: {...}`` events ending
with ``data: [DONE]``, and ``GET /v1/models``. Knobs a test turns at run time: ``delay_s``
(a slow worker), ``chunk_pause_s`` (a pause after the first streamed chunk),
``last_chunk_pause_s`` (a pause before the last one), ``health_status``,
``fail_status`` (answer with an error), ``break_body`` (hang up halfway through an answer)
and ``stop()``. It records every request's raw body and
every non-streamed response's bytes, so tests can check the router passes both unchanged.

In process it runs on a thread with its own event loop (``FakeWorker().start()``); as a
script it serves until interrupted::

    python tests/router_service/fake_worker.py --port 30001 --delay-s 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MODEL_ID = "fake-model"


@dataclass
class Received:
    path: str
    raw: bytes
    body: dict[str, Any]
    at_s: float = field(default_factory=time.monotonic)
    headers: dict[str, str] = field(default_factory=dict)


class FakeWorker:
    """One fake worker; ``url`` is its base URL once started."""

    def __init__(
        self,
        name: str = "w",
        *,
        delay_s: float = 0.0,
        chunk_pause_s: float = 0.0,
        last_chunk_pause_s: float = 0.0,
        chunks: int = 3,
        host: str = "127.0.0.1",
    ) -> None:
        self.name = name
        self.delay_s = delay_s
        self.chunk_pause_s = chunk_pause_s
        self.last_chunk_pause_s = last_chunk_pause_s
        self.chunks = chunks
        self.health_status = 200
        self.fail_status: int | None = None  # answer data-plane requests with this error
        self.set_cookie: str | None = None  # a Set-Cookie header on every non-streamed answer
        self.reply_headers: dict[str, str] = {}  # more headers on every non-streamed answer
        self.gzip = False  # compress non-streamed answers when the request accepts gzip
        self.cached_tokens: int | None = None  # reported as found cached (None: not reported)
        self.break_body = False  # send half of each non-streamed /generate answer, then hang up
        self.host = host
        self.port = 0
        self.received: list[Received] = []
        self.responses: list[bytes] = []  # bytes of each non-streamed response, in order
        self.health_checks = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def served(self, path: str | None = None) -> int:
        """Data-plane requests received (optionally on one path)."""
        with self._lock:
            return sum(1 for r in self.received if path is None or r.path == path)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, port: int = 0) -> FakeWorker:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, port))
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(sock, ready), name=f"fake-worker-{self.name}", daemon=True
        )
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake worker did not start")
        return self

    def _serve(self, sock: socket.socket, ready: threading.Event) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)

        async def boot() -> None:
            self._runner = web.AppRunner(self.app(), shutdown_timeout=0.5, access_log=None)
            await self._runner.setup()
            await web.SockSite(self._runner, sock).start()

        loop.run_until_complete(boot())
        ready.set()
        loop.run_forever()
        loop.close()

    def stop(self) -> None:
        """Close the listener and every connection; later connections are refused."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._thread = None

    # -- the HTTP API -----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.json_response(
            {"status": "ok" if self.health_status == 200 else "bad"}, status=self.health_status
        )

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": self.name}]
        return web.json_response({"object": "list", "data": data})

    async def _receive(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        body = json.loads(raw)
        with self._lock:
            self.received.append(Received(request.path, raw, body, headers=dict(request.headers)))
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        return body

    def _fail(self) -> web.Response:
        error = {"message": f"worker {self.name} refuses", "type": "worker_error"}
        return web.json_response({"error": error}, status=self.fail_status or 500)

    def _text(self, i: int) -> str:
        return f"tok{i}-{self.name} "

    def _reply(self, payload: dict[str, Any]) -> web.Response:
        # Odd spacing and key order on purpose: a proxy that re-encodes would change the bytes.
        raw = json.dumps(payload, indent=1, sort_keys=False).encode() + b"\n"
        with self._lock:
            self.responses.append(raw)
        headers = {"Set-Cookie": self.set_cookie} if self.set_cookie else {}
        headers.update(self.reply_headers)
        asked = self.received[-1].headers.get("Accept-Encoding", "") if self.received else ""
        if self.gzip and "gzip" in asked:
            raw, headers["Content-Encoding"] = gzip.compress(raw), "gzip"
        return web.Response(body=raw, content_type="application/json", headers=headers)

    async def _sse(self, request: web.Request, events: list[dict[str, Any]]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, event in enumerate(events):
            if i == len(events) - 1 and i > 0 and self.last_chunk_pause_s > 0:
                await asyncio.sleep(self.last_chunk_pause_s)  # the last decode step
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            if i == 0 and self.chunk_pause_s > 0:
                await asyncio.sleep(self.chunk_pause_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._receive(request)
        if self.fail_status is not None:
            return self._fail()
        prompt = body.get("text") if body.get("text") is not None else body.get("input_ids")
        meta = {"id": f"gen-{self.name}", "prompt_tokens": len(prompt or ()), "worker": self.name}
        if self.cached_tokens is not None:
            meta["cached_tokens"] = self.cached_tokens
        if body.get("stream"):
            events, text = [], ""
            for i in range(self.chunks):
                text += self._text(i)
                events.append({"text": text, "meta_info": {**meta, "completion_tokens": i + 1}})
            return await self._sse(request, events)
        text = "".join(self._text(i) for i in range(self.chunks))
        payload = {"text": text, "meta_info": {**meta, "completion_tokens": self.chunks}}
        if self.break_body:
            return await self._broken(request, json.dumps(payload).encode())
        return self._reply(payload)

    async def _broken(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        """Headers and half the body, then the connection drops: a worker dying mid-answer."""
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(raw)
        await resp.prepare(request)
        await resp.write(raw[: len(raw) // 2])
        assert request.transport is not None
        request.transport.close()
        return resp

    def _usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": 5,
            "completion_tokens": self.chunks,
            "total_tokens": 5 + self.chunks,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._receive(request)
        if self.fail_status is not None:
            return self._fail()
        base = {
            "id": f"cmpl-{self.name}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", MODEL_ID),
        }
        if body.get("stream"):
            events = [
                {
                    **base,
                    "choices": [
                        {"index": 0, "text": self._text(i), "logprobs": None, "finish_reason": None}
                    ],
                }
                for i in range(self.chunks)
            ]
            events[-1]["choices"][0]["finish_reason"] = "stop"
            return await self._sse(request, events)
        text = "".join(self._text(i) for i in range(self.chunks))
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
        return self._reply({**base, "choices": [choice], "usage": self._usage()})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._receive(request)
        if self.fail_status is not None:
            return self._fail()
        base = {
            "id": f"chatcmpl-{self.name}",
            "created": int(time.time()),
            "model": body.get("model", MODEL_ID),
        }
        if body.get("stream"):
            events = [
                {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                    ],
                }
            ]
            for i in range(self.chunks):
                events.append(
                    {
                        **base,
                        "object": "chat.completion.chunk",
                        "choices": [
                            {"index": 0, "delta": {"content": self._text(i)}, "finish_reason": None}
                        ],
                    }
                )
            events[-1]["choices"][0]["finish_reason"] = "stop"
            return await self._sse(request, events)
        text = "".join(self._text(i) for i in range(self.chunks))
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
        return self._reply(
            {**base, "object": "chat.completion", "choices": [choice], "usage": self._usage()}
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=30001)
    parser.add_argument("--name", default="w")
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--chunk-pause-s", type=float, default=0.0)
    args = parser.parse_args()
    worker = FakeWorker(args.name, delay_s=args.delay_s, chunk_pause_s=args.chunk_pause_s)
    worker.start(args.port)
    print(f"fake worker {args.name} on {worker.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        worker.stop()


if __name__ == "__main__":
    main()
