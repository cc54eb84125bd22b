"""The ``kvroute`` command: one parser, one module per subcommand."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvroute import __version__

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """Bad input prints usage and the reason, exit status 2 (argparse's convention)."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvroute",
        description="KV-cache-aware, learning-based load balancing for LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    from kvroute import (
        bench_command,
        cluster_command,
        emulate_command,
        serve_command,
        sim_command,
    )

    serve_command.add_parser(sub)
    emulate_command.add_parser(sub)
    sim_command.add_parser(sub)
    bench_command.add_parser(sub)
    cluster_command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args, getattr(args, "command_parser", parser)) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
