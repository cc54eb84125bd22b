"""REPRODUCTION.md's judgements: no ratio over an LRU that hit nothing, bands and verdicts, the
throughput test of "gains vanish", a plan whose every command parses, and a page whose every
placeholder is filled."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import reproduction
from reproduction_bands import (
    Band,
    pass_max_band,
    pass_points,
    ratio_of,
    vanish_verdict,
    verdict,
    workers_bands,
)
from reproduction_plan import workload_of
from reproduction_rows import POLICIES

from kvroute.cli import build_parser
from kvroute.sim_command import cluster_config


# -- bands and verdicts -------------------------------------------------------------------------
def test_verdicts_judge_the_paper_figure_against_the_band() -> None:
    assert verdict(6.92, Band((5.9, 6.6, 7.3))) == "reproduced"
    assert verdict(11.96, Band((1.3, 1.9, 2.1, 12.0))) == "inside band"  # only at its edge
    assert verdict(11.96, Band((1.3, 4.8))) == "not reproduced"
    assert verdict(1.774, None) == "not reproduced"
    assert ratio_of(0.4, 0.0) is None
    assert ratio_of(0.0, 0.0) is None
    assert ratio_of(0.4, 0.1) == pytest.approx(4.0)


def _pass_row(seed: int, factor: float, eviction: str, hit: float, rps: float) -> dict[str, Any]:
    return {
        "table": "pass",
        "seed": seed,
        "speed": 1.0,
        "pass_factor": factor,
        "eviction": eviction,
        "hit_rate": hit,
        "throughput_rps": rps,
    }


def test_one_pass_ratios_skip_every_run_where_lru_hit_nothing() -> None:
    rows = [
        _pass_row(0, 0.99, "lru", 0.0, 2.5),
        _pass_row(0, 0.99, "rlt", 0.42, 4.0),
        _pass_row(0, 1.0, "lru", 0.06, 2.6),
        _pass_row(0, 1.0, "rlt", 0.42, 4.1),
        _pass_row(1, 0.99, "lru", 0.0, 2.5),
        _pass_row(1, 0.99, "rlt", 0.40, 3.9),
        _pass_row(1, 1.0, "lru", 0.0, 2.5),
        _pass_row(1, 1.0, "rlt", 0.41, 4.0),
    ]
    points = {p["factor"]: p for p in pass_points(rows)}
    assert points[0.99]["ratio"] is None
    assert points[0.99]["lru_zero"] == 2
    assert points[1.0]["ratio"] == Band((0.42 / 0.06,))
    hit = pass_max_band(rows, "ratio")
    assert hit == Band((0.42 / 0.06,))  # seed 1 never has both: no value, not an "inf"
    gains = pass_max_band(rows, "throughput")
    assert gains is not None
    assert gains.values == pytest.approx((4.0 / 2.5, 4.0 / 2.5))


def _workers_rows(gains: dict[int, float]) -> list[dict[str, Any]]:
    rows = []
    for n, gain in gains.items():
        for seed in (0, 1):
            common = {"table": "workers", "workers": n, "seed": seed, "speed": 1.0}
            rows.append(
                dict(
                    common,
                    policy="cache_aware",
                    eviction="lru",
                    throughput_rps=10.0,
                    p50_latency_s=2.0,
                    p50_ttft_s=1.0,
                )
            )
            rows.append(
                dict(
                    common,
                    policy="lbgr_paper",
                    eviction="rlt",
                    throughput_rps=10.0 * gain,
                    p50_latency_s=1.0,
                    p50_ttft_s=1.0,
                )
            )
    return rows


def test_gains_vanish_is_a_throughput_test_that_can_fail() -> None:
    held = workers_bands(_workers_rows({2: 1.3, 4: 1.004, 6: 1.0, 8: 0.998}))
    assert vanish_verdict(held) == (
        "reproduced",
        "throughput gains (outside +-1%) at 2 worker(s); none from 4 workers on",
    )
    late = workers_bands(_workers_rows({2: 1.3, 6: 1.0, 7: 1.05}))
    assert vanish_verdict(late)[0] == "not reproduced"
    never = workers_bands(_workers_rows({2: 1.0, 6: 1.0}))
    assert vanish_verdict(never)[0] == "inside band"  # latency ratios alone do not count


# -- the plan ------------------------------------------------------------------------------------
def test_every_planned_command_parses_and_runs_the_papers_set_up() -> None:
    tasks, layout = reproduction.plan(reproduction.Scale(quick=True))
    parser = build_parser("sim")
    for task in tasks:
        args = parser.parse_args(["sim", *task.workload, *task.fleet])
        if task.table != "sensitivity":
            assert args.prompt_format == "text" or task.table == "band:gsp_ids"
        assert args.rlt_marking == (
            "path" if task.table.startswith(("marking", "pass_marking")) else "split"
        )
        # SGLang 0.4.6's scheduler, the paper's; 0.5.23's beside the one-pass study only
        refresh = task.table == "pass_refresh"
        assert args.waiting_refresh == ("on" if refresh else "off")
        assert cluster_config(args, task.policy, task.eviction).refresh_waiting is refresh
    assert {t.policy for t in tasks} >= {"cache_aware", "lbgr_paper", "round_robin"}
    assert "lbgr" not in {t.policy for t in tasks}
    assert "threshold 0.51" not in " ".join(layout["bands"].values())
    assert {t.table for t in tasks} >= {
        "pass",
        "workers",
        "cyclic_band",
        "band:gsp",
        "band:gsp_ids",
        "routing_ceiling",
    }
    ceiling = [t for t in tasks if t.table == "routing_ceiling"]
    assert {t.policy for t in ceiling} == set(POLICIES)
    capacity = layout["routing_ceiling"]["capacity_tokens"]
    workload = workload_of(ceiling[0].workload)
    assert capacity == sum(len(r.prompt) + r.max_new_tokens for r in workload)  # nothing evicted


# -- the page ------------------------------------------------------------------------------------
def test_the_page_is_the_template_with_every_placeholder_filled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every ``$name`` of ``reproduction_template.md`` gets a value (``substitute`` refuses a
    missing one), each value lands on the page, and none is left over."""
    import argparse
    import string

    import reproduction_page

    sections = (
        "headline",
        "headline_verdict",
        "profile_table",
        "fleet_section",
        "bands_section",
        "marking_note",
        "sensitivity_section",
        "sweep_section",
        "pass_section",
        "workers_section",
        "routing_ceiling_section",
        "trace_section",
        "capacity_note",
        "strict_threshold",
    )
    for name in sections:
        monkeypatch.setattr(reproduction_page, name, lambda *a, _n=name: f"<{_n}>")
    figures = {k: f"<figure {k}>" for k in ("latency", "hit", "pass", "sweep", "workers")}
    timing = {"jobs": 2, "wall_s": 3600.0, "simulations": 9, "date": "D", "commit": "c0ffee"}
    timing["dirty"] = False
    args = argparse.Namespace(quick=False)
    page = reproduction_page.render([], {"fleet": {"gsp": {}}}, figures, args, timing)
    template = string.Template(reproduction_page.TEMPLATE.read_text())
    assert template.is_valid()
    assert "$" not in page
    for name in sections:
        assert f"<{name}>" in page, name
    for shown in figures.values():
        assert f"({shown})" in page
    assert "**60 min** wall" in page
    assert "\n\n\n" not in page
