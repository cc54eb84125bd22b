"""RLT's per-eviction loops: the compiled ones (``_kernels.c``) and their numpy twins give the
same results, write only where they say, and refuse bad input with a clear error before
writing anything."""

from __future__ import annotations

import itertools
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binom, chi2, hypergeom

from engine_ext.cache import kernels, leaf_sampling

IMPLEMENTATIONS = ["numpy", "compiled"]


def implementation(name: str, kernel: str) -> Callable[..., Any]:
    if name == "numpy":
        return kernels.NUMPY_LOOPS[kernel]
    if not kernels.COMPILED:
        pytest.skip("the C extension is not built here (no C compiler at install time)")
    from engine_ext.cache import _kernels

    return getattr(_kernels, kernel)  # type: ignore[no-any-return]


def test_the_extension_is_built_where_a_compiler_is() -> None:
    """``pip install`` builds the extension whenever a C compiler and Python's headers are
    there (it is optional only so that an install without them still works)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if not (compiler and headers):
        pytest.skip("no C compiler or Python headers: the numpy loops are the ones in use")
    assert kernels.COMPILED, "the C extension failed to build: see `pip install -v -e .`"
    assert kernels.first_round is not kernels.numpy_first_round


def test_every_compiled_loop_has_its_numpy_twin() -> None:
    """``NUMPY_LOOPS`` (the fallback, and the tests' numpy path) names every loop the
    extension exports, so no numpy path runs a compiled loop unnoticed."""
    for name, twin in kernels.NUMPY_LOOPS.items():
        assert twin is getattr(kernels, f"numpy_{name}")
        assert name in kernels.__all__
        assert callable(getattr(kernels, name))
    if kernels.COMPILED:
        from engine_ext.cache import _kernels

        exported = {name for name in dir(_kernels) if not name.startswith("_")}
        assert exported == set(kernels.NUMPY_LOOPS)


def both(kernel: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    return implementation("numpy", kernel), implementation("compiled", kernel)


registries = st.integers(0, 40).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 6), min_size=n, max_size=n),  # marks (phase 0..6)
        st.lists(st.integers(1, 64), min_size=n, max_size=n),  # sizes in pages
        st.integers(0, n),  # end
        st.integers(0, 7),  # phase
        st.sampled_from([1, 2, 4]),  # page
        st.integers(0, 3_000),  # need, in pages
    )
)


@settings(max_examples=200, deadline=None)
@given(registries)
def test_first_round_gathers_the_candidates(
    case: tuple[list[int], list[int], int, int, int, int],
) -> None:
    """Both ``first_round`` implementations find the same candidates and sizes in pages,
    the smallest, and whether they hold ``need`` pages; the compiled one writes nothing
    past them."""
    marks, sizes, end, phase, page, need = case
    mark = np.array(marks + [2**62] * 3, dtype=np.int64)  # spare slots past end, locked
    size = np.array([s * page for s in sizes] + [5, 5, 5], dtype=np.int64)
    uniforms = np.random.default_rng(0).random(64)
    results = []
    for fn in both("first_round"):
        outs = [np.full(len(mark), -7, np.int64) for _ in range(3)]
        status, k, smallest, _, slots, pages = fn(
            mark, size, end, phase, page, need, uniforms, 0, 8, 128, 8, 16384, *outs
        )
        results.append(
            (status == kernels.SHORT, k, smallest, slots[:k].tolist(), pages[:k].tolist())
        )
        if fn is not kernels.numpy_first_round:
            assert slots is outs[0]
            assert pages is outs[1]
            assert (outs[0][k:] == -7).all(), "wrote past k"
            assert (outs[1][k:] == -7).all(), "wrote past k"
    want = [i for i in range(end) if marks[i] < phase]
    assert results[0] == results[1]
    short, k, smallest, slots_got, pages_got = results[0]
    assert slots_got == want
    assert pages_got == [sizes[i] for i in want]
    assert smallest == (min(pages_got) if want else 0)
    assert short == (need > sum(pages_got))


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 50), st.integers(0, 300), st.integers(0, 2**32 - 1))
def test_pick_counts_agree_and_count_floor_u_times_leaves(leaves: int, n: int, seed: int) -> None:
    uniforms = np.random.default_rng(seed).random(n + 10)
    uniforms[-1] = np.nextafter(1.0, 0.0)  # the largest uniform still picks leaves - 1
    start = 10 if n else 0
    want = np.bincount((uniforms[start : start + n] * leaves).astype(np.intp), minlength=leaves)
    for fn in both("pick_counts"):
        out = np.full(leaves + 2, -7, np.int64)
        counts, top = fn(uniforms, start, n, leaves, out)
        assert counts[:leaves].tolist() == want.tolist()
        assert top == (int(want.max()) if n else 0)
        if fn is not kernels.numpy_pick_counts:
            assert counts is out
            assert out[leaves:].tolist() == [-7, -7], "wrote past leaves"
    counts, _ = both("pick_counts")[1](uniforms, len(uniforms) - 1, 1, leaves, out)
    assert counts[leaves - 1] == 1


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(0, 30)), min_size=1, max_size=20),
    st.sampled_from([1, 2, 4]),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_trim_agrees(leaves: list[tuple[int, int]], page: int, runs: bool, rnd: Any) -> None:
    sizes = [pages * page for pages, _ in leaves]
    chosen = sorted(rnd.sample(range(len(leaves)), rnd.randint(0, len(leaves))))
    taken = [min(leaves[i][1], leaves[i][0]) for i in chosen]
    slots = np.array(chosen, np.int64)
    cuts = np.array(taken, np.int64)
    off = np.arange(len(leaves), dtype=np.int64) * 1000
    outcomes = []
    for fn in both("trim"):
        size = np.array(sizes, np.int64)
        starts, lengths = np.full(len(slots), -1, np.int64), np.full(len(slots), -1, np.int64)
        args = (off, starts, lengths) if runs else (None, None, None)
        total = fn(size, slots, cuts, len(slots), page, *args)
        outcomes.append((total, size.tolist(), starts.tolist(), lengths.tolist()))
    assert outcomes[0] == outcomes[1]
    total, size_after, starts_after, lengths_after = outcomes[0]
    assert total == sum(taken) * page
    expect = list(sizes)
    for slot, pages in zip(chosen, taken, strict=True):
        expect[slot] -= pages * page
    assert size_after == expect
    if runs:
        assert starts_after == [slot * 1000 + expect[slot] for slot in chosen]
        assert lengths_after == [pages * page for pages in taken]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(0, 30)), min_size=1, max_size=20),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 5),
    st.randoms(use_true_random=False),
)
def test_trim_gather_cuts_and_copies_what_trim_and_gather_do(
    leaves: list[tuple[int, int]], page: int, at: int, rnd: Any
) -> None:
    """``trim_gather`` == ``trim`` with runs, then ``gather`` of those runs into ``out`` from
    ``at``; C and twin alike, and nothing written outside ``out[at:at + cut]``."""
    sizes = [pages * page for pages, _ in leaves]
    chosen = rnd.sample(range(len(leaves)), rnd.randint(0, len(leaves)))  # any order
    slots = np.array(chosen, np.int64)
    cuts = np.array([min(leaves[i][1], leaves[i][0]) for i in chosen], np.int64)
    off = np.cumsum([0, *sizes[:-1]]).astype(np.int64)  # leaves laid out one after another
    source = np.arange(1000, 1000 + sum(sizes), dtype=np.int64)
    want_size = np.array(sizes, np.int64)
    starts, lengths = np.empty(len(slots), np.int64), np.empty(len(slots), np.int64)
    want_cut = kernels.numpy_trim(want_size, slots, cuts, len(slots), page, off, starts, lengths)
    want = np.full(at + want_cut + 3, -1, np.int64)
    kernels.numpy_gather(source, starts, lengths, len(slots), want[at:])
    assert want_cut == int(cuts.sum()) * page
    for fn in both("trim_gather"):
        size = np.array(sizes, np.int64)
        out = np.full(at + want_cut + 3, -1, np.int64)
        assert fn(size, slots, cuts, len(slots), page, off, source, out, at) == want_cut
        assert out.tolist() == want.tolist()
        assert size.tolist() == want_size.tolist()


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(0, 400),
    st.lists(st.integers(1, 60), min_size=12, max_size=12),
    st.randoms(use_true_random=False),
)
def test_first_emptying_finds_the_pick_that_takes_a_leafs_last_page(
    k: int, n: int, remaining: list[int], rnd: Any
) -> None:
    """The definition, pick by pick: count each leaf's picks; the first pick whose count
    reaches the leaf's remaining pages is the one; C and twin agree with it."""
    picks = np.array([rnd.randrange(k) for _ in range(n)], np.int64)
    left = np.array(remaining[:k], np.int64)
    want_at, want = -1, [0] * k
    for j, leaf in enumerate(picks.tolist()):
        want[leaf] += 1
        if want[leaf] == left[leaf]:
            want_at = j
            break
    for fn in both("first_emptying"):
        out = np.full(k + 2, -7, np.int64)
        at, counts = fn(np.concatenate([picks, [0, 1]]), n, left, k, out)  # n of them
        assert at == want_at
        assert counts[:k].tolist() == want


def test_first_emptying_refuses_bad_input() -> None:
    first_emptying = implementation("compiled", "first_emptying")
    out = np.zeros(3, np.int64)
    with pytest.raises(ValueError, match=r"picks\[1\] = 3 is not a leaf"):
        first_emptying(np.array([0, 3], np.int64), 2, np.array([5, 5, 5], np.int64), 3, out)
    with pytest.raises(ValueError, match=r"remaining\[2\] = 0: every leaf holds a page"):
        first_emptying(np.array([0, 1], np.int64), 2, np.array([5, 5, 0], np.int64), 3, out)
    with pytest.raises(ValueError, match="n: 3 is outside the picks"):
        first_emptying(np.array([0, 1], np.int64), 3, np.array([5, 5, 5], np.int64), 3, out)
    with pytest.raises(ValueError, match=r"k: 4 is not in 1\.\.len"):
        first_emptying(np.array([0, 1], np.int64), 2, np.array([5, 5, 5], np.int64), 4, out)
    with pytest.raises(TypeError, match="picks: expected a one-dimensional int64 array"):
        first_emptying(np.array([0, 1], np.int32), 2, np.array([5, 5, 5], np.int64), 3, out)


def first_emptying_law(counts: list[int], remaining: list[int]) -> dict[tuple[int, ...], Fraction]:
    """The exact law of a counts round's first emptying: every distinct order of the
    picks is equally likely; (position, picks per leaf up to it) for each."""
    law: dict[tuple[int, ...], Fraction] = {}
    orders = set(itertools.permutations([i for i, c in enumerate(counts) for _ in range(c)]))
    for order in orders:
        at, taken = kernels.numpy_first_emptying(
            np.array(order, np.int64), len(order), np.array(remaining, np.int64), len(counts), None
        )
        key = (at, *taken.tolist())
        law[key] = law.get(key, Fraction(0)) + Fraction(1, len(orders))
    return law


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 400), st.integers(1, 400)), min_size=1, max_size=14),
    st.integers(0, 2**32 - 1),
    st.integers(0, 5),
)
def test_counts_emptying_agrees_and_cuts_at_one_leafs_last_page(
    leaves: list[tuple[int, int]], seed: int, start: int
) -> None:
    """``counts_emptying``: C and its Python twin draw the same cut from the same uniforms;
    the picks up to it add up to the position + 1, one leaf (one that can empty) takes its
    last page there and every other leaf keeps one; it reads no uniform past ``used``,
    which stays within the bound the caller reserves."""
    counts = np.array([c for c, _ in leaves], np.int64)
    remaining = np.array([r for _, r in leaves], np.int64)
    k = len(leaves)
    reach = int((counts >= remaining).sum())
    bound = reach * int(counts.sum()).bit_length() + k
    uniforms = np.random.default_rng(seed).random(start + bound + 3)
    uniforms[start] = np.nextafter(1.0, 0.0) if seed % 3 == 0 else uniforms[start]
    results = []
    for fn in both("counts_emptying"):
        out = np.full(k + 2, -7, np.int64)
        at, used, taken = fn(counts, remaining, k, uniforms, start, out)
        results.append((at, used, taken[:k].tolist()))
        if fn is not kernels.numpy_counts_emptying:
            assert taken is out
            assert out[k:].tolist() == [-7, -7], "wrote past k"
    assert results[0] == results[1]
    at, used, taken = results[0]
    if reach == 0:
        assert (at, used, taken) == (-1, 0, counts.tolist())
        return
    assert used <= bound
    assert sum(taken) == at + 1
    assert all(0 <= t <= c for t, c in zip(taken, counts.tolist(), strict=True))
    emptied = [i for i in range(k) if taken[i] == remaining[i]]
    assert len(emptied) == 1
    assert counts[emptied[0]] >= remaining[emptied[0]]
    kept = [t < r for t, r in zip(taken, remaining.tolist(), strict=True)]
    assert sum(kept) == k - 1
    changed = uniforms.copy()
    changed[start + used :] = 0.5  # what it did not use does not matter
    assert (
        both("counts_emptying")[0](counts, remaining, k, changed, start, None)[2].tolist() == taken
    )


