"""docker/docker-compose.yml: valid for every profile, wired the way the docs say.

No Docker engine here: ``docker-compose config`` validates and renders the file, and the
checks below read the rendered result (anchors merged, variables substituted).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
from compose_support import (
    ALWAYS,
    DOCKER,
    EMULATED_WORKERS,
    GPU_ENV,
    GPU_WORKERS,
    PROFILES,
    ROUTER_DOCKERFILE,
    SNAPSHOT_KEY,
    TOKEN,
    active_services,
    dockerfile_instructions,
    environment,
    listen_port,
    published,
    rendered,
    run_config,
    url_host_port,
)

from kvroute.cli import build_parser
from router_service.settings import Settings, load_settings


@pytest.fixture(scope="module")
def configs() -> dict[str | None, dict[str, Any]]:
    return {profile: rendered(profile) for profile in PROFILES}


@pytest.mark.parametrize("profile", PROFILES, ids=["no-profile", "gpu", "emulated"])
def test_config_is_valid_and_starts_the_profiles_services(
    configs: dict[str | None, dict[str, Any]], profile: str | None
) -> None:
    services = active_services(configs[profile], profile)
    expected = set(ALWAYS)
    if profile == "gpu":
        expected |= GPU_WORKERS
    elif profile == "emulated":
        expected |= EMULATED_WORKERS
    assert services == expected
    for name in services:  # nothing the profile starts waits on a service it does not start
        depends = configs[profile]["services"][name].get("depends_on") or {}
        assert set(depends) <= services, (name, depends)


def test_the_admin_token_and_the_snapshot_key_are_required() -> None:
    done = run_config(KVROUTE_MODEL_SNAPSHOT_KEY=SNAPSHOT_KEY)
    assert done.returncode != 0
    assert "KVROUTE_ADMIN_TOKEN" in done.stderr
    done = run_config(KVROUTE_ADMIN_TOKEN=TOKEN)
    assert done.returncode != 0
    assert "KVROUTE_MODEL_SNAPSHOT_KEY" in done.stderr


def test_routers_default_to_the_emulated_workers(
    configs: dict[str | None, dict[str, Any]],
) -> None:
    services = configs["emulated"]["services"]
    for router in ("router-1", "router-2"):
        urls = environment(services[router])["KVROUTE_WORKER_URLS"].split(",")
        hosts = {url_host_port(u) for u in urls}
        assert {h for h, _ in hosts} == EMULATED_WORKERS
        for host, port in hosts:
            assert listen_port(services[host]) == port


def test_gpu_env_points_the_routers_at_the_sglang_workers() -> None:
    config = rendered("gpu", env_file=GPU_ENV)
    services = config["services"]
    for router in ("router-1", "router-2"):
        urls = environment(services[router])["KVROUTE_WORKER_URLS"].split(",")
        hosts = {url_host_port(u) for u in urls}
        assert {h for h, _ in hosts} == GPU_WORKERS
        for host, port in hosts:
            assert port == listen_port(services[host]) == 30000
            assert services[host]["profiles"] == ["gpu"]


def test_router_replicas_share_redis_and_cluster_with_distinct_ids(
    configs: dict[str | None, dict[str, Any]],
) -> None:
    services = configs[None]["services"]
    one, two = (environment(services[r]) for r in ("router-1", "router-2"))
    for key in ("KVROUTE_REDIS_URL", "KVROUTE_CLUSTER", "KVROUTE_WORKER_URLS"):
        assert one[key] == two[key], key
    assert one["KVROUTE_ADMIN_TOKEN"] == two["KVROUTE_ADMIN_TOKEN"] == TOKEN
    assert one["KVROUTE_REPLICA_ID"] != two["KVROUTE_REPLICA_ID"]
    host, port = url_host_port(one["KVROUTE_REDIS_URL"])
    assert host in services
    assert port == 6379
    assert one["KVROUTE_LOG_PROMPTS"] == "false"
    for router in ("router-1", "router-2"):
        assert services[router]["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("router", ["router-1", "router-2"])
def test_router_environment_is_accepted_by_the_settings_model(
    configs: dict[str | None, dict[str, Any]], router: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = environment(configs[None]["services"][router])
    fields = {f"KVROUTE_{name.upper()}" for name in Settings.model_fields}
    assert set(env) <= fields, f"not settings: {sorted(set(env) - fields)}"
    for key in [k for k in os.environ if k.startswith("KVROUTE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = load_settings(None, host="0.0.0.0", port=8000)  # the image's CMD flags
    assert settings.replica_id == router
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == TOKEN
    assert settings.redis_url == "redis://redis:6379/0"
    assert len(settings.worker_urls) == 4
    for url in settings.worker_urls:  # the allow-list lets POST /workers re-add any of them
        assert settings.worker_allowed(url)
    assert settings.model_snapshot_path is not None
    assert settings.snapshot_key() == SNAPSHOT_KEY.encode()
    assert not settings.log_prompts


def test_emulated_worker_commands_parse_and_match_the_health_url(
    configs: dict[str | None, dict[str, Any]],
) -> None:
    parser = build_parser()
    for name in EMULATED_WORKERS:
        service = configs["emulated"]["services"][name]
        command = service["command"]
        assert command[:2] == ["kvroute", "emulate"]
        args = parser.parse_args(command[1:])
        assert (args.host, args.port, args.eviction) == ("0.0.0.0", 30000, "rlt")
        assert args.time_scale == 1.0
        health = environment(service)["KVROUTE_HEALTH_URL"]
        assert url_host_port(health) == ("127.0.0.1", args.port)


def test_the_router_image_cmd_parses() -> None:
    cmd = [json.loads(a) for i, a in dockerfile_instructions(ROUTER_DOCKERFILE) if i == "CMD"]
    assert cmd == [["kvroute", "serve", "--host", "0.0.0.0", "--port", "8000"]]
    args = build_parser().parse_args(cmd[0][1:])
    assert (args.host, args.port) == ("0.0.0.0", 8000)


def test_gpu_workers_each_reserve_one_distinct_gpu(
    configs: dict[str | None, dict[str, Any]],
) -> None:
    services = configs["gpu"]["services"]
    devices = []
    for name in sorted(GPU_WORKERS):
        service = services[name]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert "gpu" in device["capabilities"]
        (device_id,) = device["device_ids"]
        devices.append(device_id)
        env = environment(service)
        assert env["MODEL_PATH"] == "meta-llama/Llama-3.1-8B-Instruct"
        assert "HF_TOKEN" in env
        mounts = [
            v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in service["volumes"]
        ]
        assert any(":/root/.cache/huggingface" in m for m in mounts), mounts
        assert service["build"]["dockerfile"] == "docker/worker.Dockerfile"
        assert service["build"]["args"]["SGLANG_TAG"] == "v0.5.23"
        assert "/health" in " ".join(service["healthcheck"]["test"])
        assert service["ipc"] == "host"
    assert len(set(devices)) == len(devices) == 4


def test_gpu_variables_are_substituted() -> None:
    config = rendered("gpu", env_file=GPU_ENV)
    worker = config["services"]["sglang-worker-3"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["2"]


def test_redis_persists_to_a_volume(configs: dict[str | None, dict[str, Any]]) -> None:
    redis = configs[None]["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    volumes = [
        v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in redis["volumes"]
    ]
    assert any(v.startswith("redis-data:/data") for v in volumes), volumes
    assert "redis-data" in configs[None]["volumes"]
    assert "redis-cli" in redis["healthcheck"]["test"]


def _nginx() -> str:
    return re.sub(r"#.*", "", (DOCKER / "nginx.conf").read_text())


def _location(conf: str, selector: str) -> str:
    match = re.search(rf"location\s+{re.escape(selector)}\s*\{{(.*?)\n    \}}", conf, re.S)
    assert match is not None, selector
    return match.group(1)


def test_balancer_round_robins_both_replicas_without_buffering(
    configs: dict[str | None, dict[str, Any]],
) -> None:
    services = configs[None]["services"]
    balancer = services["balancer"]
    assert any("nginx.conf:/etc/nginx/conf.d/default.conf" in str(v) for v in balancer["volumes"])
    conf = _nginx()
    assert conf.count("{") == conf.count("}")
    upstream = re.search(r"upstream\s+(\w+)\s*\{(.*?)\}", conf, re.S)
    assert upstream is not None
    servers = re.findall(r"server\s+([\w.-]+):(\d+)", upstream.group(2))
    assert sorted(servers) == [("router-1", "8000"), ("router-2", "8000")]
    for host, port in servers:
        assert listen_port(services[host]) == int(port)
    root = _location(conf, "/")
    assert f"proxy_pass http://{upstream.group(1)};" in root
    assert "proxy_buffering off;" in root
    # Generation is not idempotent: another replica only when the first was unreachable.
    assert "proxy_next_upstream error timeout;" in root
    listen = re.search(r"listen\s+(\d+);", conf)
    assert listen is not None
    assert int(listen.group(1)) in {target for _, _, target in published(balancer)}


def test_balancer_finds_recorded_decisions_and_refuses_the_control_plane() -> None:
    conf = _nginx()
    explain = _location(conf, "^~ /explain/")
    assert "http_404" in explain  # ask the next replica: the decision lives in one of them
    control = _location(conf, "~ ^/(workers|policy|models)(/|$)")
    assert "return 403" in control
    assert "docs/operations.md" in control


def test_replicas_publish_their_control_plane_on_loopback_only(
    configs: dict[str | None, dict[str, Any]],
) -> None:
    services = configs[None]["services"]
    ports = {name: published(services[name]) for name in ("router-1", "router-2")}
    assert ports == {
        "router-1": [("127.0.0.1", 8001, 8001)],
        "router-2": [("127.0.0.1", 8002, 8001)],
    }
