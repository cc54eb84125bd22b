"""Real engines as local workers: SGLang (or vLLM) on a CPU, serving the tiny model.

``kvroute cluster --engine sglang``, the real-engine tier (``tests/engine_real``) and
``benchmarks/real_engine.py`` start workers through this module. The engines live in their own
virtualenvs, built once by ``scripts/real_engine_setup.sh`` with the tiny model it makes (nothing
is downloaded): SGLang with kvroute's RLT plugin and a CPU stand-in for ``sgl_kernel``, and,
with ``--vllm``, vLLM's CPU build. Paths come from the environment, with these defaults:

- ``KVROUTE_ENGINE_VENV``: ``~/.cache/kvroute/venv-engine``
- ``KVROUTE_VLLM_VENV``: ``~/.cache/kvroute/venv-vllm``
- ``KVROUTE_TINY_MODEL``: ``~/.cache/kvroute/tiny-llama``

Each server gets one OpenMP thread unless ``OMP_NUM_THREADS`` says otherwise: two CPU-bound
servers on two cores must not fight over them. RLT is an SGLang radix-cache backend; a vLLM
worker keeps vLLM's own prefix cache.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sim.local_cluster import LocalCluster, free_ports, wait_healthy

__all__ = [
    "DEFAULT_MAX_TOTAL_TOKENS",
    "ENGINES",
    "SETUP_SCRIPT",
    "EngineCluster",
    "EngineEnvMissing",
    "EngineSpec",
    "engine_argv",
    "engine_env",
    "engine_python",
    "fit_to_vocab",
    "free_ports",
    "model_dir",
    "vocab_size",
]

ENGINES = ("sglang", "vllm")
SETUP_SCRIPT = "scripts/real_engine_setup.sh"
SERVED_MODEL_NAME = "tiny-llama"
DEFAULT_MAX_TOTAL_TOKENS = 20000  # SGLang's KV pool on a CPU (~20 MB for the tiny model)
_CACHE = Path("~/.cache/kvroute")


class _PortClash(RuntimeError):
    """A worker died before it was healthy because a port it was given was taken."""


class EngineEnvMissing(RuntimeError):
    """The real-engine environment (virtualenv or tiny model) is not installed."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One worker: which engine, and for SGLang which radix cache and how large a KV pool.

    ``radix_cache_backend`` None is SGLang's default (its LRU radix cache); ``"rlt"`` is
    kvroute's plugin. ``max_total_tokens`` is SGLang's KV pool in tokens. ``kv_events`` makes
    an SGLang worker publish its KV cache events (a ZMQ publisher and a replay endpoint on
    ports the launcher picks; ``EngineCluster.kv_events`` names them).
    """

    engine: str = "sglang"
    radix_cache_backend: str | None = "rlt"
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS
    extra_args: tuple[str, ...] = ()
    kv_events: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; use one of {', '.join(ENGINES)}")
        if self.engine == "vllm" and self.radix_cache_backend is not None:
            raise ValueError(
                "a radix-cache backend (RLT) is SGLang's: a vLLM worker keeps vLLM's own "
                "prefix cache (give radix_cache_backend=None)"
            )
        if self.max_total_tokens < 1:
            raise ValueError("max_total_tokens must be positive")
        if self.kv_events and self.engine != "sglang":
            raise ValueError(
                "kv_events configures SGLang's publisher; give a vLLM worker its own "
                "--kv-events-config in extra_args"
            )

    @property
    def label(self) -> str:
        if self.engine == "vllm":
            return "vllm"
        return f"sglang-{self.radix_cache_backend or 'lru'}"


def _path(env: Mapping[str, str], name: str, default: str) -> Path:
    return Path(env.get(name) or str(_CACHE / default)).expanduser()


def _missing(what: str, where: Path, variable: str, flag: str = "") -> EngineEnvMissing:
    return EngineEnvMissing(
        f"{what} is not installed ({where} has none; {variable} moves it). Install it once "
        f"from a kvroute checkout: {SETUP_SCRIPT}{flag} (a few minutes, cached in "
        "~/.cache/kvroute; nothing is downloaded when a worker starts)"
    )


def engine_python(engine: str, env: Mapping[str, str] = os.environ) -> Path:
    """The interpreter of the engine's virtualenv; EngineEnvMissing says how to install it."""
    if engine == "sglang":
        venv = _path(env, "KVROUTE_ENGINE_VENV", "venv-engine")
        if not (venv / ".kvroute-real-engine").is_file() or not (venv / "bin/python").exists():
            raise _missing("the SGLang real-engine environment", venv, "KVROUTE_ENGINE_VENV")
    elif engine == "vllm":
        venv = _path(env, "KVROUTE_VLLM_VENV", "venv-vllm")
        if not (venv / ".kvroute-vllm-recipe").is_file() or not (venv / "bin/python").exists():
            raise _missing("vLLM's CPU environment", venv, "KVROUTE_VLLM_VENV", " --vllm")
    else:
        raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    return venv / "bin/python"