@pytest.mark.parametrize(
    ("counts", "remaining"),
    [
        ([3, 2, 2], [2, 2, 3]),
        ([4, 1, 3, 2], [4, 1, 2, 5]),
        ([6, 5], [4, 5]),
        ([5, 1, 1], [5, 2, 1]),
    ],
)
def test_counts_emptying_draws_the_first_emptying_of_a_uniform_order(
    counts: list[int], remaining: list[int]
) -> None:
    """Against the exact law (every order of the picks enumerated): 40,000 draws, every
    outcome a possible one, chi-square goodness of fit."""
    law = first_emptying_law(counts, remaining)
    draw = implementation("compiled" if kernels.COMPILED else "numpy", "counts_emptying")
    c, r, k = np.array(counts, np.int64), np.array(remaining, np.int64), len(counts)
    uniforms = np.random.default_rng(sum(counts) * 100 + k).random(40_000 * 40)
    seen: dict[tuple[int, ...], int] = {}
    at_uniform = 0
    for _ in range(40_000):
        at, used, taken = draw(c, r, k, uniforms, at_uniform, np.empty(k, np.int64))
        at_uniform += used
        key = (at, *taken.tolist())
        seen[key] = seen.get(key, 0) + 1
    assert set(seen) <= set(law), set(seen) - set(law)
    keys = sorted(law)
    observed = np.array([seen.get(key, 0) for key in keys], float)
    expected = np.array([float(law[key]) for key in keys]) * observed.sum()
    stat = ((observed - expected) ** 2 / expected).sum()
    assert chi2.sf(stat, len(keys) - 1) > 1e-4, dict(zip(keys, observed, strict=True))


