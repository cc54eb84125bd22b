"""The tables of REPRODUCTION.md: fleet tables, bands, sensitivity, sweeps, fleet sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _common import format_ratio, ratio
from reproduction_bands import Band, pair_band, pair_values, pass_points, pct, workers_bands, x
from reproduction_rows import BASELINE, MAIN_TABLES, OURS, Row, find, rows_in

from sim.profiles import get_profile
from sim.report import FLEET_METRIC_COLUMNS, markdown_table

NOT_GIVEN = "not given here"
FLEET_COLUMNS = (("policy", "policy", "{}"), *FLEET_METRIC_COLUMNS)


def _text(found: Band | None, fmt: Any) -> str:
    return "none" if found is None else found.text(fmt)


def compare(rows: Sequence[Row]) -> dict[str, Any]:
    """cache_aware+lru over lbgr_paper+rlt: the paper's headline ratios on one table."""
    base, ours = find(rows, *BASELINE), find(rows, *OURS)
    gain = ratio(ours["throughput_rps"], base["throughput_rps"])
    best = min(r["p50_latency_s"] for r in rows)
    return {
        "p50": format_ratio(base["p50_latency_s"], ours["p50_latency_s"]),
        "ttft": format_ratio(base["p50_ttft_s"], ours["p50_ttft_s"]),
        "throughput": "n/a" if gain is None else f"{gain - 1:+.1%}",
        "fastest": ", ".join(
            f"{r['policy']}+{r['eviction']}" for r in rows if r["p50_latency_s"] == best
        ),
    }


# -- bands per workload ------------------------------------------------------------------------
def bands_section(rows: Sequence[Row], layout: dict[str, Any]) -> str:
    titles = {k: layout["fleet"][k]["title"] for k in MAIN_TABLES}
    titles["gsp_ids"] = "GSP (random order), token matching (prompts sent as ids)"
    lines = []
    for key in (*MAIN_TABLES, "gsp_ids"):
        table = f"band:{key}"
        lines.append(
            {
                "workload": titles[key],
                "p50": _text(pair_band(rows, table, "p50"), x),
                "ttft": _text(pair_band(rows, table, "ttft"), x),
                "throughput": _text(pair_band(rows, table, "throughput"), pct),
            }
        )
    columns = (
        ("workload", "workload", "{}"),
        ("p50 latency ratio", "p50", "{}"),
        ("p50 TTFT ratio", "ttft", "{}"),
        ("throughput, lbgr_paper+rlt vs cache_aware+lru", "throughput", "{}"),
    )
    commands = "\n".join(f"- `{cmd}`" for cmd in layout["bands"].values())
    return (
        markdown_table(lines, columns)
        + "\n\nCommands (S = seed 0-4, X = speed 0.8, 1 or 1.2; at 1 the flag is left out, at "
        "seed 0 `--seed`):\n\n" + commands + "\n\n" + per_run_table(rows, layout)
    )


def per_run_table(rows: Sequence[Row], layout: dict[str, Any]) -> str:
    """Every run of the bands: p50 of both sides and the ratio, by workload, speed and seed."""
    lines = []
    for key in (*MAIN_TABLES, "gsp_ids"):
        title = layout["fleet"][key]["title"] if key in MAIN_TABLES else "GSP, token matching"
        for (seed, speed), (b, o) in pair_values(rows, f"band:{key}").items():
            lines.append(
                {
                    "workload": title,
                    "speed": f"{speed:g}x",
                    "seed": seed,
                    "base": f"{b['p50_latency_s']:.2f} / {b['p95_latency_s']:.2f}",
                    "base_hit": b["hit_rate"],
                    "ours": f"{o['p50_latency_s']:.2f} / {o['p95_latency_s']:.2f}",
                    "ours_hit": o["hit_rate"],
                    "ratio": format_ratio(b["p50_latency_s"], o["p50_latency_s"]),
                }
            )
    columns = (
        ("workload", "workload", "{}"),
        ("speed", "speed", "{}"),
        ("seed", "seed", "{}"),
        ("cache_aware+lru p50 / p95 (s)", "base", "{}"),
        ("hit", "base_hit", "{:.3f}"),
        ("lbgr_paper+rlt p50 / p95 (s)", "ours", "{}"),
        ("hit", "ours_hit", "{:.3f}"),
        ("p50 ratio", "ratio", "{}"),
    )
    return (
        "<details><summary>Every run of the bands</summary>\n\n"
        + markdown_table(lines, columns)
        + "\n\n</details>\n"
    )


# -- the fleet tables, sensitivity, sweeps, workers ----------------------------------------------
def fleet_section(rows: Sequence[Row], layout: dict[str, Any], key: str) -> str:
    table = layout["fleet"][key]
    sub = rows_in(rows, key)
    c = compare(sub)
    return "\n".join(
        [
            f"### {table['title']}\n",
            f"`{table['command']}`\n",
            markdown_table(sub, FLEET_COLUMNS) + "\n",
            (
                f"- offline hit-rate ceiling (unlimited capacity, any routing): "
                f"**{table['ceiling']:.3f}**"
            ),
            (
                f"- cache_aware+lru / lbgr_paper+rlt: p50 latency {c['p50']}, p50 TTFT "
                f"{c['ttft']}, throughput {c['throughput']}; lowest p50: {c['fastest']}"
            ),
            f"- the paper's absolute figures for this benchmark: {NOT_GIVEN}\n",
        ]
    )


