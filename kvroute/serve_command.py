"""``kvroute serve``: run the router service (uvicorn, uvloop, httptools)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from types import FrameType
from typing import Any

import uvicorn

from router_service.settings import SettingsError, load_settings
from router_service.state import ServiceState

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the router in front of SGLang/OpenAI-compatible workers",
        description="Run the kvroute router. Flags override KVROUTE_* environment "
        "variables, which override the --config YAML file.",
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML settings file (default: none; KVROUTE_* variables and flags only)",
    )
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="bind port (default 8000)")
    p.add_argument(
        "--control-host",
        default=None,
        help="control plane and /metrics bind address (default 127.0.0.1)",
    )
    p.add_argument(
        "--control-port",
        type=int,
        default=None,
        help="control plane and /metrics port (default: --port + 1, 8001); the control plane "
        "needs --admin-token and is off without one",
    )
    p.add_argument(
        "--worker-urls",
        nargs="+",
        default=None,
        metavar="URL",
        help="worker base URLs, e.g. http://127.0.0.1:30001 (no port: 80, or 443 for https; "
        "default: none, add them later with POST /workers)",
    )
    p.add_argument(
        "--worker-dns",
        default=None,
        metavar="http://NAME:PORT",
        help="follow the workers behind a DNS name (a Kubernetes headless Service): every "
        "address NAME resolves to is a worker at PORT, added and removed as the answer changes "
        "(allow-listed like POST /workers; default: none)",
    )
    p.add_argument("--policy", default=None, help="routing policy (default lbgr)")
    p.add_argument(
        "--policy-params",
        default=None,
        metavar="JSON",
        help='policy parameters, e.g. \'{"preset": "paper"}\' for cache_aware (default: the '
        "policy's own; docs/routing.md)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="residual model spec for lbgr, a name or JSON (default: ratio)",
    )
    p.add_argument(
        "--model-sharing",
        choices=["per_worker", "shared"],
        default=None,
        help="lbgr: one residual model per worker, or one shared (default per_worker)",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="share load, prefix index and model snapshots across replicas through this Redis, "
        "e.g. redis://127.0.0.1:6379/0, a Redis Cluster redis+cluster://HOST:PORT[,HOST:PORT] "
        "or Sentinel's primary redis+sentinel://HOST:26379[,HOST:26379]/SERVICE[/DB] "
        "(default: none, this replica alone)",
    )
    p.add_argument(
        "--cluster", default=None, help="namespace of shared state in Redis (default: default)"
    )
    p.add_argument(
        "--admin-token",
        default=None,
        help="bearer token for the control plane (default: none, control plane off); prefer "
        "KVROUTE_ADMIN_TOKEN, which ps does not show",
    )
    p.add_argument(
        "--replica-id",
        default=None,
        help="this replica's name in metrics and /explain (default: replica-<random>)",
    )
    p.add_argument(
        "--model-snapshot-path",
        default=None,
        help="save/load models here (needs a snapshot key: KVROUTE_MODEL_SNAPSHOT_KEY or "
        "--model-snapshot-key-file; default: none, models start fresh)",
    )
    p.add_argument(
        "--model-snapshot-key-file",
        default=None,
        metavar="PATH",
        help="a file holding the secret that signs model snapshots (at least 16 bytes; not the "
        "admin token); without a key (the default) no snapshot is read or written",
    )
    p.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="log level on stderr (default info)",
    )
    p.add_argument(
        "--queue-slots",
        type=int,
        default=None,
        metavar="N",
        help="hold queue: at most N of this replica's requests in flight per worker, the "
        "rest wait in the router and go where they are cached, shortest first (default 0: off)",
    )
    p.add_argument(
        "--queue-free-at",
        choices=["first_token", "last_token", "end"],
        default=None,
        help="hold queue: a streamed request frees its slot at its first chunk (default), "
        "when one decode step is left (last_token) or at the end of the response (short "
        "outputs)",
    )
    p.add_argument(
        "--queue-max-wait-s",
        type=float,
        default=None,
        metavar="S",
        help="hold queue: after S seconds waiting a request goes to any worker (default 20)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="workers are emulated X times faster than real time: decay load and "
        "learn latencies on their clock (embedded load store only; default 1)",
    )
    p.add_argument(
        "--worker-kv-events",
        nargs="+",
        default=None,
        metavar="URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]",
        help="read a worker's cache from its KV events (SGLang --kv-events-config), with its "
        "replay endpoint after a comma; default: none, every worker on the approximate index",
    )
    p.add_argument(
        "--kv-events-discover",
        action="store_true",
        default=None,
        help="subscribe to the KV events each worker without --worker-kv-events describes in "
        "its /server_info (SGLang's kv_events; hosts on the worker allow-list); default: off",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a local Hugging Face tokenizer directory: route text and chat on the token ids "
        "the workers will see (default: none, text routes on its characters)",
    )
    p.set_defaults(run=run, command_parser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    params = None
    if args.policy_params is not None:
        try:
            params = json.loads(args.policy_params)
        except json.JSONDecodeError as exc:
            parser.error(f"--policy-params is not valid JSON: {exc}")
        if not isinstance(params, dict):
            parser.error("--policy-params must be a JSON object")
    try:
        settings = load_settings(
            args.config,
            host=args.host,
            port=args.port,
            control_host=args.control_host,
            control_port=args.control_port,
            worker_urls=args.worker_urls,
            worker_dns=args.worker_dns,
            policy=args.policy,
            policy_params=params,
            model=args.model,
            model_sharing=args.model_sharing,
            redis_url=args.redis_url,
            cluster=args.cluster,
            admin_token=args.admin_token,
            replica_id=args.replica_id,
            model_snapshot_path=args.model_snapshot_path,
            model_snapshot_key_file=args.model_snapshot_key_file,
            time_scale=args.time_scale,
            log_level=args.log_level,
            queue_slots=args.queue_slots,
            queue_free_at=args.queue_free_at,
            queue_max_wait_s=args.queue_max_wait_s,
            worker_kv_events=args.worker_kv_events,
            kv_events_discover=args.kv_events_discover,
            tokenizer=args.tokenizer,
        )
    except SettingsError as exc:
        parser.error(str(exc))
    from router_service.app import create_app
    from router_service.errors import ServiceError

    try:
        app = create_app(settings)
    except ServiceError as exc:
        parser.error(exc.message)
    logging.basicConfig(
        level=settings.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from router_service.listeners import bind_listeners

    try:
        sockets = bind_listeners(app.state.kvroute)
    except OSError as exc:
        parser.error(
            f"cannot listen on {settings.host}:{settings.port} and the control port "
            f"{settings.control_host}:{settings.control_port_to_bind}: {exc.strerror or exc}"
        )
    from router_service.http_protocol import guarded_protocol

    _raise_open_files_limit(settings.max_connections)
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http=guarded_protocol(settings),
        limit_concurrency=settings.max_connections,
        log_level=settings.log_level,
        access_log=False,
        # The router never reads the client address, so X-Forwarded-* parsing is pure cost.
        proxy_headers=False,
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
    )
    _DrainingServer(config, app.state.kvroute).run(sockets=list(sockets))
    return 0


def _raise_open_files_limit(connections: int) -> None:
    """Let the process hold ``connections`` sockets (and its workers' and Redis's): raise
    the soft limit on open files towards the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = connections + 1024
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    except (ImportError, ValueError, OSError):
        pass


class _DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: /health turns 503 "draining" at once; after ``drain_grace_s`` (time
    for a balancer polling /health to stop sending; the router keeps serving meanwhile)
    uvicorn stops accepting and lets requests in flight finish (up to the drain timeout),
    then the lifespan snapshots the models and closes connections. A second signal during
    the grace period stops accepting at once."""

    def __init__(self, config: uvicorn.Config, state: ServiceState) -> None:
        super().__init__(config)
        self.state = state
        self._grace: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        grace_s = self.state.settings.drain_grace_s
        if self.state.draining or grace_s <= 0:
            self.state.draining = True
            if self._grace is not None:
                self._grace.cancel()
            super().handle_exit(sig, frame)
            return
        self.state.draining = True
        # uvicorn polls should_exit every 0.1 s: a timer thread setting it later is enough.
        self._grace = threading.Timer(grace_s, super().handle_exit, (sig, frame))
        self._grace.daemon = True
        self._grace.start()
