"""Prometheus and Grafana files: valid, wired to the compose services, querying real metrics.

The metric-name checks use a live router: one emulated worker and ``kvroute serve`` on
loopback (``sim.local_cluster``), some traffic, then both ``/metrics`` pages. Where
Debian's ``prometheus`` package is installed (``scripts/ensure_docker_tools.sh``), promtool
validates the Prometheus config and every dashboard query's PromQL, and a real Prometheus
scrapes the live router and worker and answers the dashboard's queries.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_support import (
    DOCKER,
    EMULATED_WORKERS,
    GPU_WORKERS,
    REPO,
    control_port,
    listen_port,
    rendered,
    tool,
)
from prometheus_client.parser import text_string_to_metric_families

from sim.local_cluster import LocalCluster, free_port, wait_healthy

DASHBOARD = DOCKER / "grafana" / "dashboards" / "kvroute.json"
PROMETHEUS = DOCKER / "prometheus.yml"
METRICS_DOC = REPO / "docs" / "metrics.md"
NAME = re.compile(r"\b(kvroute_[a-z_]+|sglang:[a-z_:]+)")


def _builder() -> Any:
    spec = importlib.util.spec_from_file_location(
        "build_dashboard", DOCKER / "grafana" / "build_dashboard.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def queried_names() -> set[str]:
    return {m for expr in dashboard_queries() for m in NAME.findall(expr)}


def documented(section: str, pattern: str) -> dict[str, str]:
    """``name -> table row`` for the backticked names that open rows of a docs section."""
    text = METRICS_DOC.read_text()
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    rows = {}
    for line in text[start : end if end != -1 else None].splitlines():
        match = re.match(rf"\| `({pattern})` \|", line)
        if match:
            rows[match.group(1)] = line
    assert rows, f"no metric table under {section!r}"
    return rows


def sglang_documented() -> dict[str, str]:
    return documented("## SGLang metrics we read", r"sglang:[a-z_]+")


# -- files, no live service -----------------------------------------------------------------


def test_dashboard_is_valid_json_and_what_the_builder_writes() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvroute"
    assert DASHBOARD.read_text() == _builder().render(), (
        "docker/grafana/dashboards/kvroute.json is stale: run docker/grafana/build_dashboard.py"
    )
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("routing decisions", "queue load", "hit rate", "time to first token"):
        assert topic in titles, topic
    for topic in ("latency", "model error", "redis fallbacks", "index sync lag"):
        assert topic in titles, topic


def test_dashboard_queries_the_topics_of_the_issue() -> None:
    exprs = dashboard_queries()
    joined = "\n".join(exprs)
    assert "sum by (worker, status) (rate(kvroute_requests_total" in joined
    assert "kvroute_cache_hit_ratio_estimate" in joined
    assert re.search(
        r"rate\(sglang:cached_tokens_total.*\n?.*/.*sglang:prompt_tokens_total", joined
    )
    for histogram in ("kvroute_ttft_seconds", "kvroute_latency_seconds"):
        assert f"histogram_quantile(0.95, sum by (le) (rate({histogram}_bucket" in joined
    for name in ("kvroute_residual_mae_ms", "kvroute_redis_fallbacks_total"):
        assert name in joined
    assert "kvroute_index_sync_lag_seconds_bucket" in joined


def test_dashboard_sglang_metrics_are_documented_sglang_metrics() -> None:
    sglang = {n for n in queried_names() if n.startswith("sglang:")}
    assert sglang, "the dashboard reads the workers' hit rate"
    assert sglang <= set(sglang_documented()), sorted(sglang - set(sglang_documented()))


def test_grafana_provisioning_matches_the_dashboard_and_the_compose_mounts() -> None:
    source = yaml.safe_load(
        (DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    (datasource,) = source["datasources"]
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
    services = rendered()["services"]
    host, port = urllib.parse.urlsplit(datasource["url"]).netloc.split(":")
    assert host == "prometheus"
    assert port == "9090"  # Prometheus' default --web.listen-address
    assert "--web.listen-address" not in " ".join(services[host]["command"])
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/kvroute.yml").read_text())
    (entry,) = provider["providers"]
    mounts = {
        Path(v["source"] if isinstance(v, dict) else v.split(":")[0]).name: (
            v["target"] if isinstance(v, dict) else v.split(":")[1]
        )
        for v in services["grafana"]["volumes"]
    }
    assert mounts["dashboards"] == entry["options"]["path"]
    assert mounts["provisioning"] == "/etc/grafana/provisioning"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == entry["options"]["path"] + "/" + DASHBOARD.name


def test_prometheus_targets_are_compose_services_and_their_ports() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    services = rendered()["services"]
    scraped: set[str] = set()
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            for target in group["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in services, f"{job['job_name']}: {host} is not a compose service"
                service = services[host]
                router = host.startswith("router-")  # its /metrics: the control listener
                expected = control_port(service) if router else listen_port(service)
                assert expected == int(port), target
                scraped.add(host)
    assert {"router-1", "router-2"} | GPU_WORKERS | EMULATED_WORKERS <= scraped
    prometheus = services["prometheus"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert any(
        "prometheus.yml:/etc/prometheus/prometheus.yml" in str(v) for v in prometheus["volumes"]
    )


def _promtool() -> str:
    found = tool("promtool")
    if found is None:
        pytest.skip("promtool is not installed: scripts/ensure_docker_tools.sh installs it")
    return found


def test_promtool_accepts_the_prometheus_config() -> None:
    done = subprocess.run(
        [_promtool(), "check", "config", str(PROMETHEUS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _as_rules(exprs: list[str]) -> str:
    rules = [
        {"record": f"kvroute:dashboard:q{i}", "expr": e.replace("$__rate_interval", "1m")}
        for i, e in enumerate(exprs)
    ]
    return yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    promtool = _promtool()
    rules = tmp_path / "rules.yml"
    rules.write_text(_as_rules(dashboard_queries()))
    done = subprocess.run(
        [promtool, "check", "rules", str(rules)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # ... and the check can fail: a broken query is refused.
    rules.write_text(_as_rules(["sum by (worker (rate(kvroute_requests_total[1m]))"]))
    bad = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, timeout=60, check=False
    )
    assert bad.returncode != 0


# -- a live router and worker ---------------------------------------------------------------


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read()


def _traffic(router: str) -> None:
    prompt = list(range(1, 600))
    for stream in (False, True, True):
        _post(
            router + "/generate",
            {"input_ids": prompt, "stream": stream, "sampling_params": {"max_new_tokens": 4}},
        )
    _post(router + "/v1/completions", {"model": "m", "prompt": "hello " * 50, "max_tokens": 4})


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text: str = resp.read().decode()
    return text


def _names(text: str) -> set[str]:
    """Metric names as queried: histogram families by base name and every sample name."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def _metric_names(text: str) -> set[str]:
    """Names as the docs list them: histograms by base name, counters with ``_total``, and
    without the ``_created`` timestamps (the text parser returns them as families of their
    own)."""
    names = set()
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue
        if family.type in ("histogram", "gauge") or not family.samples:
            names.add(family.name)
        else:
            names.update(s.name for s in family.samples if not s.name.endswith("_created"))
    return names


