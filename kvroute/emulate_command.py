"""``kvroute emulate``: one emulated SGLang worker (no GPU) on HOST:PORT."""

from __future__ import annotations

import argparse
import socket
from typing import Any

from kvroute.workload_args import positive_float, positive_int
from sim.profiles import PROFILES

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "emulate",
        help="run one emulated SGLang worker (no GPU)",
        description="An HTTP server speaking SGLang's API, backed by kvroute's "
        "reference radix cache and a calibrated service model.",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, required=True, help="bind port (required)")
    p.add_argument(
        "--eviction",
        choices=["lru", "rlt"],
        default="rlt",
        help="radix cache eviction: rlt (kvroute's randomized leaf-token eviction) or lru "
        "(SGLang's own)",
    )
    p.add_argument(
        "--capacity-tokens",
        type=positive_int,
        default=None,
        help="KV capacity in tokens (default: the profile's)",
    )
    p.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="llama3.1-8b-l40",
        help="service model: model, GPU, KV capacity (sim/profiles.py)",
    )
    p.add_argument(
        "--time-scale",
        type=positive_float,
        default=1.0,
        help="emulated time runs this many times faster than real time",
    )
    p.add_argument("--page-size", type=positive_int, default=1, help="KV cache page size in tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of RLT's random draws")
    p.add_argument(
        "--model-name", default="kvroute-emulated", help="the model name /v1/models reports"
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help='publish KV events as SGLang does, e.g. \'{"publisher": "zmq", "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (default: none)',
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenize text with this local Hugging Face tokenizer directory (default: the "
        "built-in word tokenizer)",
    )
    p.set_defaults(run=run, command_parser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    from aiohttp import web

    from sim.emulator import EmulatorConfig, create_emulator_app

    config = EmulatorConfig(
        profile=args.profile,
        eviction=args.eviction,
        capacity_tokens=args.capacity_tokens,
        time_scale=args.time_scale,
        page_size=args.page_size,
        seed=args.seed,
        model_name=args.model_name,
        kv_events_config=args.kv_events_config,
        tokenizer=args.tokenizer,
    )
    if args.kv_events_config is not None:
        from sim.emulator.kv_publisher import KVEventsSettings

        try:
            KVEventsSettings.parse(args.kv_events_config)
        except ValueError as exc:
            parser.error(str(exc))
    # Bind here, not in aiohttp, so a port in use is a clear error (exit 2), not a traceback.
    try:
        family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as exc:
        parser.error(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    import zmq

    try:
        web.run_app(create_emulator_app(config), sock=sock, print=None, access_log=None)
    except zmq.ZMQError as exc:  # the KV-event endpoints bind as the app starts
        parser.error(f"--kv-events-config: cannot bind a KV-event endpoint: {exc}")
    return 0