def sensitivity_section(rows: Sequence[Row], layout: dict[str, Any]) -> str:
    """cache_aware's settings on GSP next to lbgr_paper, characters (headline) or tokens."""
    sens = [r for r in rows if r["table"] == "sensitivity"]
    tokens = "paper preset, token matching (ids)"
    groups = [
        (
            "cache_aware, paper preset, characters (headline)",
            rows_in(rows, "gsp"),
            None,
            "cache_aware",
        ),
        ("cache_aware, paper preset, tokens", sens, tokens, "cache_aware"),
        ("cache_aware, threshold 0.51, characters", sens, "threshold 0.51", "cache_aware"),
        (
            "cache_aware, sglang preset (0.3 / 64 / 1.5), characters",
            sens,
            "sglang preset (0.3 / 64 / 1.5)",
            "cache_aware",
        ),
        ("lbgr_paper, characters (headline)", rows_in(rows, "gsp"), None, "lbgr_paper"),
        ("lbgr_paper, tokens", sens, tokens, "lbgr_paper"),
    ]
    picked = [
        dict(r, variant=label)
        for label, source, variant, policy in groups
        for r in source
        if r["policy"] == policy and (variant is None or r.get("variant") == variant)
    ]
    columns = (("setting", "variant", "{}"), *FLEET_COLUMNS[1:])
    commands = "\n".join(f"- {label}: `{cmd}`" for label, cmd in layout["sensitivity"].items())
    return markdown_table(picked, columns) + "\n\n" + commands + "\n"


def _ratio_cell(rlt: float, lru: float) -> str:
    if lru == 0:
        return "none (lru 0)" if rlt > 0 else "none (both 0)"
    return format_ratio(rlt, lru)


def sweep_points(rows: Sequence[Row], layout: dict[str, Any], key: str) -> list[Row]:
    sweep = layout["sweeps"][key]
    sub = rows_in(rows, f"sweep:{key}")
    points = []
    for capacity in sweep["capacities"]:
        pair = {r["eviction"]: r for r in sub if r["capacity_tokens"] == capacity}
        lru, rlt = pair["lru"]["hit_rate"], pair["rlt"]["hit_rate"]
        bound = sweep["bounds"][capacity]
        points.append(
            {
                "capacity": f"{capacity:,}"
                + (" (paper default)" if pair["lru"]["paper_default"] else ""),
                "paper_default": pair["lru"]["paper_default"],
                "factor": pair["lru"]["capacity_factor"],
                "lru": lru,
                "rlt": rlt,
                "ratio": _ratio_cell(rlt, lru),
                "bound": bound,
                "ceiling": sweep["ceiling"],
                "rlt_of_bound": f"{rlt / bound:.0%}" if bound else "n/a",
                "lru_p50": pair["lru"]["p50_latency_s"],
                "rlt_p50": pair["rlt"]["p50_latency_s"],
            }
        )
    return points


SWEEP_COLUMNS = (
    ("capacity (tokens)", "capacity", "{}"),
    ("x working set", "factor", "{:.2f}"),
    ("lru hit", "lru", "{:.3f}"),
    ("rlt hit", "rlt", "{:.3f}"),
    ("rlt/lru", "ratio", "{}"),
    ("offline bound", "bound", "{:.3f}"),
    ("rlt / bound", "rlt_of_bound", "{}"),
    ("ceiling", "ceiling", "{:.3f}"),
    ("lru p50 (s)", "lru_p50", "{:.1f}"),
    ("rlt p50 (s)", "rlt_p50", "{:.1f}"),
)


def sweep_section(rows: Sequence[Row], layout: dict[str, Any], key: str) -> str:
    sweep = layout["sweeps"][key]
    caps = ", ".join(f"{c:,}" for c in sweep["capacities"])
    return "\n".join(
        [
            f"`{sweep['command']}` with C in {caps}\n",
            (
                f"Reusable working set: {sweep['working_set']:,} tokens (distinct tokens that some "
                f"later prompt reuses; `sim.ceiling`); one round_robin pass puts "
                f"{sweep['cycle_tokens']:,} tokens in the tree.\n"
            ),
            markdown_table(sweep_points(rows, layout, key), SWEEP_COLUMNS) + "\n",
            (
                "(rlt/lru: only where both hit; `none (lru 0)` where lru hits nothing; rlt / "
                "bound: how much of the offline upper bound rlt reaches.)\n"
            ),
        ]
    )


