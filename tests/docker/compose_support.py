"""What the deployment tests share: the repository's docker/ files and ``docker-compose config``.

Debian's ``docker-compose`` (1.29, the Python one) renders and validates a compose file
without a Docker engine; ``scripts/ensure_docker_tools.sh`` installs it. Where it is missing
and cannot be installed, the tests that need it skip and say so.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
GPU_ENV = DOCKER / "gpu.env"
ROUTER_DOCKERFILE = DOCKER / "router.Dockerfile"
WORKER_DOCKERFILE = DOCKER / "worker.Dockerfile"
TOKEN = "compose-test-token"
SNAPSHOT_KEY = "compose-test-snapshot-key-0123456789"
PROFILES = (None, "gpu", "emulated")
ALWAYS = {"redis", "router-1", "router-2", "balancer", "prometheus", "grafana"}
GPU_WORKERS = {f"sglang-worker-{i}" for i in range(1, 5)}
EMULATED_WORKERS = {f"emulated-worker-{i}" for i in range(1, 5)}


def tool(name: str) -> str | None:
    """A command on PATH, or in the cache directory scripts/ensure_docker_tools.sh fills."""
    cache = os.environ.get("KVROUTE_TOOLS_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvroute" / "tools"
    )
    return shutil.which(name) or shutil.which(name, path=str(Path(cache) / "bin"))


def compose_binary() -> str:
    found = tool("docker-compose")
    if found is None:
        pytest.skip(
            "docker-compose is not installed: run scripts/ensure_docker_tools.sh (installs "
            "Debian's docker-compose as root) to validate docker/docker-compose.yml"
        )
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a compose run: no KVROUTE_*/compose variables from the shell."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVROUTE_", "COMPOSE_", "SGLANG_", "EMULATED_"))
        and k not in {"MODEL_PATH", "HF_CACHE_DIR", "HF_TOKEN", "REDIS_MAXMEMORY"}
    }
    env.update(extra)
    return env


def run_config(
    profile: str | None = None, env_file: Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """``docker-compose [--env-file F] [--profile P] -f docker/docker-compose.yml config``."""
    args = [compose_binary()]
    if env_file is not None:
        args += ["--env-file", str(env_file)]
    if profile is not None:
        args += ["--profile", profile]
    args += ["-f", str(COMPOSE), "config"]
    return subprocess.run(
        args,
        env=clean_env(**env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def rendered(profile: str | None = None, env_file: Path | None = None) -> dict[str, Any]:
    """The compose file as docker-compose resolves it (anchors merged, variables set)."""
    done = run_config(
        profile, env_file, KVROUTE_ADMIN_TOKEN=TOKEN, KVROUTE_MODEL_SNAPSHOT_KEY=SNAPSHOT_KEY
    )
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


def active_services(config: dict[str, Any], profile: str | None) -> set[str]:
    """What ``up`` starts with this profile: services without profiles, and the profile's."""
    return {
        name
        for name, service in config["services"].items()
        if not service.get("profiles") or (profile in service["profiles"])
    }


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def control_port(service: dict[str, Any]) -> int:
    """The port a router service's control listener (and /metrics) is on: its
    KVROUTE_CONTROL_PORT, else its data port + 1 (``kvroute serve``'s default)."""
    env = environment(service)
    if "KVROUTE_CONTROL_PORT" in env:
        return int(env["KVROUTE_CONTROL_PORT"])
    return listen_port(service) + 1


def listen_port(service: dict[str, Any]) -> int:
    """The port a kvroute/SGLang service listens on: its --port, else the image's default."""
    command = service.get("command") or []
    if isinstance(command, str):
        command = command.split()
    if "--port" in command:
        return int(command[command.index("--port") + 1])
    dockerfile = service.get("build", {}).get("dockerfile", "")
    if dockerfile.endswith("worker.Dockerfile"):
        return 30000
    if dockerfile.endswith("router.Dockerfile"):
        return 8000
    raise AssertionError(f"no known listening port for {service}")


def published(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host address, host port, container port) of each published port, either syntax."""
    out = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            out.append(
                (port.get("host_ip", "0.0.0.0"), int(port["published"]), int(port["target"]))
            )
            continue
        parts = str(port).split("/")[0].split(":")
        host = parts[0] if len(parts) == 3 else "0.0.0.0"
        out.append((host, int(parts[-2]), int(parts[-1])))
    return out


def url_host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise AssertionError(f"{url!r} has no host:port")
    return parts.hostname, parts.port


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    out = []
    for line in lines:
        match = re.match(r"(\w+)\s+(.*)", line)
        assert match, line
        out.append((match.group(1).upper(), match.group(2)))
    return out
