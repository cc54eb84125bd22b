"""Workload flags shared by ``kvroute sim``, ``bench`` and ``cluster``, and the builder.

One set of flags builds every workload (``docs/design.md``, *Workloads*): ``gsp`` (the
paper's synthetic shared prefixes), ``multiturn`` (ShareGPT/UltraChat-like clients),
``longdoc`` (LooGLE-like), ``trace`` (Mooncake JSONL replay), ``azure`` (Azure CSV arrivals)
and ``cyclic`` (LRU's worst case). Generators need no files; ``--dataset`` and ``--trace``
read real text or traffic by path.
"""

from __future__ import annotations

import argparse
from typing import Any

from sim.profiles import get_profile
from sim.workloads import (
    GROUP_ORDERS,
    CyclicConfig,
    CyclicWorkload,
    GSPConfig,
    GSPWorkload,
    LongDocConfig,
    LongDocWorkload,
    MultiTurnConfig,
    MultiTurnWorkload,
    RequestList,
    load_azure,
    load_mooncake,
)

__all__ = ["WORKLOADS", "add_workload_arguments", "build_workload", "describe_workload"]

WORKLOADS = ("gsp", "multiturn", "longdoc", "trace", "azure", "cyclic")
ORDERED = ("gsp", "longdoc")  # the workloads that take --order
TRACES = ("trace", "azure")
DEFAULT_PROFILE = "llama3.1-8b-l40"  # the service model a command without --profile sizes by


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def int_list(minimum: int) -> Any:
    """A parser of comma-separated integers, each >= ``minimum``."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers, got {text!r}"
            ) from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                "lengths must be integers >= 2" if minimum == 2 else f"values must be >= {minimum}"
            )
        return values

    return parse


def add_workload_arguments(p: argparse.ArgumentParser, *, fleet: bool = True) -> None:
    """The workload flags; ``fleet``: the command also takes ``--capacity-tokens`` and
    ``--profile`` (``sim``, ``cluster``), which size the cyclic workload by default."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="gsp", help="workload generator")
    g.add_argument(
        "--order", choices=GROUP_ORDERS, default="random", help="gsp and longdoc arrival order"
    )
    g.add_argument(
        "--rate",
        type=positive_float,
        default=12.0,
        help="mean arrival rate, requests per second (Poisson arrivals)",
    )
    g.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help="send at most this many requests (default: the whole workload)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and the fleet")
    g.add_argument("--output-len", type=positive_int, default=4, help="output tokens per request")
    g.add_argument(
        "--dataset",
        default=None,
        metavar="PATH",
        help="multiturn: a ShareGPT-format JSON/JSONL file; longdoc: a LooGLE-format JSONL file "
        "(default: synthetic tokens)",
    )
    g.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="trace: a Mooncake JSONL file; azure: an Azure LLM inference CSV (no default: "
        "those workloads need it)",
    )
    g.add_argument(
        "--gsp-groups",
        type=positive_int,
        default=128,
        help="gsp: groups of prompts sharing a prefix",
    )
    g.add_argument(
        "--gsp-prompts-per-group", type=positive_int, default=32, help="gsp: prompts per group"
    )
    g.add_argument(
        "--gsp-prefix-ratio",
        type=float,
        default=0.5,
        help="gsp: share of each prompt that is its group's common prefix, in (0, 1)",
    )
    g.add_argument(
        "--gsp-lens",
        type=int_list(2),
        default=(512, 1024, 2048, 4096, 8192),
        help="gsp: total prompt lengths in tokens, cycled over groups, comma-separated",
    )
    g.add_argument(
        "--clients", type=positive_int, default=128, help="multiturn: concurrent chat clients"
    )
    g.add_argument(
        "--turns",
        type=int_list(1),
        default=(2, 4, 6, 8),
        help="multiturn: turns per client, cycled over clients",
    )
    g.add_argument(
        "--user-len", type=positive_int, default=1024, help="multiturn: tokens per user message"
    )
    g.add_argument("--docs", type=positive_int, default=128, help="longdoc: documents (at most)")
    g.add_argument(
        "--questions-per-doc",
        type=positive_int,
        default=8,
        help="longdoc: synthetic questions per document",
    )
    g.add_argument(
        "--max-questions",
        type=positive_int,
        default=100,
        help="longdoc: questions per document read from --dataset",
    )
    g.add_argument(
        "--doc-lens",
        type=int_list(1),
        default=(1024, 2048, 4096, 8192),
        help="longdoc: document lengths cycled over documents",
    )
    g.add_argument(
        "--cyclic-capacity",
        type=positive_int,
        default=None,
        help="cyclic: the KV capacity in tokens the cycle overflows (default: "
        + (
            "--capacity-tokens, else the --profile's)"
            if fleet
            else f"{get_profile(DEFAULT_PROFILE).kv_capacity_tokens}, the {DEFAULT_PROFILE} "
            "profile's)"
        ),
    )
    g.add_argument(
        "--cyclic-ratio", type=positive_float, default=1.1, help="cyclic: cycle tokens / capacity"
    )
    g.add_argument(
        "--cyclic-prompt-len", type=positive_int, default=1024, help="cyclic: tokens per prompt"
    )
    g.add_argument(
        "--cyclic-cycles", type=positive_int, default=5, help="cyclic: passes over the cycle"
    )


