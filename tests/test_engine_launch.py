"""``kvroute.engine_launch`` and ``kvroute cluster --engine``, without starting an engine.

The engines themselves run in the real-engine tier (``tests/engine_real``,
``scripts/test_real_engine.sh``); here: the command lines and environments they get, what is
refused, and the error a user without the engines' set-up sees.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.engine_launch import (
    EngineCluster,
    EngineEnvMissing,
    EngineSpec,
    engine_argv,
    engine_env,
    engine_python,
    fit_to_vocab,
    free_ports,
    model_dir,
)


def _venv(root: Path, marker: str) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin/python").touch()
    (root / marker).touch()
    return root


def test_sglang_argv_has_the_cpu_flags_and_the_backend() -> None:
    argv = engine_argv(EngineSpec(max_total_tokens=2000), Path("/v/python"), Path("/m"), "h", 1)
    assert argv[:3] == ["/v/python", "-m", "sglang.launch_server"]
    joined = " ".join(argv)
    for flag in (
        "--device cpu",
        "--attention-backend torch_native",
        "--max-total-tokens 2000",
        "--radix-cache-backend rlt",
        "--enable-metrics",
        "--enable-cache-report",
        "--model-path /m",
        "--host h --port 1",
    ):
        assert flag in joined
    lru = engine_argv(EngineSpec(radix_cache_backend=None), Path("p"), Path("m"), "h", 1)
    assert "--radix-cache-backend" not in lru


def test_sglang_argv_pins_its_ports_and_publishes_kv_events() -> None:
    spec = EngineSpec(kv_events=True)
    argv = engine_argv(
        spec, Path("p"), Path("m"), "127.0.0.1", 1, nccl_port=7, kv_event_ports=(8, 9)
    )
    assert argv[argv.index("--nccl-port") + 1] == "7"
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config == {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:8",
        "bind": True,
        "replay_endpoint": "tcp://127.0.0.1:9",
    }
    ipv6 = engine_argv(spec, Path("p"), Path("m"), "::1", 1, kv_event_ports=(8, 9))
    assert json.loads(ipv6[ipv6.index("--kv-events-config") + 1])["endpoint"] == "tcp://[::1]:8"
    assert "--nccl-port" not in ipv6
    with pytest.raises(ValueError, match="kv_event_ports"):
        engine_argv(spec, Path("p"), Path("m"), "h", 1)
    with pytest.raises(ValueError, match="SGLang's publisher"):
        EngineSpec("vllm", None, kv_events=True)


def test_free_ports_are_distinct_and_out_of_the_kernels_way() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16
    # Below the ephemeral range, where no outgoing connection takes one as its local port
    # before the worker given it binds it (how an SGLang worker once lost its KV-event port).
    # Where the range leaves no room below it (under 1,000 ports), the kernel picks.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low - 20000 >= 1000:
        assert all(20000 <= port < low for port in ports)


def test_no_port_is_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even when the draw would pick the same candidates again (a port handed out may not be
    bound yet: it is still free)."""
    import sim.local_cluster

    monkeypatch.setattr(sim.local_cluster.random, "sample", lambda ports, k: list(ports)[:k])
    first, second = free_ports(3), free_ports(3)
    assert not set(first) & set(second)


# Stands in for an engine's interpreter: the first start dies as SGLang does when a port it
# was given is taken; later starts serve /health on the given port.
_FLAKY_ENGINE = """import http.server, pathlib, sys
argv = sys.argv
starts = pathlib.Path(argv[0]).with_name("starts")
count = int(starts.read_text()) if starts.exists() else 0
starts.write_text(str(count + 1))
pathlib.Path(argv[0]).with_name(f"argv-{count}").write_text("\\n".join(argv))
if count < {clashes}:
    print("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:1')", flush=True)
    sys.exit(1)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Health).serve_forever()
"""


def _flaky_engine(root: Path, clashes: int) -> dict[str, str]:
    venv = _venv(root / "venv", ".kvroute-real-engine")
    python = venv / "bin/python"
    python.write_text(f"#!{sys.executable}\n" + _FLAKY_ENGINE.replace("{clashes}", str(clashes)))
    python.chmod(0o755)
    (root / "model").mkdir()
    (root / "model/config.json").write_text("{}")
    return {"KVROUTE_ENGINE_VENV": str(venv), "KVROUTE_TINY_MODEL": str(root / "model")}


