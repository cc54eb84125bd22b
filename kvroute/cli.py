"""The ``kvroute`` command: one parser, one module per subcommand.

``kvroute --help`` names every subcommand without importing any of them (the router, the
simulator and the models pull in numpy, River and scipy: about two seconds); a subcommand's
module is imported only when that subcommand runs or shows its own help.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from kvroute import __version__

__all__ = ["COMMANDS", "HelpFormatter", "build_parser", "main"]

# name -> (module with ``add_parser(sub)``, the one-line help ``kvroute --help`` shows). Each
# module's own parser carries the same line (tests/test_cli_help.py holds them equal).
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "kvroute.serve_command",
        "run the router in front of SGLang/OpenAI-compatible workers",
    ),
    "emulate": ("kvroute.emulate_command", "run one emulated SGLang worker (no GPU)"),
    "sim": ("kvroute.sim_command", "simulate a fleet behind the router (no GPU, no network)"),
    "bench": ("kvroute.bench_command", "open-loop load generator (streams to time TTFT)"),
    "cluster": ("kvroute.cluster_command", "emulated workers + router + traffic, one command"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every flag's help line ends with its default.

    A default that is ``None`` or ``False`` means "off" or "decided elsewhere": the help text
    says what happens then, in words, and nothing is appended.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        if isinstance(default, list | tuple):  # as the flag takes them
            shown = (" " if action.nargs in ("+", "*") else ",").join(str(v) for v in default)
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """Bad input prints usage and the reason, exit status 2 (argparse's convention); help
    shows each flag's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = kwargs.get("formatter_class", argparse.HelpFormatter)
        if given in (argparse.HelpFormatter, argparse.RawDescriptionHelpFormatter):
            kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``command``, only that subcommand's flags are built (and its
    module imported), the others are listed by name and help line (``""``: none built)."""
    parser = _Parser(
        prog="kvroute",
        description="KV-cache-aware, learning-based load balancing for LLM serving. "
        "'kvroute COMMAND --help' lists a command's flags; docs/ has the rest.",
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module, summary) in COMMANDS.items():
        if command is None or command == name:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def _command_in(argv: Sequence[str]) -> str:
    """The subcommand ``argv`` asks for, or ``""`` (``--help``, ``--version``, a typo)."""
    first = next((a for a in argv if not a.startswith("-")), "")
    return first if first in COMMANDS else ""


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_in(arguments))
    args = parser.parse_args(arguments)
    try:
        return int(args.run(args, getattr(args, "command_parser", parser)) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