def build_workload(args: argparse.Namespace) -> RequestList | GSPWorkload:
    """The workload the flags describe; a bad data file raises ``WorkloadFileError``."""
    kind = args.workload
    if kind == "gsp":
        config = GSPConfig(
            num_groups=args.gsp_groups,
            prompts_per_group=args.gsp_prompts_per_group,
            prefix_ratio=args.gsp_prefix_ratio,
            total_lens=args.gsp_lens,
            output_len=args.output_len,
            order=args.order,
            rate=args.rate,
            seed=args.seed,
        )
        return GSPWorkload(config, limit=args.requests)
    if kind == "multiturn":
        turns = MultiTurnConfig(
            num_clients=args.clients,
            turns=args.turns,
            user_len=args.user_len,
            output_len=args.output_len,
            rate=args.rate,
            seed=args.seed,
            dataset=args.dataset,
        )
        return MultiTurnWorkload(turns, limit=args.requests)
    if kind == "longdoc":
        docs = LongDocConfig(
            num_docs=args.docs,
            questions_per_doc=args.questions_per_doc,
            max_questions=args.max_questions,
            doc_lens=args.doc_lens,
            output_len=args.output_len,
            order=args.order,
            rate=args.rate,
            seed=args.seed,
            dataset=args.dataset,
        )
        return LongDocWorkload(docs, limit=args.requests)
    if kind in TRACES:
        load = load_mooncake if kind == "trace" else load_azure
        scale = getattr(args, "trace_time_scale", 1.0)
        return load(args.trace, time_scale=scale, limit=args.requests, seed=args.seed)
    capacity = (
        args.cyclic_capacity
        or getattr(args, "capacity_tokens", None)
        or get_profile(getattr(args, "profile", DEFAULT_PROFILE)).kv_capacity_tokens
    )
    cycle = CyclicConfig(
        capacity_tokens=capacity,
        ratio=args.cyclic_ratio,
        prompt_len=args.cyclic_prompt_len,
        output_len=args.output_len,
        cycles=args.cyclic_cycles,
        rate=args.rate,
        seed=args.seed,
    )
    return CyclicWorkload(cycle, limit=args.requests)


def check_workload_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Usage errors that argparse cannot see (exit 2 with the reason)."""
    if args.workload in TRACES and not args.trace:
        parser.error(f"--workload {args.workload} needs --trace PATH")
    if args.trace and args.workload not in TRACES:
        parser.error("--trace is for --workload trace or azure")
    if args.dataset and args.workload not in ("multiturn", "longdoc"):
        parser.error("--dataset is for --workload multiturn or longdoc")
    if not 0.0 < args.gsp_prefix_ratio < 1.0:
        parser.error("--gsp-prefix-ratio must be in (0, 1)")


def describe_workload(args: argparse.Namespace) -> dict[str, Any]:
    """The summary keys that say which workload ran (``workload``, ``order``, ``rate``...)."""
    out: dict[str, Any] = {"workload": args.workload}
    if args.workload in ORDERED:
        out["order"] = args.order
    if args.workload in TRACES:
        out["trace"] = args.trace
        out["time_scale"] = getattr(args, "trace_time_scale", 1.0)
    else:
        out["rate"] = args.rate
    if args.dataset and args.workload in ("multiturn", "longdoc"):
        out["dataset"] = args.dataset
    return out
