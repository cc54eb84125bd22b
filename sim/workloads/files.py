"""Reading workload files (traces, datasets) with errors that name the file and the line.

A loader that meets a malformed record raises ``WorkloadFileError`` (a ``ValueError``)
whose message starts ``PATH:LINE:`` like a compiler's, so a user can open the file at the
bad line; the CLI turns it into a usage error (exit status 2).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["WorkloadFileError", "field", "iter_jsonl", "read_json", "read_lines"]


class WorkloadFileError(ValueError):
    """A workload file is missing, unreadable or malformed; ``line`` is 1-based, or None."""

    def __init__(self, path: str | Path, line: int | None, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {reason}")


def read_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its newline) for every line of a text file."""
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                yield number, line.rstrip("\r\n")
    except OSError as exc:
        raise WorkloadFileError(path, None, f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise WorkloadFileError(path, None, f"not UTF-8 text: {exc}") from None


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(line number, object) for every non-blank line of a JSON-lines file."""
    for number, line in read_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadFileError(path, number, f"not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise WorkloadFileError(path, number, f"expected a JSON object, got {_kind(obj)}")
        yield number, obj


def read_json(path: str | Path) -> Any:
    """A whole JSON document; a syntax error names its line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadFileError(path, None, f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise WorkloadFileError(path, None, f"not UTF-8 text: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadFileError(path, exc.lineno, f"not valid JSON ({exc.msg})") from None


def field(
    obj: Mapping[str, Any], name: str, kind: type | tuple[type, ...], path: str | Path, line: int
) -> Any:
    """``obj[name]``, checked to be of ``kind`` (bools are not numbers here)."""
    if name not in obj:
        raise WorkloadFileError(path, line, f"missing field {name!r}")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise WorkloadFileError(
            path, line, f"field {name!r} should be {_names(kind)}, got {value!r}"
        )
    return value


def _kind(obj: Any) -> str:
    return type(obj).__name__


def _names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)
