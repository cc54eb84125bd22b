"""The emulated worker's aiohttp application: routes, info endpoints, metrics, lifecycle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

from aiohttp import web

from kvroute import __version__
from router_service.tokenizer import PromptTokenizer
from sim.emulator.kv_publisher import KVEventPublisher, KVEventsSettings
from sim.emulator.runtime import EmulatedRuntime
from sim.emulator.server import CONFIG, RUNTIME, TOKENIZER, EmulatorConfig, handle
from sim.profiles import get_profile

__all__ = ["PUBLISHER", "create_emulator_app"]

PUBLISHER = web.AppKey("kv_publisher", KVEventPublisher)


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def _models(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvroute",
                    "root": config.model_name,
                    "max_model_len": 131072,
                }
            ],
        }
    )


async def _model_info(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    return web.json_response(
        {
            "model_path": config.model_name,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }
    )


async def _server_info(request: web.Request) -> web.Response:
    config, runtime = request.app[CONFIG], request.app[RUNTIME]
    return web.json_response(
        {
            "model_path": config.model_name,
            "served_model_name": config.model_name,
            "version": f"kvroute-emulator {__version__}",
            "emulated": True,
            "profile": runtime.profile.name,
            "radix_eviction": config.eviction,
            "max_total_num_tokens": runtime.cache.capacity_tokens,
            "chunked_prefill_size": runtime.profile.chunked_prefill_tokens,
            "max_running_requests": runtime.profile.max_running_requests,
            "page_size": config.page_size,
            "time_scale": config.time_scale,
            "internal_states": [{"avg_spec_accept_length": None}],
            "kv_events": (
                request.app[PUBLISHER].describe(config.page_size)
                if PUBLISHER in request.app
                else None
            ),
        }
    )


async def _flush(request: web.Request) -> web.Response:
    if request.app[RUNTIME].flush():
        return web.Response(text="Cache flushed.\n")
    return web.Response(text="Cache not flushed: requests are running.\n", status=400)


async def _metrics(request: web.Request) -> web.Response:
    runtime, config = request.app[RUNTIME], request.app[CONFIG]
    stats, cache = runtime.cache.stats, runtime.cache
    used = cache.protected_tokens + cache.reserved_tokens
    label = f'{{model_name="{config.model_name}"}}'
    rows = [
        ("sglang:prompt_tokens_total", "counter", "Prompt tokens", stats.prompt_tokens),
        (
            "sglang:generation_tokens_total",
            "counter",
            "Generated tokens",
            runtime.generation_tokens,
        ),
        (
            "sglang:cached_tokens_total",
            "counter",
            "Prompt tokens served from the prefix cache",
            stats.cached_tokens,
        ),
        ("sglang:num_requests_total", "counter", "Requests", runtime.requests_total),
        ("sglang:num_running_reqs", "gauge", "Running requests", runtime.running),
        ("sglang:num_queue_reqs", "gauge", "Queued requests", runtime.queued),
        # SGLang's meaning: KV held by requests in the worker (locked prompts and the room
        # reserved for their outputs), not the evictable rest of the prefix cache.
        ("sglang:num_used_tokens", "gauge", "KV tokens in use", used),
        ("sglang:max_total_num_tokens", "gauge", "KV pool size in tokens", cache.capacity_tokens),
        ("sglang:token_usage", "gauge", "KV token usage", used / cache.capacity_tokens),
        (
            "kvroute_emulator_tree_tokens",
            "gauge",
            "Tokens in the prefix cache, evictable ones included",
            cache.total_tokens,
        ),
        ("sglang:cache_hit_rate", "gauge", "Prefix cache hit rate", stats.hit_rate),
        ("sglang:evicted_tokens_total", "counter", "Tokens evicted", stats.evicted_tokens),
    ]
    lines = []
    for name, kind, doc, value in rows:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{label} {value}"]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")


def create_emulator_app(config: EmulatorConfig) -> web.Application:
    """An emulated SGLang worker; the scheduler starts and stops with the app."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[CONFIG] = config
    if config.tokenizer is not None:
        app[TOKENIZER] = PromptTokenizer(config.tokenizer)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        publisher = None
        if config.kv_events_config is not None:
            publisher = KVEventPublisher(KVEventsSettings.parse(config.kv_events_config))
            app[PUBLISHER] = publisher
            publisher.start()
        runtime = EmulatedRuntime(
            get_profile(config.profile),
            config.eviction,
            config.capacity_tokens,
            time_scale=config.time_scale,
            page_size=config.page_size,
            seed=config.seed,
            on_events=publisher.publish if publisher is not None else None,
        )
        app[RUNTIME] = runtime
        runtime.start()
        yield
        await runtime.stop()
        if publisher is not None:
            await publisher.close()

    app.cleanup_ctx.append(lifecycle)
    add = app.router.add_route
    add("POST", "/generate", partial(handle, kind="generate"))
    add("POST", "/v1/completions", partial(handle, kind="completions"))
    add("POST", "/v1/chat/completions", partial(handle, kind="chat"))
    add("GET", "/v1/models", _models)
    add("GET", "/health", _health)
    add("GET", "/health_generate", _health)
    add("GET", "/get_model_info", _model_info)
    add("GET", "/get_server_info", _server_info)
    add("GET", "/server_info", _server_info)
    add("GET", "/model_info", _model_info)
    add("POST", "/flush_cache", _flush)
    add("GET", "/flush_cache", _flush)
    add("GET", "/metrics", _metrics)
    return app