@pytest.mark.parametrize(
    ("good", "bad", "sample"),
    [(3, 7, 4), (1, 9, 5), (9, 1, 5), (50, 200, 120), (500, 5_000, 2_000), (600, 7_200, 3_900)],
)
def test_hypergeometric_draws_follow_the_law_and_their_mode_is_exact(
    good: int, bad: int, sample: int
) -> None:
    """The draw inside ``counts_emptying``: the probability it starts from (at the mode)
    against exact rational arithmetic, and 20,000 draws against the exact law."""
    total = good + bad
    mode = min(max((sample + 1) * (good + 1) // (total + 2), sample - bad, 0), sample, good)
    exact = Fraction(
        math.comb(good, mode) * math.comb(bad, sample - mode), math.comb(total, sample)
    )
    p, q = sample / total, (total - sample) / total
    at_mode = (
        kernels._binom_pmf(mode, good, p, q)
        * kernels._binom_pmf(sample - mode, bad, p, q)
        / kernels._binom_pmf(sample, total, p, q)
    )
    assert at_mode == pytest.approx(float(exact), rel=1e-12, abs=0)
    draws = np.array(
        [
            kernels._hypergeometric(good, bad, sample, u)
            for u in np.random.default_rng(good).random(20_000)
        ]
    )
    values, seen = np.unique(draws, return_counts=True)
    expected = hypergeom(total, good, sample).pmf(values) * len(draws)
    pooled = expected >= 5
    table_seen = np.append(seen[pooled], seen[~pooled].sum())
    table_expected = np.append(expected[pooled], len(draws) - expected[pooled].sum())
    stat = ((table_seen - table_expected) ** 2 / np.maximum(table_expected, 1e-9)).sum()
    assert chi2.sf(stat, len(table_seen) - 1) > 1e-4


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_counts_emptying_refuses_bad_input(impl: str) -> None:
    counts_emptying = implementation(impl, "counts_emptying")
    c, r, u = np.array([4, 2], np.int64), np.array([3, 5], np.int64), np.full(20, 0.5)
    out = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match=r"k: 3 is not in 1\.\.len"):
        counts_emptying(c, r, 3, u, 0, out)
    with pytest.raises(ValueError, match="start: 21 is outside the uniforms"):
        counts_emptying(c, r, 2, u, 21, out)
    with pytest.raises(ValueError, match=r"counts\[1\], remaining\[1\] = 2, 0: need"):
        counts_emptying(c, np.array([3, 0], np.int64), 2, u, 0, out)
    with pytest.raises(ValueError, match=r"counts\[0\], remaining\[0\] = -1, 3: need"):
        counts_emptying(np.array([-1, 2], np.int64), r, 2, u, 0, out)
    with pytest.raises(ValueError, match="uniforms: fewer than needed from start 20"):
        counts_emptying(c, r, 2, u, 20, out)
    with pytest.raises(ValueError, match=r"uniforms\[2\] is not in \[0, 1\)"):
        counts_emptying(c, r, 2, np.array([0.5, 0.5, 1.5, 0.5]), 2, out)
    if impl == "compiled":
        with pytest.raises(ValueError, match="counts_out: must not be counts or remaining"):
            counts_emptying(c, r, 2, u, 0, c)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_trim_gather_refuses_a_short_out_before_writing(impl: str) -> None:
    trim_gather = implementation(impl, "trim_gather")
    size, off = np.array([4, 6], np.int64), np.array([0, 4], np.int64)
    source, out = np.arange(10, dtype=np.int64), np.full(6, -1, np.int64)
    slots, taken = np.array([0, 1], np.int64), np.array([2, 3], np.int64)
    with pytest.raises(ValueError, match="out: 5 tokens cut, room for 4 after at"):
        trim_gather(size, slots, taken, 2, 1, off, source, out, 2)
    assert size.tolist() == [4, 6], "a refused call wrote nothing"
    assert out.tolist() == [-1] * 6
    assert trim_gather(size, slots, taken, 2, 1, off, source, out, 1) == 5
    assert size.tolist() == [2, 3]
    assert out.tolist() == [-1, 2, 3, 7, 8, 9]


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_gather_copies_the_runs_in_order(impl: str, dtype: type) -> None:
    gather = implementation(impl, "gather")
    source = np.arange(100, 200, dtype=dtype)
    starts = np.array([5, 0, 90, 40], np.int64)
    lengths = np.array([3, 2, 0, 4], np.int64)
    out = np.full(12, -1, dtype=dtype)
    assert gather(source, starts, lengths, 4, out) == 9
    assert out.tolist() == [105, 106, 107, 100, 101, 140, 141, 142, 143, -1, -1, -1]
    assert gather(source, starts, lengths, 1, out[9:]) == 3  # into a view, first run only
    assert out[9:].tolist() == [105, 106, 107]


def test_the_compiled_loops_refuse_bad_input_before_writing() -> None:
    first_round, pick_counts, even_counts, trim, gather = (
        implementation("compiled", k)
        for k in ("first_round", "pick_counts", "even_counts", "trim", "gather")
    )
    mark = np.zeros(4, np.int64)
    size = np.array([4, 4, 4, 4], np.int64)
    out = np.zeros(4, np.int64)
    u = np.full(8, 0.5)

    def outs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.zeros(4, np.int64), np.zeros(4, np.int64), np.zeros(4, np.int64)

    with pytest.raises(TypeError, match="mark: expected a one-dimensional int64 array"):
        first_round(mark.astype(np.int32), size, 4, 1, 1, 2, u, 0, 8, 128, 8, 16384, *outs())
    frozen = np.zeros(4, np.int64)
    frozen.setflags(write=False)
    with pytest.raises(TypeError, match="slots_out: expected a writable"):
        first_round(mark, size, 4, 1, 1, 2, u, 0, 8, 128, 8, 16384, frozen, out, out.copy())
    with pytest.raises(TypeError, match="size: expected a"):
        first_round(mark, np.zeros(8, np.int64)[::2], 4, 1, 1, 2, u, 0, 8, 128, 8, 16384, *outs())
    with pytest.raises(ValueError, match="end: 5 is outside the arrays"):
        first_round(mark, size, 5, 1, 1, 2, u, 0, 8, 128, 8, 16384, *outs())
    with pytest.raises(ValueError, match="start: 9 is outside the uniforms"):
        first_round(mark, size, 4, 1, 1, 2, u, 9, 8, 128, 8, 16384, *outs())
    with pytest.raises(ValueError, match="page: must be >= 1"):
        first_round(mark, size, 4, 1, 0, 2, u, 0, 8, 128, 8, 16384, *outs())
    with pytest.raises(TypeError, match=r"takes 15 arguments \(2 given\)"):
        first_round(mark, size)
    with pytest.raises(ValueError, match=r"uniforms\[1\] is not in \[0, 1\)"):
        pick_counts(np.array([0.5, 1.0]), 0, 2, 3, out)
    with pytest.raises(ValueError, match="start, n: 1, 2 are outside the uniforms"):
        pick_counts(np.array([0.5, 0.5]), 1, 2, 3, out)
    with pytest.raises(ValueError, match=r"leaves: 5 is not in 1\.\.len"):
        pick_counts(np.array([0.5]), 0, 1, 5, out)
    with pytest.raises(TypeError, match="uniforms: expected a one-dimensional float64"):
        pick_counts(np.array([1, 2]), 0, 1, 3, out)
    with pytest.raises(ValueError, match=r"uniforms\[1\] is not in \[0, 1\)"):
        even_counts(np.array([0.5, -0.5]), 0, 10, 3, out)
    with pytest.raises(ValueError, match="start, leaves: 1, 3 are outside the uniforms"):
        even_counts(np.array([0.5, 0.5]), 1, 10, 3, out)
    with pytest.raises(ValueError, match="n: must be >= 0, got -1"):
        even_counts(np.array([0.5, 0.5]), 0, -1, 3, out)
    with pytest.raises(ValueError, match=r"leaves: 0 is not in 1\.\.len"):
        even_counts(np.array([0.5]), 0, 1, 0, out)
    before = size.tolist()
    with pytest.raises(ValueError, match=r"taken\[1\] = 5 pages: the leaf in slot 2 holds 4"):
        trim(size, np.array([0, 2], np.int64), np.array([1, 5], np.int64), 2, 1, None, None, None)
    with pytest.raises(IndexError, match=r"slots\[1\] = 9 is not a slot"):
        trim(size, np.array([0, 9], np.int64), np.array([1, 1], np.int64), 2, 1, None, None, None)
    assert size.tolist() == before, "a refused trim wrote nothing"
    with pytest.raises(ValueError, match=r"run 0 .* is outside source or out"):
        gather(np.arange(10), np.array([8], np.int64), np.array([5], np.int64), 1, out)
    trim_gather = implementation("compiled", "trim_gather")
    off, source = np.array([0, 4, 8, 12], np.int64), np.arange(16, dtype=np.int64)
    bad_runs = (  # each refused before anything is written
        ((np.array([0, 9], np.int64), np.array([1, 1], np.int64), off, source, 0),
         IndexError, r"slots\[1\] = 9 is not a slot"),
        ((np.array([0, 2], np.int64), np.array([1, 5], np.int64), off, source, 0),
         ValueError, r"taken\[1\] = 5 pages: the leaf in slot 2 holds 4"),
        ((np.array([0, 3], np.int64), np.array([1, 1], np.int64), off, source[:14], 0),
         ValueError, r"run 1 \(start 15, length 1\) is outside source"),
        ((np.array([0], np.int64), np.array([1], np.int64), off, source, 5),
         ValueError, "at: 5 is outside out"),
        ((np.array([0], np.int64), np.array([1], np.int64), off, source.astype(np.int32), 0),
         TypeError, "out: must have source's item size"),
    )  # fmt: skip
    for (slots, taken, offsets, src, at), error, message in bad_runs:
        staged = np.full(4, -1, np.int64)
        with pytest.raises(error, match=message):
            trim_gather(size, slots, taken, len(slots), 1, offsets, src, staged, at)
        assert size.tolist() == before
        assert staged.tolist() == [-1] * 4
    with pytest.raises(TypeError, match="out: must have source's item size"):
        gather(
            np.arange(10),
            np.array([0], np.int64),
            np.array([2], np.int64),
            1,
            out[:2].view(np.int32),
        )


def test_without_the_extension_the_numpy_loops_run() -> None:
    """An install that could not build the extension imports, says so and evicts."""
    script = """
import random, sys
sys.modules["engine_ext.cache._kernels"] = None  # what a failed build leaves: no module
from engine_ext.cache import RadixCache, kernels, leaf_sampling
assert not kernels.COMPILED and kernels.trim is kernels.numpy_trim
assert leaf_sampling.FEW_LEAVES == 32
for leaves in (8, 200):
    cache = RadixCache(100_000, "rlt", rng=random.Random(0))
    for i in range(leaves):
        cache.insert(tuple([i + 1] + [0] * 200))
    assert cache.evict(1_000) == 1_000
    cache.check_invariants()
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 40) | st.integers(40, 3_000)),  # pages
        min_size=1,
        max_size=40,
    ),
    st.integers(1, 400),
    st.sampled_from([1, 2]),
    st.integers(0, 2**32 - 1),
    st.integers(0, 500),
    st.sampled_from([1, 16, leaf_sampling._BINOMIAL_PICKS_PER_LEAF]),
    st.sampled_from([0, 64, leaf_sampling._STEP_PAGES]),
)
def test_first_round_is_the_draw_leaf_sampling_makes(
    leaves: list[tuple[int, int]],
    need: int,
    page: int,
    seed: int,
    used: int,
    binomial: int,
    step_pages: int,
) -> None:
    """The compiled ``first_round`` says WHOLE exactly when ``leaf_sampling`` would draw a
    first round from ``Draws``' buffer (picks, or even counts with many picks per leaf)
    that empties no leaf, with the same counts from the same uniforms, and says how many
    uniforms that took; STEPS when the draw would go page by page and those picks empty a
    leaf, ROUNDS when it would go by compiled rounds and their first empties one; it
    gathers the same candidates as the numpy twin and consumes nothing itself.
    ``binomial`` stands for ``_BINOMIAL_PICKS_PER_LEAF`` (small ones put these small draws
    on the even-counts path), ``step_pages`` for ``_STEP_PAGES`` (0: never page by page)."""
    first_round = implementation("compiled", "first_round")
    phase = 2
    mark = np.array([m for m, _ in leaves], np.int64)
    size = np.array([p * page for _, p in leaves], np.int64)
    end = len(leaves)
    draws = leaf_sampling.Draws(seed, buffer=256)  # some `need` go past it (up to 400)
    draws.consume(min(used, 256))
    uniforms, start = draws.ahead()
    outs = [np.zeros(end, np.int64) for _ in range(3)]
    counts = outs[2]
    status, k, smallest, took, slots, pages = first_round(
        mark, size, end, phase, page, need, uniforms, start,
        leaf_sampling._MULTINOMIAL_PICKS_PER_LEAF, binomial, leaf_sampling._MAX_ROUNDS,
        step_pages, *outs,
    )  # fmt: skip
    assert draws.ahead() == (uniforms, start), "first_round consumes nothing itself"
    _, want_k, want_smallest, _, want_slots, want_pages = kernels.numpy_first_round(
        mark, size, end, phase, page, need, uniforms, start, 8, binomial, 8, step_pages, *outs
    )
    assert (k, smallest) == (want_k, want_smallest)
    assert slots[:k].tolist() == want_slots.tolist()
    assert pages[:k].tolist() == want_pages.tolist()
    total = int(want_pages.sum())
    if total < need:
        assert status == kernels.SHORT
        return
    with (
        mock.patch.object(leaf_sampling, "_BINOMIAL_PICKS_PER_LEAF", binomial),
        mock.patch.object(leaf_sampling, "_STEP_PAGES", step_pages),
    ):
        method, _, whole = leaf_sampling.draw_first_counts(pages[:k], need, draws, smallest)
    many = need >= leaf_sampling._MULTINOMIAL_PICKS_PER_LEAF * k
    counted = method == "steps" or (need < binomial * k and not (many and need > len(uniforms)))
    wanted = need if counted else k - 1  # the uniforms of the first round
    buffered = method != "continuous" and start + wanted <= len(uniforms)
    if buffered and whole is not None:
        assert status == kernels.WHOLE
        assert took == wanted
        assert counts[:k].tolist() == whole.tolist()
        assert draws.ahead()[1] == start + wanted  # the uniforms the caller then consumes
    elif buffered and method == "steps":
        assert status == kernels.STEPS
        assert took == 0
        assert draws.ahead() == (uniforms, start), "nothing consumed: steps replays them"
    elif buffered and method == "rounds":
        assert status == kernels.ROUNDS
        assert took == 0
        assert draws.ahead() == (uniforms, start), "nothing consumed: the rounds redraw it"
    else:
        assert status == kernels.DRAW
        assert took == 0


def joins_every(step: int, pages: int) -> Callable[[int], int | None]:
    """A ``parent_joins`` for ``steps``: the parent of every ``step``-th label joins, with
    ``pages + label % 5`` pages (so parents' parents join too), and the calls are logged."""
    calls: list[int] = []

    def parent_joins(label: int) -> int | None:
        calls.append(label)
        return pages + label % 5 if label % step == 0 else None

    parent_joins.calls = calls  # type: ignore[attr-defined]
    return parent_joins


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 6) | st.integers(1, 300), min_size=0, max_size=40),
    st.integers(0, 2_000),
    st.integers(0, 2**32 - 1),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_steps_agree_with_the_twin_and_the_definition(
    pages: list[int], need: int, seed: int, step: int, start: int
) -> None:
    """``steps``: the compiled loop and its chunked numpy twin make the same picks from the
    same uniforms (pages taken per label, leaves emptied in order, parents' calls, uniforms
    used), and both are the definition written here one pick at a time."""
    uniforms = np.random.default_rng(seed).random(start + need + 3)
    k = len(pages)
    arr = np.array(pages, np.int64)
    results = []
    for fn in both("steps"):
        joins = joins_every(step, 3)
        out = np.full(k + 2, -7, np.int64)
        taken, used, emptied, joined = fn(uniforms, start, need, arr, k, joins, out)
        if fn is not kernels.numpy_steps:
            assert taken is out
            assert (out[k:] == -7).all(), "wrote past k"
        results.append((taken[:k].tolist(), used, emptied, joined, joins.calls))  # type: ignore[attr-defined]
    assert results[0] == results[1]
    # the definition: a pick is floor(u * active), an emptied leaf leaves the order, its
    # parent (if it joins) goes to the end
    joins = joins_every(step, 3)
    active = [[label, p] for label, p in enumerate(pages)]
    taken_by = [0] * k
    emptied_want: list[int] = []
    used_want = 0
    while used_want < need and active:
        j = int(uniforms[start + used_want] * len(active))
        used_want += 1
        label = active[j][0]
        taken_by[label] += 1
        active[j][1] -= 1
        if active[j][1] == 0:
            active.pop(j)
            emptied_want.append(label)
            joined_pages = joins(label)
            if joined_pages:
                active.append([len(taken_by), joined_pages])
                taken_by.append(0)
    assert results[0][:4] == (taken_by[:k], used_want, emptied_want, taken_by[k:])


