"""The emulated cluster agrees with the simulator on the same configuration.

Both run the same engine (``sim.engine.WorkerEngine``), radix cache and service profile; the
simulator in simulated time, the emulated cluster in scaled real time behind the real router
over HTTP. With ``round_robin`` routing the i-th request goes to the same worker in both, so
each worker sees the same prompts in the same order.
"""

from __future__ import annotations

import asyncio

import pytest

from sim.cluster import ClusterConfig, simulate
from sim.loadgen import BenchConfig, benchmark
from sim.local_cluster import LocalCluster
from sim.report import summarize
from sim.workloads import GSPConfig, GSPWorkload

TIME_SCALE = 2.0


@pytest.mark.slow
def test_emulated_cluster_agrees_with_the_simulator() -> None:
    """Hit rate within 10% (relative) and p50 latency within 25% of ``simulate()``.

    Why they still differ:

    - Tokenisation is identical: the load generator sends ``input_ids``, so both see the same
      token sequences and the radix caches make the same matches; the hit rate differs only
      if timing changes what is cached when a request is admitted (a group's prefix enters
      the tree when the first of its requests finishes prefill), which a low rate makes rare.
    - Latency: every emulated request also pays real HTTP (client -> router -> worker and
      back, JSON of up to 8k token ids) and event-loop wake-up delays, and this wall time
      counts ``TIME_SCALE`` times in emulated seconds. On a loaded 2-core machine that is
      ~5-10 ms of wall time a request: ~+10% at 2x (and about +25% at 5x, +100% at 10x,
      which is why this test runs at 2x). The simulator has only the profile's modelled
      5 ms request overhead; the emulator charges it too, counting the wall time it spent
      reading and parsing the request toward it (the rest of the HTTP path stays extra).
    - Scheduling jitter: arrivals leave the client a few ms late or early, so batches form
      slightly differently; with 48 requests the p50 moves by a few percent.
    """
    workload = GSPWorkload(GSPConfig(num_groups=8, prompts_per_group=6, rate=2.0, seed=1))
    simulated = summarize(
        simulate(ClusterConfig(workers=2, policy="round_robin", eviction="lru"), workload)
    )
    with LocalCluster(workers=2, eviction="lru", time_scale=TIME_SCALE) as cluster:
        cluster.start_workers()
        url = cluster.start_router("kvroute", "round_robin")
        cluster.warm_up()  # its first request is slow; the counter moves by one (symmetric)
        config = BenchConfig(url=url, time_scale=TIME_SCALE, worker_urls=list(cluster.worker_urls))
        emulated, _ = asyncio.run(
            benchmark(list(workload), config, policy="round_robin", eviction="lru")
        )
    assert (emulated["completed"], emulated["failed"]) == (48, 0)
    assert simulated["hit_rate"] > 0.2  # the workload does reuse prefixes
    assert emulated["hit_rate"] == pytest.approx(simulated["hit_rate"], rel=0.10)
    assert emulated["p50_latency_s"] == pytest.approx(simulated["p50_latency_s"], rel=0.25)
    # Each worker served its half of the requests (round robin over two workers).
    assert [w["requests"] for w in emulated["per_worker"]] == [24, 24]