@pytest.fixture(scope="module")
def live() -> Iterator[dict[str, Any]]:
    with LocalCluster(workers=1, time_scale=20.0) as cluster:
        (worker,) = cluster.start_workers()
        router = cluster.start_router("kvroute", "lbgr")
        control = cluster.control_url
        assert control is not None
        auth = {"Authorization": f"Bearer {cluster.admin_token}"}
        _post(control + "/models/challenger", {"spec": "linear"}, auth)
        _traffic(router)
        yield {
            "cluster": cluster,
            "router": control,  # /metrics is on the control listener
            "worker": worker,
            "router_text": _scrape(control),
            "worker_text": _scrape(worker),
        }


@pytest.mark.slow
def test_every_kvroute_metric_the_dashboard_queries_is_exported(live: dict[str, Any]) -> None:
    exported = _names(live["router_text"])
    wanted = {n for n in queried_names() if n.startswith("kvroute_")}
    assert wanted
    assert wanted <= exported, sorted(wanted - exported)


@pytest.mark.slow
def test_the_metrics_reference_lists_exactly_the_exported_kvroute_metrics(
    live: dict[str, Any],
) -> None:
    exported = {n for n in _metric_names(live["router_text"]) if n.startswith("kvroute_")}
    listed = set(documented("## kvroute_* (the router)", r"kvroute_[a-z_]+"))
    assert exported == listed, {
        "undocumented": exported - listed,
        "not exported": listed - exported,
    }


@pytest.mark.slow
def test_the_emulated_worker_exports_the_sglang_metrics_marked_emulated(
    live: dict[str, Any],
) -> None:
    exported = _names(live["worker_text"])
    marked = {n for n, row in sglang_documented().items() if row.split("|")[3].strip() == "yes"}
    assert marked
    assert marked <= exported, sorted(marked - exported)


def _query(base: str, expr: str) -> dict[str, Any]:
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


@pytest.mark.slow
def test_a_real_prometheus_answers_the_dashboards_queries(
    live: dict[str, Any], tmp_path: Path
) -> None:
    binary = tool("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed: scripts/ensure_docker_tools.sh installs it")
    targets = {
        "kvroute-router": live["router"],
        "emulated-worker": live["worker"],
    }
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [url.split("//")[1]]}]}
            for job, url in targets.items()
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address={base.split('//')[1]}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(base, 60, proc, path="/-/ready")
        # Traffic between scrapes, so every rate() has two points that differ; the router's
        # and the worker's counters are scraped on their own schedules, so wait for both.
        deadline = time.monotonic() + 60
        while True:
            _traffic(live["router"])
            time.sleep(0.5)
            empty = []
            for expr in dashboard_queries():
                answer = _query(base, expr.replace("$__rate_interval", "30s"))
                assert answer["status"] == "success", (expr, answer)
                if not answer["data"]["result"]:
                    empty.append(expr)
            if not empty or time.monotonic() > deadline:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # Every panel has data, even with one replica, no Redis and no failed request.
    assert not empty, empty