def test_steps_refuses_bad_input() -> None:
    steps = implementation("compiled", "steps")
    u, pages, out = np.full(8, 0.5), np.array([2, 3], np.int64), np.zeros(2, np.int64)

    def none(label: int) -> None:
        return None

    with pytest.raises(ValueError, match="start, need: 2, 7 are outside the uniforms"):
        steps(u, 2, 7, pages, 2, none, out)
    with pytest.raises(ValueError, match="k: 3 is outside the arrays"):
        steps(u, 0, 4, pages, 3, none, out)
    with pytest.raises(ValueError, match=r"pages\[1\] = 0: every candidate must hold a page"):
        steps(u, 0, 4, np.array([2, 0], np.int64), 2, none, out)
    with pytest.raises(TypeError, match="parent_joins: expected a callable"):
        steps(u, 0, 4, pages, 2, None, out)
    with pytest.raises(TypeError, match="parent_joins: must return an int or None"):
        steps(u, 0, 4, np.array([1, 1], np.int64), 2, lambda label: "A", out)
    with pytest.raises(ZeroDivisionError):  # the callback's own error goes through
        steps(u, 0, 4, np.array([1, 1], np.int64), 2, lambda label: 1 // 0, out)
    with pytest.raises(ValueError, match=r"uniforms\[1\] is not in \[0, 1\)"):
        steps(np.array([0.5, 1.0, 0.5]), 0, 3, pages, 2, none, out)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 8) | st.integers(100, 5_000), min_size=0, max_size=20),
    st.integers(0, 30_000),
    st.integers(0, 2**32 - 1),
    st.integers(1, 4),
    st.integers(0, 60),
)
def test_cut_rounds_agree_with_the_twin_and_add_up(
    pages: list[int], need: int, seed: int, step: int, spare: int
) -> None:
    """``cut_rounds``: the compiled loop and its Python twin draw the same rounds from the
    same uniforms, refilling a buffer barely larger than a round's worst case at the same
    points (pages taken per label, leaves emptied in order, parents' calls, where the
    uniforms ended); every emptied leaf lost all its pages, the others fewer, and the pages
    taken are ``need`` or all there were. That this is RLT's draw is checked against the
    per-page definition in ``test_leaf_sampling``."""
    k = len(pages)
    arr = np.array(pages, np.int64)
    room = max(k * (need.bit_length() + 2), 1) + spare
    results = []
    for fn in both("cut_rounds"):
        refills = np.random.default_rng(seed)
        uniforms = refills.random(room)
        joins = joins_every(step, 300)
        out = np.full(k + 2, -7, np.int64)
        taken, end, emptied, joined = fn(
            uniforms, spare // 2, need, arr, k, joins, partial(refills.random, out=uniforms), out
        )
        if fn is not kernels.numpy_cut_rounds:
            assert taken is out
            assert (out[k:] == -7).all(), "wrote past k"
        results.append((taken[:k].tolist(), end, emptied, joined, joins.calls))  # type: ignore[attr-defined]
    assert results[0] == results[1]
    taken_k, _, emptied, joined, _ = results[0]
    sizes = pages + [300 + label % 5 for label in emptied if label % step == 0]
    every = taken_k + joined
    assert sum(every) == min(need, sum(sizes[: len(every)]))
    for label, size in enumerate(sizes[: len(every)]):
        assert every[label] == size if label in emptied else every[label] < size


