"""A worker that answers instantly: measures a router's own overhead, not a model's.

SGLang-shaped enough for kvroute and sglang-router: /health, /get_model_info,
/get_server_info, /v1/models, and POST /generate and /v1/completions that answer at once,
as JSON or as a short SSE stream (``"stream": true``: 4 events then ``[DONE]``).
Run: ``python benchmarks/instant_worker.py PORT``.
"""

from __future__ import annotations

import json
import sys

from aiohttp import web

_BODY = json.dumps(
    {"text": "ok", "meta_info": {"prompt_tokens": 8, "completion_tokens": 4, "cached_tokens": 0}}
).encode()
_EVENTS = [b'data: {"text": "t%d"}\n\n' % i for i in range(4)] + [b"data: [DONE]\n\n"]


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.Response(body=_BODY, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for event in _EVENTS:
        await resp.write(event)
    await resp.write_eof()
    return resp


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="")


async def info(request: web.Request) -> web.Response:
    return web.json_response(
        {
            "model_path": "instant",
            "is_generation": True,
            "tokenizer_path": None,
            "version": "instant",
        }
    )


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "instant", "object": "model"}]})


def main() -> None:
    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/health_generate", ok)
    app.router.add_get("/get_model_info", info)
    app.router.add_get("/get_server_info", info)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", generate)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
