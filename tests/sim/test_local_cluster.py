"""``LocalCluster`` stops its workers however the process running it is asked to stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from sim.local_cluster import LocalCluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Starts one emulated worker, prints its pid, then blocks until a signal arrives.
HOLDER = textwrap.dedent(
    """
    import signal
    from sim.local_cluster import LocalCluster

    with LocalCluster(workers=1, time_scale=10.0) as cluster:
        cluster.start_workers()
        print(cluster._workers[0].pid, flush=True)
        signal.pause()
    """
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_to_the_process_running_a_cluster_stops_its_workers() -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    worker = 0
    try:
        assert holder.stdout is not None
        worker = int(holder.stdout.readline())
        assert alive(worker)
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=30) == 128 + signal.SIGTERM
        assert not alive(worker), "the emulated worker outlived the process that started it"
    finally:
        holder.kill()
        holder.wait()
        if worker and alive(worker):
            os.killpg(worker, signal.SIGKILL)


def test_the_sigterm_handler_lasts_as_long_as_the_cluster() -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with LocalCluster(workers=0):
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
            with pytest.raises(SystemExit) as stopped:
                signal.raise_signal(signal.SIGTERM)
            assert stopped.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_handler_the_program_set_is_left_alone() -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with LocalCluster(workers=0):
            assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