def test_cut_rounds_refuses_bad_input() -> None:
    cut_rounds = implementation("compiled", "cut_rounds")
    u, pages, out = np.full(16, 0.5), np.array([2, 3], np.int64), np.zeros(2, np.int64)

    def none(label: int) -> None:
        return None

    def refill() -> None:
        return None

    with pytest.raises(ValueError, match="start, need: 17, 4: need >= 0, start in"):
        cut_rounds(u, 17, 4, pages, 2, none, refill, out)
    with pytest.raises(ValueError, match="k: 3 is outside the arrays"):
        cut_rounds(u, 0, 4, pages, 3, none, refill, out)
    with pytest.raises(ValueError, match=r"pages\[1\] = 0: every candidate must hold a page"):
        cut_rounds(u, 0, 4, np.array([2, 0], np.int64), 2, none, refill, out)
    with pytest.raises(ValueError, match=r"uniforms: 16 hold fewer than a round may need \(24\)"):
        cut_rounds(u, 0, 1_000, pages, 2, none, refill, out)
    with pytest.raises(TypeError, match="parent_joins, refill: expected callables"):
        cut_rounds(u, 0, 4, pages, 2, none, None, out)
    with pytest.raises(ZeroDivisionError):  # the callbacks' own errors go through
        cut_rounds(u, 0, 4, np.array([1, 1], np.int64), 2, lambda label: 1 // 0, refill, out)
    with pytest.raises(ValueError, match=r"uniforms\[0\] is not in \[0, 1\)"):
        cut_rounds(np.full(16, 1.0), 0, 4, pages, 2, none, refill, out)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 60),
    st.integers(0, 10**7),
    st.integers(0, 2**32 - 1),
    st.integers(0, 5),
)
def test_even_counts_agree_and_add_up(leaves: int, n: int, seed: int, start: int) -> None:
    """``even_counts``: the compiled loop and its Python twin draw the same counts (the same
    float arithmetic, step for step), which add up to ``n``, from ``leaves - 1`` uniforms."""
    uniforms = np.random.default_rng(seed).random(start + leaves + 3)
    uniforms[start] = np.nextafter(1.0, 0.0) if seed % 3 == 0 else uniforms[start]
    results = []
    for fn in both("even_counts"):
        out = np.full(leaves + 2, -7, np.int64)
        counts = fn(uniforms, start, n, leaves, out)
        results.append(counts[:leaves].tolist())
        if fn is not kernels.numpy_even_counts:
            assert counts is out
            assert out[leaves:].tolist() == [-7, -7], "wrote past leaves"
    assert results[0] == results[1]
    assert sum(results[0]) == n
    assert min(results[0]) >= 0
    # the uniforms past the first leaves - 1 are not read
    changed = uniforms.copy()
    changed[start + leaves - 1 :] = 0.5
    assert both("even_counts")[0](changed, start, n, leaves, None).tolist() == results[0]