def test_a_start_lost_to_a_port_clash_is_retried_on_fresh_ports(tmp_path: Path) -> None:
    env = _flaky_engine(tmp_path, clashes=1)
    spec = EngineSpec(kv_events=True)
    with EngineCluster(specs=(spec,), env=env, log_dir=str(tmp_path / "logs")) as cluster:
        (url,) = cluster.start_workers()
        bin_dir = tmp_path / "venv/bin"
        assert (bin_dir / "starts").read_text() == "2"
        first, second = ((bin_dir / f"argv-{i}").read_text().split("\n") for i in range(2))
        flags = ("--port", "--nccl-port", "--kv-events-config")
        for flag in flags:
            assert first[first.index(flag) + 1] != second[second.index(flag) + 1]
        assert url.endswith(f":{second[second.index('--port') + 1]}")
        config = json.loads(second[second.index("--kv-events-config") + 1])
        assert cluster.kv_events == [f"{config['endpoint']},{config['replay_endpoint']}"]
        assert len(cluster.startup_s) == 1


def test_a_clash_on_every_start_is_an_error_that_says_so(tmp_path: Path) -> None:
    env = _flaky_engine(tmp_path, clashes=5)
    with (
        EngineCluster(
            specs=(EngineSpec(),), env=env, log_dir=str(tmp_path / "logs"), start_attempts=2
        ) as cluster,
        pytest.raises(RuntimeError, match=r"2 starts, each on fresh ports") as raised,
    ):
        cluster.start_workers()
    assert "Address already in use" in str(raised.value)
    assert (tmp_path / "venv/bin/starts").read_text() == "2"
    assert cluster.worker_urls == []


def test_vllm_argv_and_env() -> None:
    argv = engine_argv(EngineSpec("vllm", None), Path("p"), Path("/m"), "h", 2)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-prefix-caching" in argv
    env = engine_env("vllm", {"PYTHONPATH": "/router", "OMP_NUM_THREADS": "2"})
    assert env["OMP_NUM_THREADS"] == "2"  # the user's choice stays
    assert "PYTHONPATH" not in env
    assert env["HF_HUB_OFFLINE"] == "1"


def test_sglang_env_switches_the_cpu_engine_on() -> None:
    env = engine_env("sglang", {})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"


def test_specs_refuse_rlt_on_vllm_and_unknown_engines() -> None:
    with pytest.raises(ValueError, match="SGLang"):
        EngineSpec("vllm", "rlt")
    with pytest.raises(ValueError, match="sglang, vllm"):
        EngineSpec("tgi")
    assert EngineSpec().label == "sglang-rlt"
    assert EngineSpec(radix_cache_backend=None).label == "sglang-lru"


def test_missing_environment_names_the_setup_script(tmp_path: Path) -> None:
    env = {"KVROUTE_ENGINE_VENV": str(tmp_path / "none"), "KVROUTE_TINY_MODEL": str(tmp_path)}
    with pytest.raises(EngineEnvMissing, match=r"scripts/real_engine_setup\.sh"):
        engine_python("sglang", env)
    with pytest.raises(EngineEnvMissing, match=r"real_engine_setup\.sh --vllm"):
        engine_python("vllm", {"KVROUTE_VLLM_VENV": str(tmp_path)})
    with pytest.raises(EngineEnvMissing, match="tiny model"):
        model_dir(env)
    # A half-built virtualenv (no marker of the finished set-up) is missing too.
    (tmp_path / "half/bin").mkdir(parents=True)
    (tmp_path / "half/bin/python").touch()
    with pytest.raises(EngineEnvMissing):
        engine_python("sglang", {"KVROUTE_ENGINE_VENV": str(tmp_path / "half")})
    venv = _venv(tmp_path / "ok", ".kvroute-real-engine")
    assert engine_python("sglang", {"KVROUTE_ENGINE_VENV": str(venv)}) == venv / "bin/python"


def test_fit_to_vocab_keeps_shared_prefixes() -> None:
    a = fit_to_vocab([5, 128000, 77, 1], 1000)
    b = fit_to_vocab([5, 128000, 77, 2], 1000)
    assert a[:3] == b[:3]
    assert a[3] != b[3]
    assert all(4 <= i < 1000 for i in a + b)
    with pytest.raises(ValueError, match="no ids"):
        fit_to_vocab([1], 4)


def test_cluster_without_the_engines_says_how_to_install_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVROUTE_ENGINE_VENV", str(tmp_path / "none"))
    assert main(["cluster", "--engine", "sglang", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "scripts/real_engine_setup.sh" in err
    assert "not installed" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--eviction", "rlt"], "SGLang radix-cache backend"),
        (["--capacity-tokens", "100"], "VLLM_CPU_KVCACHE_SPACE"),
    ],
)
def test_cluster_refuses_what_vllm_cannot_do(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["cluster", "--engine", "vllm", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