def model_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The tiny model's directory; EngineEnvMissing says how to build it."""
    path = _path(env, "KVROUTE_TINY_MODEL", "tiny-llama")
    if not (path / "config.json").is_file():
        raise _missing("the tiny model", path, "KVROUTE_TINY_MODEL")
    return path


def vocab_size(model: Path) -> int:
    """The model's vocabulary size, from its ``config.json``."""
    config = json.loads((model / "config.json").read_text())
    return int(config["vocab_size"])


def fit_to_vocab(ids: Sequence[int], size: int, reserved: int = 4) -> list[int]:
    """Token ids folded into a small model's vocabulary, above its special tokens.

    Workloads draw ids from Llama 3's 128k vocabulary; the tiny model has ~1,000. Folding is
    one function of the id, so prompts that shared a prefix still share it (and distinct
    tails rarely collide: 1 in ``size - reserved`` per position).

    >>> fit_to_vocab([0, 3, 996, 128000], 1000)
    [4, 7, 4, 516]
    """
    span = size - reserved
    if span < 1:
        raise ValueError(f"a vocabulary of {size} leaves no ids above {reserved} special ones")
    return [reserved + i % span for i in ids]


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def engine_argv(
    spec: EngineSpec,
    python: Path,
    model: Path,
    host: str,
    port: int,
    *,
    nccl_port: int | None = None,
    kv_event_ports: tuple[int, int] | None = None,
) -> list[str]:
    """The server's command line (flags tested on a CPU; see docs/sglang_plugin.md).

    ``nccl_port`` pins SGLang's one TCP port of its own (else it draws one near ``port``,
    which can be a port another worker is about to bind); ``kv_event_ports`` (publisher,
    replay) is required when ``spec.kv_events``.
    """
    common = ["--host", host, "--port", str(port), "--served-model-name", SERVED_MODEL_NAME]
    if spec.engine == "vllm":
        return [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), *common,
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--max-model-len", "4096", "--dtype", "bfloat16",
            *spec.extra_args,
        ]  # fmt: skip
    backend = spec.radix_cache_backend
    events: list[str] = []
    if spec.kv_events:
        if kv_event_ports is None:
            raise ValueError("a worker with kv_events needs kv_event_ports (publisher, replay)")
        live, replay = kv_event_ports
        # ``bind``: SGLang connects to an address without a wildcard unless told to bind it.
        config = {
            "publisher": "zmq",
            "endpoint": _tcp(host, live),
            "bind": True,
            "replay_endpoint": _tcp(host, replay),
        }
        events = ["--kv-events-config", json.dumps(config)]
    return [
        str(python), "-m", "sglang.launch_server",
        "--model-path", str(model), *common,
        "--device", "cpu", "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch", "--grammar-backend", "none",
        "--disable-cuda-graph", "--disable-overlap-schedule",
        "--max-total-tokens", str(spec.max_total_tokens), "--mem-fraction-static", "0.05",
        "--enable-metrics", "--enable-cache-report",
        *(["--radix-cache-backend", backend] if backend else []),
        *(["--nccl-port", str(nccl_port)] if nccl_port is not None else []),
        *events,
        *spec.extra_args,
    ]  # fmt: skip


