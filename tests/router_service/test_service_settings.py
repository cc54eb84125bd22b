"""Settings: flags > ``KVROUTE_*`` env > YAML file > defaults; bad values name the field;
and ``kvroute serve`` end to end as a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fake_worker import FakeWorker
from router_harness import ADMIN_TOKEN, free_port, http_client

from kvroute.cli import main
from router_service.settings import Settings, SettingsError, load_settings


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("KVROUTE_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def config(tmp_path: Path) -> Callable[[dict[str, Any]], Path]:
    def write(values: dict[str, Any]) -> Path:
        path = tmp_path / "kvroute.yaml"
        path.write_text(yaml.safe_dump(values))
        return path

    return write


def test_defaults(clean_env: pytest.MonkeyPatch) -> None:
    settings = load_settings()
    assert settings.policy == "lbgr"
    assert settings.port == 8000
    assert settings.worker_urls == []
    assert settings.redis_url is None
    assert settings.admin_token is None


def test_flags_beat_env_beat_yaml(
    clean_env: pytest.MonkeyPatch, config: Callable[[dict[str, Any]], Path]
) -> None:
    path = config(
        {
            "policy": "random",
            "cluster": "from-yaml",
            "port": 1234,
            "worker-urls": ["http://10.0.0.1:30001", "http://10.0.0.2:30001/"],
            "health_interval_s": 7.5,
        }
    )
    assert load_settings(path).policy == "random"
    clean_env.setenv("KVROUTE_POLICY", "round_robin")
    clean_env.setenv("KVROUTE_CLUSTER", "from-env")
    settings = load_settings(path)
    assert settings.policy == "round_robin"  # env beats YAML
    assert settings.cluster == "from-env"
    assert settings.port == 1234  # YAML beats the default
    assert settings.health_interval_s == 7.5
    assert settings.worker_urls == ["http://10.0.0.1:30001", "http://10.0.0.2:30001"]
    settings = load_settings(path, policy="cache_aware", cluster=None, port=4321)
    assert settings.policy == "cache_aware"  # a flag beats env
    assert settings.cluster == "from-env"  # an unset flag (None) does not
    assert settings.port == 4321


def test_config_file_from_env(
    clean_env: pytest.MonkeyPatch, config: Callable[[dict[str, Any]], Path]
) -> None:
    clean_env.setenv("KVROUTE_CONFIG", str(config({"replica_id": "r7"})))
    assert load_settings().replica_id == "r7"


def test_env_lists_and_secrets(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KVROUTE_WORKER_URLS", "http://a:1, http://b:2/ http://c:3")
    clean_env.setenv("KVROUTE_ADMIN_TOKEN", "s3cret")
    clean_env.setenv("KVROUTE_REDIS_URL", "redis://user:hunter2@h:6379/0")
    clean_env.setenv("KVROUTE_POLICY_PARAMS", '{"preset": "paper"}')
    settings = load_settings()
    assert settings.worker_urls == ["http://a:1", "http://b:2", "http://c:3"]
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == "s3cret"
    assert settings.policy_params == {"preset": "paper"}
    shown = settings.redacted()
    assert shown["admin_token"] == "***"
    assert "hunter2" not in str(shown)
    assert "s3cret" not in str(shown)
    assert "s3cret" not in repr(settings)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        ({"port": -5}, "port"),
        ({"port": 70000}, "port"),
        ({"worker_urls": ["ftp://x:1"]}, "worker_urls"),
        ({"worker_urls": ["http://a:1", "http://a:1/"]}, "worker_urls"),
        ({"worker_urls": ["http://u:p@a:1"]}, "worker_urls"),
        ({"model_sharing": "sometimes"}, "model_sharing"),
        ({"redis_url": "http://localhost:6379"}, "redis_url"),
        ({"health_interval_s": 0}, "health_interval_s"),
        ({"max_body_bytes": 10}, "max_body_bytes"),
        ({"explain_buffer": 0}, "explain_buffer"),
        ({"no_such_setting": 1}, "no_such_setting"),
    ],
)
def test_bad_flag_names_the_field(
    clean_env: pytest.MonkeyPatch, flags: dict[str, Any], field: str
) -> None:
    with pytest.raises(SettingsError, match=field):
        load_settings(**flags)


def test_bad_env_names_the_field(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KVROUTE_PORT", "eighty")
    with pytest.raises(SettingsError, match="port"):
        load_settings()


def test_bad_yaml_names_the_field(
    clean_env: pytest.MonkeyPatch, config: Callable[[dict[str, Any]], Path]
) -> None:
    with pytest.raises(SettingsError, match="polcy"):
        load_settings(config({"polcy": "lbgr"}))
    with pytest.raises(SettingsError, match="redis_timeout_ms"):
        load_settings(config({"redis_timeout_ms": -1}))
    with pytest.raises(SettingsError, match="load_sync_ms"):
        load_settings(config({"load_sync_ms": -1}))


def test_load_sync_interval_defaults_to_5_ms_and_0_means_round_trips(
    clean_env: pytest.MonkeyPatch,
) -> None:
    assert load_settings().load_sync_ms == 5.0
    clean_env.setenv("KVROUTE_LOAD_SYNC_MS", "0")
    assert load_settings().load_sync_ms == 0.0
    clean_env.setenv("KVROUTE_LOAD_SYNC_MS", "5000")
    with pytest.raises(SettingsError, match="load_sync_ms"):
        load_settings()


@pytest.mark.parametrize(
    ("text", "message"),
    [("- a\n- b\n", "mapping"), ("policy: [unclosed\n", "cannot read"), (None, "cannot read")],
)
def test_unreadable_config_file(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, text: str | None, message: str
) -> None:
    path = tmp_path / "config.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SettingsError, match=message):
        load_settings(path)


def test_empty_config_file_means_defaults(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_settings(path).model_dump() == load_settings().model_dump()


def test_settings_are_frozen(clean_env: pytest.MonkeyPatch) -> None:
    settings = Settings()
    with pytest.raises(ValueError, match="frozen"):
        settings.policy = "random"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "-5"], "port"),
        (["--port", "x"], "--port"),
        (["--worker-urls", "not-a-url"], "worker_urls"),
        (["--policy-params", "{bad"], "--policy-params"),
        (["--policy-params", "[1]"], "JSON object"),
        (["--redis-url", "http://h:1"], "redis_url"),
        (["--policy", "no-such-policy"], "unknown policy"),
        (["--policy-params", '{"alpha": "fast"}'], "alpha must be a number"),
        (["--model-sharing", "sometimes"], "--model-sharing"),
    ],
)
def test_serve_usage_errors_exit_2(
    clean_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvroute serve")
    assert message in err


@pytest.fixture
def serve_process(
    tmp_path: Path, workers: Callable[..., FakeWorker]
) -> Iterator[tuple[subprocess.Popen[bytes], str, str, FakeWorker]]:
    """``kvroute serve`` as a real process: YAML for the workers, env for the token, flags
    for the port and policy."""
    worker = workers("w")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"worker_urls": [worker.url], "policy": "random"}))
    port, control_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["KVROUTE_ADMIN_TOKEN"] = ADMIN_TOKEN
    env["KVROUTE_POLICY"] = "round_robin"
    env["KVROUTE_CONTROL_PORT"] = str(control_port)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvroute",
            "serve",
            "--config",
            str(path),
            "--port",
            str(port),
            "--policy",
            "lbgr",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{control_port}", worker
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.slow
def test_kvroute_serve_runs_the_router(
    serve_process: tuple[subprocess.Popen[bytes], str, str, FakeWorker],
) -> None:
    proc, url, control_url, worker = serve_process
    with http_client(url, timeout_s=5) as client:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvroute serve did not come up"
            time.sleep(0.1)
        health = client.get("/health").json()
        assert health["policy"] == "lbgr"  # the flag beat env and YAML
        assert health["workers"].keys() == {"w0"}  # from YAML; by label on the data port
        resp = client.post("/generate", json={"text": "hello"})
        assert resp.status_code == 200
        assert resp.headers["X-KVRoute-Worker"] == "w0"
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert client.get("/workers", headers=auth).status_code == 404  # not on this port
    with http_client(control_url, timeout_s=5) as control:
        assert control.get("/workers").status_code == 401  # token from env
        listed = control.get("/workers", headers=auth).json()["workers"]
        assert [(w["url"], w["label"]) for w in listed] == [(worker.url, "w0")]
        assert control.get("/health").json()["workers"].keys() == {worker.url}
    os.killpg(proc.pid, signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal it caught (uvicorn >= 0.29).
    assert proc.wait(15) in (0, -signal.SIGTERM)
    output = proc.stdout.read().decode() if proc.stdout else ""
    assert "Traceback" not in output, output
