# Types of the compiled loops (_kernels.c); engine_ext/cache/kernels.py documents them.
from collections.abc import Callable
from typing import Any

def candidates(
    mark: Any, size: Any, end: int, phase: int, page: int, slots_out: Any, pages_out: Any, /
) -> tuple[int, int]: ...
def steps(
    uniforms: Any, pages: Any, k: int, parent_joins: Callable[[int], int | None], taken_out: Any, /
) -> tuple[list[int], list[int]]: ...
def trim(
    size: Any,
    slots: Any,
    taken: Any,
    k: int,
    page: int,
    off: Any | None,
    starts_out: Any | None,
    lengths_out: Any | None,
    /,
) -> int: ...
def trim_gather(
    size: Any,
    slots: Any,
    taken: Any,
    k: int,
    page: int,
    off: Any,
    source: Any,
    out: Any,
    at: int,
    /,
) -> int: ...
def gather(source: Any, starts: Any, lengths: Any, k: int, out: Any, /) -> int: ...