@pytest.mark.parametrize(
    ("n", "r"), [(1, 2), (7, 2), (50, 3), (1_000, 13), (100_000, 13), (5, 50), (20_000, 400)]
)
def test_even_counts_draw_binomials_of_the_right_law(n: int, r: int) -> None:
    """The first of ``r`` leaves gets Bin(n, 1/r) of ``n`` picks: 20,000 draws against
    the exact probabilities (chi-square) and the exact mean."""
    gen = np.random.default_rng(n * 1_000 + r)
    uniforms = gen.random(20_000 + r)
    out = np.empty(r, np.int64)
    draw = implementation("compiled" if kernels.COMPILED else "numpy", "even_counts")
    firsts = np.array([draw(uniforms, i, n, r, out)[0] for i in range(20_000)])
    values, seen = np.unique(firsts, return_counts=True)
    expected = binom.pmf(values, n, 1 / r) * len(firsts)
    pooled = expected >= 5
    rest_seen, rest_expected = seen[~pooled].sum(), len(firsts) - expected[pooled].sum()
    table_seen = np.append(seen[pooled], rest_seen)
    table_expected = np.append(expected[pooled], rest_expected)
    if len(table_seen) > 2:
        stat = ((table_seen - table_expected) ** 2 / np.maximum(table_expected, 1e-9)).sum()
        assert chi2.sf(stat, len(table_seen) - 1) > 1e-4, (values, seen, expected)
    sd = np.sqrt(n / r * (1 - 1 / r) / len(firsts))
    assert abs(firsts.mean() - n / r) < 5 * sd + 1e-9


