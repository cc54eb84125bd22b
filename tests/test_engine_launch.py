"""``kvroute.engine_launch`` and ``kvroute cluster --engine``, without starting an engine.

The engines themselves run in the real-engine tier (``tests/engine_real``,
``scripts/test_real_engine.sh``); here: the command lines and environments they get, what is
refused, and the error a user without the engines' set-up sees.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.engine_launch import (
    EngineEnvMissing,
    EngineSpec,
    engine_argv,
    engine_env,
    engine_python,
    fit_to_vocab,
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
