"""The README's commands run as written, after the quick start, in one shell, top to bottom.

Every ```bash block is run in order by one ``bash -e`` from the repository's root, with a
PATH that does not include ``.venv/bin`` (the README must activate it), except the commands
listed in ``NOT_RUN``, which are too slow or need what a test machine does not have; each of
those must still appear in the README (so the list cannot go stale) and be covered elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# command prefix -> why it is not run here (and where it is tested instead)
NOT_RUN = {
    "./scripts/demo.sh": "the demo itself: kvroute cluster, tests/test_cli_cluster.py",
    "./scripts/test.sh": "the test suite this test is part of",
    "docker compose": "needs a Docker engine; tests/docker validates the compose file",
    "scripts/real_engine_setup.sh": "minutes of set-up: scripts/test_real_engine.sh (CI) runs it",
    "kvroute cluster --engine": "real engines: tests/engine_real/test_cluster_command.py",
}
PORTS = (8000, 8001, 30001, 30002)  # the README's own router and workers


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined; comment-only lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [
        line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]


def split(text: str) -> tuple[list[str], dict[str, list[str]]]:
    run: list[str] = []
    skipped: dict[str, list[str]] = {prefix: [] for prefix in NOT_RUN}
    for block in bash_blocks(text):
        for command in commands(block):
            prefix = next((p for p in NOT_RUN if command.startswith(p)), None)
            if prefix is None:
                run.append(command)
            else:
                skipped[prefix].append(command)
    return run, skipped


def busy(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_the_quick_start_comes_first_and_the_skip_list_is_current() -> None:
    text = README.read_text()
    first = commands(bash_blocks(text)[0])
    assert [c.split("#")[0].strip() for c in first] == ["./scripts/demo.sh", "./scripts/test.sh"]
    _, skipped = split(text)
    assert all(skipped.values()), f"NOT_RUN names commands the README no longer has: {skipped}"


def test_every_example_the_readme_names_exists() -> None:
    for path in re.findall(r"python (examples/\w+\.py)", README.read_text()):
        assert (ROOT / path).is_file(), path


@pytest.mark.slow
def test_the_readme_commands_run_as_written() -> None:
    if any(busy(port) for port in PORTS):
        pytest.skip(f"a port the README's router uses ({PORTS}) is taken on this machine")
    run, _ = split(README.read_text())
    assert run[0] == "source .venv/bin/activate"  # the first command after the quick start
    script = "set -e\n" + "\n".join(run) + "\n"
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT / ".venv"))
    )
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):  # what the README left in the background
            os.killpg(proc.pid, signal.SIGTERM)
    assert proc.returncode == 0, out[-4000:]
    assert "| lbgr | rlt |" in out  # kvroute sim's table
    assert "outcome: status=ok" in out  # examples/explain.py
    assert '"text"' in out  # the emulated worker's answer through the README's router
