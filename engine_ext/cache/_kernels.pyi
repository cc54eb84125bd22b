# Types of the compiled loops (_kernels.c); engine_ext/cache/kernels.py documents them.
from collections.abc import Callable
from typing import Any

def first_round(
    mark: Any,
    size: Any,
    end: int,
    phase: int,
    page: int,
    need: int,
    uniforms: Any,
    start: int,
    picks_per_leaf: int,
    binomial_per_leaf: int,
    max_rounds: int,
    step_pages: int,
    slots_out: Any,
    pages_out: Any,
    counts_out: Any,
    /,
) -> tuple[int, int, int, int, Any, Any]: ...
def pick_counts(
    uniforms: Any, start: int, n: int, leaves: int, counts_out: Any, /
) -> tuple[Any, int]: ...
def steps(
    uniforms: Any,
    start: int,
    need: int,
    pages: Any,
    k: int,
    parent_joins: Callable[[int], int | None],
    taken_out: Any,
    /,
) -> tuple[Any, int, list[int], list[int]]: ...
def even_counts(uniforms: Any, start: int, n: int, leaves: int, counts_out: Any, /) -> Any: ...
def bridge_params(
    start: Any,
    end: Any,
    size: Any,
    lo: Any,
    hi: Any | None,
    t_lo: float,
    t_hi: float,
    t: float,
    n_out: Any,
    p_out: Any,
    /,
) -> tuple[Any, Any]: ...
def bridge_finish(
    start: Any, end: Any, size: Any, lo: Any, drawn: Any, t: float, /
) -> tuple[Any, int]: ...
def gap_rings(
    start: Any, end: Any, lo: Any, hi: Any, t_lo: float, t_hi: float, rings_out: Any, /
) -> tuple[Any, int]: ...
def gap_first(
    start: Any,
    end: Any,
    lo: Any,
    t_lo: float,
    t_hi: float,
    rings: Any,
    uniforms: Any,
    wanted: int,
    out: Any,
    /,
) -> Any: ...
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
def first_emptying(
    picks: Any, n: int, remaining: Any, k: int, counts_out: Any, /
) -> tuple[int, Any]: ...
def counts_emptying(
    counts: Any, remaining: Any, k: int, uniforms: Any, start: int, counts_out: Any, /
) -> tuple[int, int, Any]: ...
def cut_rounds(
    uniforms: Any,
    start: int,
    need: int,
    pages: Any,
    k: int,
    parent_joins: Callable[[int], int | None],
    refill: Callable[[], object],
    taken_out: Any,
    /,
) -> tuple[Any, int, list[int], list[int]]: ...
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
