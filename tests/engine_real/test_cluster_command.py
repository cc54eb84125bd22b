"""``kvroute cluster --engine sglang``: real workers and the router in one command, all
stopped by one Ctrl-C."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from real_traffic import post_json


def _refuses(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=1):
            return False
    except OSError:
        return True


def _lines(stream: object, sink: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        sink.append(line)


def test_one_command_starts_real_workers_and_ctrl_c_stops_them(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute", "cluster", "--engine", "sglang", "--workers", "2",
         "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    out: list[str] = []
    err: list[str] = []
    readers = [
        threading.Thread(target=_lines, args=(proc.stdout, out), daemon=True),
        threading.Thread(target=_lines, args=(proc.stderr, err), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        router = None
        deadline = time.monotonic() + 400
        while router is None and time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"serves on (http://\S+)", "".join(out))
            router = found.group(1) if found else None
            time.sleep(0.2)
        assert router is not None, f"no router line; stderr:\n{''.join(err)[-3000:]}"
        ready_s = time.monotonic() - started
        workers = re.search(r"workers healthy after \d+ s: (.+)", "".join(err))
        assert workers is not None
        worker_urls = workers.group(1).split()
        print(f"\nkvroute cluster --engine sglang --workers 2: serving after {ready_s:.0f} s")
        assert len(worker_urls) == 2
        with urllib.request.urlopen(router + "/health", timeout=10) as resp:
            health = json.loads(resp.read())
        assert health["healthy_workers"] == 2
        body = {"model": "tiny-llama", "prompt": "Red river stone", "max_tokens": 8}
        answer = post_json(router + "/v1/completions", body)
        assert answer["usage"]["completion_tokens"] >= 1
        logs = sorted(tmp_path.glob("worker-*.log"))
        assert len(logs) == 2
        for log in logs:  # SGLang loaded kvroute's backend through its plugin entry point
            assert "kvroute RLT radix cache active" in log.read_text(errors="replace")
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    for reader in readers:
        reader.join(timeout=5)
    assert code == 0, "".join(err)[-2000:]
    assert "stopped every worker and the router" in "".join(err)
    assert _refuses(router)
    for url in worker_urls:
        assert _refuses(url), f"{url} still answers after Ctrl-C"