def engine_env(engine: str, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The server's environment: offline, one OpenMP thread unless told, the CPU switches."""
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    # The router's virtualenv must not leak into the engine's interpreter.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    if engine == "sglang":
        # Without it SGLang's CPU code paths stay off (the rotary embedding imports vllm).
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
        env["VLLM_SERVER_DEV_MODE"] = "1"  # serves POST /reset_prefix_cache (flush)
    return env


@dataclass
class EngineCluster(LocalCluster):
    """Real engine workers (one per spec) plus at most one router, all on loopback.

    ``start_workers`` starts every worker at once and waits for each ``/health`` (SGLang on a
    CPU: ~25 s; vLLM: ~60 s). Logs go to ``log_dir`` (a temporary directory if not given);
    a worker that dies before it is healthy raises with the end of its log, unless it died
    of a port clash: then every worker starts again on fresh ports.
    """

    specs: Sequence[EngineSpec] = (EngineSpec(),)
    start_timeout_s: float = 300.0
    start_attempts: int = 3
    startup_s: list[float] = field(default_factory=list)
    # Each worker's KV-event endpoints as ``--worker-kv-events`` takes them
    # (``tcp://host:port,tcp://host:replay_port``); "" for a worker without ``kv_events``.
    kv_events: list[str] = field(default_factory=list)
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def __post_init__(self) -> None:
        self.workers = len(self.specs)
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="kvroute-engines-")

    def __enter__(self) -> EngineCluster:
        return self

    def log_path(self, index: int) -> Path:
        return Path(self.log_dir or ".") / f"worker-{index}.log"

    def start_workers(self, seed: int = 0) -> list[str]:
        """Start every worker and wait for each; a start lost to a port clash is retried.

        The launcher picks each worker's ports (HTTP, SGLang's NCCL port, the KV-event
        endpoints) below the kernel's ephemeral range, where no outgoing connection takes
        them while the worker starts, but a port is free only until someone binds it:
        another process can take one first. A worker that died of ``Address already in use``
        is started again, with every worker, on fresh ports (up to ``start_attempts`` times).
        """
        del seed  # greedy decoding on seeded weights: nothing random to seed
        model = model_dir(self.env)
        for attempt in range(1, self.start_attempts + 1):
            try:
                return self._start_once(model)
            except _PortClash as exc:
                self.stop()
                if attempt == self.start_attempts:
                    raise RuntimeError(
                        f"{exc} ({attempt} starts, each on fresh ports, lost to a port clash)"
                    ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self) -> None:
        super().stop()
        self.startup_s.clear()
        self.kv_events.clear()

    def _start_once(self, model: Path) -> list[str]:
        started = time.monotonic()
        ports = free_ports(4 * len(self.specs), self.host)  # all distinct
        for i, spec in enumerate(self.specs):
            python = engine_python(spec.engine, self.env)
            port, nccl, live, replay = ports[4 * i : 4 * i + 4]
            argv = engine_argv(
                spec,
                python,
                model,
                self.host,
                port,
                nccl_port=nccl if spec.engine == "sglang" else None,
                kv_event_ports=(live, replay) if spec.kv_events else None,
            )
            self._workers.append(self._spawn_env(argv, f"worker-{i}", engine_env(spec.engine)))
            self.worker_urls.append(f"http://{self.host}:{port}")
            self.kv_events.append(
                f"{_tcp(self.host, live)},{_tcp(self.host, replay)}" if spec.kv_events else ""
            )
        for i, (url, proc) in enumerate(zip(self.worker_urls, self._workers, strict=True)):
            remaining = max(1.0, self.start_timeout_s - (time.monotonic() - started))
            try:
                wait_healthy(url, remaining, proc)
            except (RuntimeError, TimeoutError) as exc:
                tail = self.log_tail(i)
                kind = _PortClash if "address already in use" in tail.lower() else RuntimeError
                raise kind(f"{exc}; the end of its log:\n{tail}") from exc
            self.startup_s.append(time.monotonic() - started)
        return self.worker_urls

    def _spawn_env(
        self, argv: list[str], name: str, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        os.makedirs(self.log_dir or ".", exist_ok=True)
        with open(Path(self.log_dir or ".") / f"{name}.log", "wb") as log:
            return subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )

    def log_tail(self, index: int, lines: int = 30) -> str:
        try:
            text = self.log_path(index).read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def flush(self, timeout_s: float = 10.0) -> None:
        """Empty every worker's prefix cache (SGLang ``/flush_cache``, vLLM's reset). SGLang
        refuses (400) while a request is in the worker, a health check's one-token
        generation included: asked again until ``timeout_s`` has passed."""
        import urllib.error
        import urllib.request

        for url, spec in zip(self.worker_urls, self.specs, strict=True):
            path = "/flush_cache" if spec.engine == "sglang" else "/reset_prefix_cache"
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    with urllib.request.urlopen(
                        urllib.request.Request(url + path, method="POST"), timeout=30
                    ) as resp:
                        if resp.status == 200:
                            break
                        refused = f"HTTP {resp.status}"
                except urllib.error.HTTPError as exc:
                    if exc.code != 400:
                        raise
                    refused = "HTTP 400 (requests in the worker)"
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"{url} refused to flush its cache: {refused}")
                time.sleep(0.1)

    def kill_worker(self, index: int) -> None:
        """SIGKILL one worker's process group (the engine's every process), as a crash would."""
        proc = self._workers[index]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        proc.wait(timeout=10)

    def alive(self) -> list[bool]:
        return [proc.poll() is None for proc in self._workers]

    def router_alive(self) -> bool:
        return self._router is not None and self._router.poll() is None