@pytest.mark.parametrize("n", [1, 2, 15, 16, 35, 36, 80, 81, 500, 501, 10_000])
@pytest.mark.parametrize("r", [2, 3, 13, 1_000])
def test_even_pmf_is_exact_to_rounding_near_the_mode(n: int, r: int) -> None:
    """Loader's form of the binomial probabilities (every branch of its Stirling series)
    against exact rational arithmetic, within two standard deviations of the mode, where
    the draws' search spends its mass."""
    mode = (n + 1) // r
    spread = 2 * int(np.sqrt(n / r)) + 2
    for x in range(max(0, mode - spread), min(n, mode + spread) + 1):
        exact = float(Fraction(math.comb(n, x) * (r - 1) ** (n - x), r**n))
        if exact < 1e-300:
            continue
        assert kernels.even_pmf(x, n, r) == pytest.approx(exact, rel=1e-13, abs=0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 5), st.floats(0.001, 5), st.integers(1, 50), st.integers(0, 10)),
        min_size=1,
        max_size=30,
    ),
    st.floats(0, 3),
    st.sampled_from([1.0, 4.0, 8.0, np.inf]),  # t_hi - t_lo
    st.floats(0, 1),
    st.booleans(),
)
def test_bridge_arithmetic_agrees(
    leaves: list[tuple[float, float, int, int]],
    t_lo: float,
    t_hi: float,
    where: float,
    with_hi: bool,
) -> None:
    """``bridge_params`` gives numpy's binomial the same parameters (so the same draw) and
    ``bridge_finish`` the same counts, whichever implementation computes them."""
    start = np.array([s for s, _, _, _ in leaves])
    end = start + np.array([d for _, d, _, _ in leaves])
    size = np.array([c for _, _, c, _ in leaves], np.int64)
    lo = np.minimum(np.array([r for _, _, _, r in leaves], np.int64), size - 1)
    hi = size.copy() if with_hi else None
    t_hi += t_lo
    t = t_lo + where * (min(t_hi, 10.0) - t_lo)  # between the brackets
    params = []
    for fn in both("bridge_params"):
        outs = (np.full(len(size), -9, np.int64), np.full(len(size), -9.0))
        n, p = fn(start, end, size, lo, hi, t_lo, t_hi, t, *outs)
        params.append((n.tolist(), p.tolist()))
    assert params[0] == params[1]  # bit for bit: the binomial draws the same
    n = np.array(params[0][0], np.int64)
    assert (n >= 0).all()
    assert all(0.0 <= x <= 1.0 for x in params[0][1])
    drawn = np.random.default_rng(0).binomial(n, np.array(params[0][1]))
    results = []
    for fn in both("bridge_finish"):
        counts, total = fn(start, end, size, lo, drawn.copy(), t)
        results.append((counts.tolist(), total))
    assert results[0] == results[1]
    counts, total = results[0]
    assert total == sum(counts)
    for i in range(len(size)):
        if end[i] <= t:
            assert counts[i] == size[i]  # emptied by t
        elif start[i] >= t:
            assert counts[i] == 0  # not joined yet
        else:
            assert counts[i] == lo[i] + drawn[i]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 60), min_size=1, max_size=40),
    st.floats(0, 2),
    st.floats(0.5, 4),
    st.floats(0, 1),
    st.integers(0, 2**32 - 1),
)
def test_the_first_rings_of_a_gap_agree(
    sizes: list[int], t_lo: float, gap: float, share: float, seed: int
) -> None:
    """``gap_rings`` and ``gap_first`` (a quickselect) count the same first rings of a gap as
    numpy's repeat and argpartition do, from the same uniforms. Times are continuous, as
    the draw's are (no two rings at one time, where the two selections may differ)."""
    gen = np.random.default_rng(seed)
    t_hi = t_lo + gap
    size = np.array(sizes, np.int64)
    start = np.where(gen.random(len(size)) < 0.5, 0.0, gen.uniform(0, 4, len(size)))
    end = start + gen.standard_gamma(size.astype(float)) / 10
    # counts at t_lo and t_hi consistent with the leaves' lives: all rings by the end
    lo = np.where(end <= t_lo, size, np.where(start >= t_lo, 0, (size - 1) // 2))
    hi = np.where(end <= t_hi, size, np.where(start >= t_hi, 0, size - 1))
    hi = np.maximum(hi, lo + ((end > t_lo) & (end <= t_hi)))
    rings = []
    for fn in both("gap_rings"):
        got, total = fn(start, end, lo, hi, t_lo, t_hi, np.full(len(size), -1, np.int64))
        rings.append((got.tolist(), total))
    assert rings[0] == rings[1]
    ring_list, drawn = rings[0]
    finals = int(((end > t_lo) & (end <= t_hi)).sum())
    if drawn + finals == 0:
        return
    uniforms = gen.random(drawn)
    ring_counts = np.array(ring_list, np.int64)
    for wanted in sorted({1, max(1, int(share * (drawn + finals))), drawn + finals}):
        out = np.zeros(len(size), np.int64)
        args = (start, end, lo, t_lo, t_hi, ring_counts, uniforms, wanted)
        results = [fn(*args, out.copy()).tolist() for fn in both("gap_first")]
        assert results[0] == results[1], wanted
        assert sum(results[0]) == int(lo.sum()) + wanted
        assert all(lo[i] <= c <= hi[i] for i, c in enumerate(results[0]))


SANITIZED_WORKLOAD = """
import random, sys
import numpy as np
import engine_ext.cache._kernels as compiled
from engine_ext.cache import RadixCache, kernels
assert compiled.__file__.startswith(sys.argv[1]), compiled.__file__
rng = random.Random(0)
for seed in range(12):
    page = rng.choice([1, 2, 4])
    cache = RadixCache(40_000, "rlt", page_size=page, rng=random.Random(seed))
    prefixes = [
        tuple(rng.randrange(1, 999) for _ in range(rng.randint(1, 16) * 4)) for _ in range(6)
    ]
    for step in range(400):
        tail = tuple(rng.randrange(1, 999) for _ in range(rng.randint(1, 60) * 4))
        key = rng.choice(prefixes) + tail
        cache.ensure_free(len(key))
        cache.insert(key)
        if step % 5 == 0:
            cache.match_prefix(rng.choice(prefixes))
        if step % 9 == 0:  # small and large evictions: cut rounds and the continuous draw
            cache.evict(rng.choice([4, 64, 1_000, 8_000, 30_000]))
    cache.check_invariants()
for seed in range(6):  # a few long documents: the first round's counts are binomials
    cache = RadixCache(200_000, "rlt", rng=random.Random(seed))
    for doc in range(12):
        cache.insert(tuple([doc + 1] + [rng.randrange(1, 999) for _ in range(8_000)]))
    for need in (5_000, 20_000, 60_000):
        assert cache.evict(need) == need
    cache.check_invariants()
for seed in range(4):  # a cache RLT has run a while: short leaves, page-by-page draws
    cache = RadixCache(20_000, "rlt", rng=random.Random(seed))
    docs = [
        tuple([d + 1] + [rng.randrange(1, 999) for _ in range(rng.randint(200, 3_000))])
        for d in range(30)
    ]
    for step in range(300):
        key = rng.choice(docs)[: rng.randint(100, 3_000)]
        cache.ensure_free(len(key))
        cache.insert(key)
    cache.check_invariants()
for trial in range(300):  # steps with parents joining, against the twin
    k = rng.randint(0, 30)
    pages = np.array([rng.randint(1, 40) for _ in range(k)], np.int64)
    need = rng.randint(0, 800)
    u = np.random.default_rng(trial).random(need + 5)
    joins = lambda label: (label % 7) + 1 if label % 3 == 0 else None
    got = compiled.steps(u, 2, need, pages, k, joins, np.empty(k, np.int64))
    want = kernels.numpy_steps(u, 2, need, pages, k, joins, None)
    assert got[0].tolist() == want[0].tolist() and got[1:] == want[1:]
uniforms = np.random.default_rng(0).random(400)
uniforms[::7] = np.nextafter(1.0, 0.0)  # the largest uniform: the search's far end
for n in (0, 1, 9, 5_000, 10**7):
    for leaves in (1, 2, 13, 300):
        out = np.empty(leaves, np.int64)
        assert int(compiled.even_counts(uniforms, 3, n, leaves, out).sum()) == n
source = np.arange(5_000, dtype=np.int64)
for _ in range(200):
    k = rng.randint(0, 20)
    starts = np.array([rng.randrange(0, 4_000) for _ in range(k)], np.int64)
    lengths = np.array([rng.randrange(0, 900) for _ in range(k)], np.int64)
    out, twin = np.empty(20_000, np.int64), np.empty(20_000, np.int64)
    n = compiled.gather(source, starts, lengths, k, out)
    assert n == kernels.numpy_gather(source, starts, lengths, k, twin)
    assert (out[:n] == twin[:n]).all()
for _ in range(200):  # trim_gather against its twin, into the end of out
    k = rng.randint(0, 20)
    sizes = np.array([rng.randrange(1, 250) for _ in range(k)], np.int64)  # in source
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    slots = np.array(rng.sample(range(k), k), np.int64)
    taken = np.array([rng.randrange(0, int(sizes[i]) + 1) for i in slots], np.int64)
    at = rng.randrange(0, 50)
    room = at + int(taken.sum())
    out, twin = np.full(room, -1, np.int64), np.full(room, -1, np.int64)
    size, twin_size = sizes.copy(), sizes.copy()
    cut = compiled.trim_gather(size, slots, taken, k, 1, off, source, out, at)
    assert cut == kernels.numpy_trim_gather(twin_size, slots, taken, k, 1, off, source, twin, at)
    assert out.tolist() == twin.tolist() and size.tolist() == twin_size.tolist()
for _ in range(200):  # first_emptying against its twin
    k = rng.randint(1, 20)
    n = rng.randint(0, 500)
    picks = np.array([rng.randrange(k) for _ in range(n)], np.int64)
    left = np.array([rng.randint(1, 60) for _ in range(k)], np.int64)
    at, counts = compiled.first_emptying(picks, n, left, k, np.empty(k, np.int64))
    want_at, want = kernels.numpy_first_emptying(picks, n, left, k, None)
    assert at == want_at and counts.tolist() == want.tolist()
for trial in range(300):  # counts_emptying against its twin
    k = rng.randint(1, 16)
    counts = np.array([rng.randint(0, 300) for _ in range(k)], np.int64)
    left = np.array([rng.randint(1, 300) for _ in range(k)], np.int64)
    u = np.random.default_rng(trial).random(rng.randint(0, 200))
    try:
        got = compiled.counts_emptying(counts, left, k, u, 0, np.empty(k, np.int64))
    except ValueError as error:  # too few uniforms: the twin says so too
        assert "fewer than needed" in str(error)
        continue
    want = kernels.numpy_counts_emptying(counts, left, k, u, 0, None)
    assert got[:2] == want[:2] and got[2].tolist() == want[2].tolist()
for trial in range(200):  # cut_rounds against its twin, refilling a small buffer
    k = rng.randint(0, 12)
    sizes = [rng.choice([rng.randint(1, 9), rng.randint(100, 3_000)]) for _ in range(k)]
    pages = np.array(sizes, np.int64)
    need = rng.randint(0, int(pages.sum()) + 50)
    room = max(k * (need.bit_length() + 2), 1) + rng.randint(0, 9)
    results = []
    for fn in (compiled.cut_rounds, kernels.numpy_cut_rounds):
        g = np.random.default_rng(trial)
        buf = g.random(room)
        joins = lambda label: 200 + label if label % 2 == 0 else None
        got = fn(buf, 0, need, pages, k, joins, lambda: g.random(out=buf), np.empty(k, np.int64))
        results.append((got[0].tolist(), *got[1:]))
    assert results[0] == results[1]
print("clean")
"""


@pytest.mark.slow
def test_the_compiled_loops_are_memory_clean_under_sanitizers(tmp_path: Path) -> None:
    """The extension built with AddressSanitizer and UndefinedBehaviorSanitizer runs a
    workload of inserts, matches and evictions (every path of the draw) and gathers, and
    neither reports anything (a report aborts the process)."""
    compiler = shutil.which("gcc")
    if compiler is None:
        pytest.skip("no gcc here: the sanitizers' runtimes come with it")
    runtimes = [
        subprocess.run(
            [compiler, f"-print-file-name={lib}"], capture_output=True, text=True, check=True
        ).stdout.strip()
        for lib in ("libasan.so", "libubsan.so")
    ]
    if not all(Path(lib).is_absolute() and Path(lib).exists() for lib in runtimes):
        pytest.skip("gcc's sanitizer runtimes are not installed")
    package = tmp_path / "engine_ext"
    shutil.copytree(
        Path(kernels.__file__).parents[1],
        package,
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    built = subprocess.run(
        [
            compiler, "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
            "-fno-sanitize-recover=undefined", "-ffp-contract=off", "-shared", "-fPIC",
            f"-I{sysconfig.get_paths()['include']}", str(package / "cache" / "_kernels.c"),
            "-o", str(package / "cache" / f"_kernels{suffix}"),
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path),
        "LD_PRELOAD": " ".join(runtimes),
        "ASAN_OPTIONS": "detect_leaks=0",  # CPython itself keeps memory to the end
    }
    done = subprocess.run(
        [sys.executable, "-c", SANITIZED_WORKLOAD, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "clean"


@pytest.mark.slow
@pytest.mark.parametrize("pure", [False, True], ids=["with-loops", "pure"])
def test_the_wheel_carries_the_loops_unless_asked_not_to(tmp_path: Path, pure: bool) -> None:
    """``pip wheel`` builds the C loops into a wheel for this Python; ``KVROUTE_PURE=1`` makes
    a pure wheel for any CPython (what ``scripts/gpu_wheels.sh`` carries elsewhere)."""
    pytest.importorskip("wheel", reason="the dev extra's `wheel` builds without isolation")
    if not pure and not kernels.COMPILED:
        pytest.skip("the C extension does not build here (no C compiler)")
    repo, source = Path(kernels.__file__).parents[2], tmp_path / "source"
    for name in ("pyproject.toml", "setup.py", "README.md"):  # a copy: no build/ in the checkout
        source.mkdir(exist_ok=True)
        shutil.copy2(repo / name, source / name)
    for package in ("kvroute", "router_service", "models", "engine_ext", "sim"):
        skip = shutil.ignore_patterns("__pycache__", "*.so")
        shutil.copytree(repo / package, source / package, ignore=skip)
    env = {**os.environ, "KVROUTE_PURE": "1" if pure else "0"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(source)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvroute-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    compiled = [n for n in names if n.startswith("engine_ext/cache/_kernels") and n.endswith(".so")]
    assert "engine_ext/cache/kernels.py" in names
    assert "engine_ext/cache/_kernels.pyi" in names
    if pure:
        assert wheel.name.endswith("-py3-none-any.whl")
        assert compiled == []
    else:
        assert "-cp3" in wheel.name
        assert len(compiled) == 1