def pass_section(rows: Sequence[Row], layout: dict[str, Any], table: str = "pass") -> str:
    """GSP round_robin, one worker, around one pass, over the bands (``pass_refresh``: on
    SGLang 0.5.23's scheduler)."""
    lines = []
    for p in pass_points(rows, table):
        lines.append(
            {
                "factor": f"{p['factor']:g}",
                "lru": _text(p["lru"], lambda v: f"{v:.3f}"),
                "rlt": _text(p["rlt"], lambda v: f"{v:.3f}"),
                "ratio": _text(p["ratio"], x) + f"; lru 0 in {p['lru_zero']} of {p['runs']}",
                "throughput": _text(p["throughput"], pct),
            }
        )
    columns = (
        ("capacity / one pass", "factor", "{}"),
        ("lru hit", "lru", "{}"),
        ("rlt hit", "rlt", "{}"),
        ("rlt/lru where both hit", "ratio", "{}"),
        ("throughput, rlt vs lru", "throughput", "{}"),
    )
    one_pass = next(iter(layout[table]["passes"].values()))
    return (
        f"`{layout[table]['command']}` (PASS = {one_pass:,} tokens for every seed; F in "
        f"{', '.join(f'{f:g}' for f in layout[table]['factors'])})\n\n"
        + markdown_table(lines, columns)
        + "\n"
    )


def workers_section(rows: Sequence[Row], layout: dict[str, Any]) -> str:
    table = []
    for r in workers_bands(rows):
        table.append(
            {
                "workers": r["workers"],
                "base": _text(r["base_p50"], lambda v: f"{v:.2f}"),
                "ours": _text(r["ours_p50"], lambda v: f"{v:.2f}"),
                "p50": _text(r["p50"], x),
                "base_rps": _text(r["base_rps"], lambda v: f"{v:.2f}"),
                "ours_rps": _text(r["ours_rps"], lambda v: f"{v:.2f}"),
                "throughput": _text(r["throughput"], pct),
            }
        )
    columns = (
        ("workers", "workers", "{}"),
        ("cache_aware+lru p50 (s)", "base", "{}"),
        ("lbgr_paper+rlt p50 (s)", "ours", "{}"),
        ("p50 ratio", "p50", "{}"),
        ("cache_aware+lru req/s", "base_rps", "{}"),
        ("lbgr_paper+rlt req/s", "ours_rps", "{}"),
        ("throughput gain", "throughput", "{}"),
    )
    counts = layout["workers"]["counts"]
    return (
        f"`{layout['workers']['command']}` for N in {counts[0]}..{counts[-1]}\n\n"
        + markdown_table(table, columns)
        + "\n"
    )


def routing_ceiling_section(rows: Sequence[Row], layout: dict[str, Any]) -> str:
    """Every router on GSP with a capacity nothing is evicted from (section 6)."""
    ceiling = layout["routing_ceiling"]
    return (
        f"`{ceiling['command']}` ({ceiling['capacity_tokens']:,} tokens a worker: every prompt "
        "and output token of the workload)\n\n"
        + markdown_table(rows_in(rows, "routing_ceiling"), FLEET_COLUMNS)
        + f"\n\n- offline ceiling (any routing, one tree): "
        f"**{layout['fleet']['gsp']['ceiling']:.3f}**\n"
    )


def trace_section(layout: dict[str, Any]) -> str:
    trace = layout["trace"]
    if trace is None:
        return "The Mooncake sample is not in `../shared/data` here: section skipped.\n"
    return (
        f"`{trace['command']}` (offline part only; `--ceiling` prints the same ceiling)\n\n"
        f"- {trace['requests']:,} requests, {trace['prompt_tokens']:,} prompt tokens\n"
        f"- block hit ratio from `hash_ids` alone (a block counts when its id was seen "
        f"before): **{trace['block_hit_ratio']:.3f}** (the source says ~64%)\n"
        f"- token hit-rate ceiling of the replay (unlimited capacity, last-token rule): "
        f"**{trace['ceiling']:.3f}**; reusable working set {trace['reusable_tokens']:,} tokens\n"
        "- the replay keeps the trace's prefix structure exactly: "
        "`tests/sim/test_workloads_trace.py` checks that a one-worker, unlimited-capacity "
        "simulation reaches the hit ratio computed from `hash_ids`.\n"
    )


def profile_table() -> str:
    p = get_profile("llama3.1-8b-l40")
    items = [
        ("KV capacity per worker", f"{p.kv_capacity_tokens:,} tokens"),
        ("chunked prefill / max running", f"{p.chunked_prefill_tokens} / {p.max_running_requests}"),
        ("T_w (weights read per step)", f"{p.weight_ms} ms"),
        (
            "beta (KV read per context token per decode step)",
            f"{p.kv_read_ms_per_token * 1000:.2f} us",
        ),
        ("b (per running sequence)", f"{p.per_seq_ms} ms"),
        (
            "a (prefill, per new token)",
            f"{p.prefill_ms_per_token} ms (~{1000 / p.prefill_ms_per_token:,.0f} tok/s)",
        ),
        ("c (prefill attention, per new x context token)", f"{p.attn_ms_per_token_pair:g} ms"),
        ("o_step / o_req", f"{p.step_overhead_ms} ms / {p.request_overhead_ms} ms"),
    ]
    return "\n".join(["| parameter | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in items)])
