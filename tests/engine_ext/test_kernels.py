"""RLT's compiled loops (``_kernels.c``): each does what ``kernels`` says, writes only where it
says, and refuses bad input with a clear error before writing anything. That the draw is the
reference loop's is checked on whole caches (``test_rlt.py``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext.cache import kernels


@pytest.fixture(scope="module")
def compiled() -> ModuleType:
    if not kernels.COMPILED:
        pytest.skip("the C extension is not built here (no C compiler at install time)")
    from engine_ext.cache import _kernels

    return _kernels


def test_the_extension_is_built_where_a_compiler_is() -> None:
    """``pip install`` builds the extension whenever a C compiler and Python's headers are
    there (it is optional only so that an install without them still works)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if not (compiler and headers):
        pytest.skip("no C compiler or Python headers: RLT runs its reference loop")
    assert kernels.COMPILED, "the C extension failed to build: see `pip install -v -e .`"
    assert kernels.gather is not kernels._numpy_gather


registries = st.integers(0, 40).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 6), min_size=n, max_size=n),  # marks (phase 0..6)
        st.lists(st.integers(1, 64), min_size=n, max_size=n),  # sizes in pages
        st.integers(0, n),  # end
        st.integers(0, 7),  # phase
        st.sampled_from([1, 2, 4]),  # page
    )
)


@settings(max_examples=200, deadline=None)
@given(registries)
def test_candidates_are_the_slots_below_the_phase(
    compiled: ModuleType, case: tuple[list[int], list[int], int, int, int]
) -> None:
    """The slots before ``end`` whose mark is below the phase, in order, with their whole
    pages and the sum of those; nothing written past them."""
    marks, sizes, end, phase, page = case
    mark = np.array(marks + [2**62] * 3, dtype=np.int64)  # spare slots past end, locked
    size = np.array([s * page + page - 1 for s in sizes] + [5, 5, 5], dtype=np.int64)
    slots, pages = np.full(len(mark), -7, np.int64), np.full(len(mark), -7, np.int64)
    k, total = compiled.candidates(mark, size, end, phase, page, slots, pages)
    want = [i for i in range(end) if marks[i] < phase]
    assert slots[:k].tolist() == want
    assert pages[:k].tolist() == [sizes[i] for i in want]
    assert total == sum(sizes[i] for i in want)
    assert (slots[k:] == -7).all()
    assert (pages[k:] == -7).all()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(0, 30)), min_size=1, max_size=20),
    st.sampled_from([1, 2, 4]),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_trim_cuts_the_tails(
    compiled: ModuleType, leaves: list[tuple[int, int]], page: int, runs: bool, rnd: Any
) -> None:
    sizes = [pages * page for pages, _ in leaves]
    chosen = sorted(rnd.sample(range(len(leaves)), rnd.randint(0, len(leaves))))
    taken = [min(leaves[i][1], leaves[i][0]) for i in chosen]
    slots = np.array(chosen, np.int64)
    cuts = np.array(taken, np.int64)
    off = np.arange(len(leaves), dtype=np.int64) * 1000
    size = np.array(sizes, np.int64)
    starts, lengths = np.full(len(slots), -1, np.int64), np.full(len(slots), -1, np.int64)
    args = (off, starts, lengths) if runs else (None, None, None)
    total = compiled.trim(size, slots, cuts, len(slots), page, *args)
    outcomes = [(total, size.tolist(), starts.tolist(), lengths.tolist())]
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
    compiled: ModuleType, leaves: list[tuple[int, int]], page: int, at: int, rnd: Any
) -> None:
    """``trim_gather`` == ``trim`` with runs, then ``gather`` of those runs into ``out`` from
    ``at``, and nothing written outside ``out[at:at + cut]``."""
    sizes = [pages * page for pages, _ in leaves]
    chosen = rnd.sample(range(len(leaves)), rnd.randint(0, len(leaves)))  # any order
    slots = np.array(chosen, np.int64)
    cuts = np.array([min(leaves[i][1], leaves[i][0]) for i in chosen], np.int64)
    off = np.cumsum([0, *sizes[:-1]]).astype(np.int64)  # leaves laid out one after another
    source = np.arange(1000, 1000 + sum(sizes), dtype=np.int64)
    want_size = np.array(sizes, np.int64)
    starts, lengths = np.empty(len(slots), np.int64), np.empty(len(slots), np.int64)
    want_cut = compiled.trim(want_size, slots, cuts, len(slots), page, off, starts, lengths)
    want = np.full(at + want_cut + 3, -1, np.int64)
    kernels._numpy_gather(source, starts, lengths, len(slots), want[at:])
    assert want_cut == int(cuts.sum()) * page
    size = np.array(sizes, np.int64)
    out = np.full(at + want_cut + 3, -1, np.int64)
    assert (
        compiled.trim_gather(size, slots, cuts, len(slots), page, off, source, out, at) == want_cut
    )
    assert out.tolist() == want.tolist()
    assert size.tolist() == want_size.tolist()


def test_trim_gather_refuses_a_short_out_before_writing(compiled: ModuleType) -> None:
    size, off = np.array([4, 6], np.int64), np.array([0, 4], np.int64)
    source, out = np.arange(10, dtype=np.int64), np.full(6, -1, np.int64)
    slots, taken = np.array([0, 1], np.int64), np.array([2, 3], np.int64)
    with pytest.raises(ValueError, match="out: 5 tokens cut, room for 4 after at"):
        compiled.trim_gather(size, slots, taken, 2, 1, off, source, out, 2)
    assert size.tolist() == [4, 6], "a refused call wrote nothing"
    assert out.tolist() == [-1] * 6
    assert compiled.trim_gather(size, slots, taken, 2, 1, off, source, out, 1) == 5
    assert size.tolist() == [2, 3]
    assert out.tolist() == [-1, 2, 3, 7, 8, 9]


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("impl", ["numpy", "compiled"])
def test_gather_copies_the_runs_in_order(impl: str, dtype: type) -> None:
    """The compiled ``gather`` and the numpy one an install without the extension uses."""
    if impl == "compiled" and not kernels.COMPILED:
        pytest.skip("the C extension is not built here")
    gather = kernels.gather if impl == "compiled" else kernels._numpy_gather
    source = np.arange(100, 200, dtype=dtype)
    starts = np.array([5, 0, 90, 40], np.int64)
    lengths = np.array([3, 2, 0, 4], np.int64)
    out = np.full(12, -1, dtype=dtype)
    assert gather(source, starts, lengths, 4, out) == 9
    assert out.tolist() == [105, 106, 107, 100, 101, 140, 141, 142, 143, -1, -1, -1]
    assert gather(source, starts, lengths, 1, out[9:]) == 3  # into a view, first run only
    assert out[9:].tolist() == [105, 106, 107]


def test_steps_picks_floor_u_times_the_active_leaves(compiled: ModuleType) -> None:
    """Two leaves of 2 and 1 pages: u 0.9 picks the second (it empties, and its parent of 5
    pages joins at the end), then 0.2 the first, 0.9 the parent, 0.4 the first (it
    empties), 0.5 the parent, alone."""
    taken = np.full(3, -7, np.int64)
    calls: list[int] = []

    def joins(label: int) -> int | None:
        calls.append(label)
        return 5 if label == 1 else None

    uniforms = np.array([0.9, 0.2, 0.9, 0.4, 0.5])
    emptied, joined = compiled.steps(uniforms, np.array([2, 1], np.int64), 2, joins, taken)
    assert (emptied, joined, calls) == ([1, 0], [2], [1, 0])
    assert taken.tolist() == [2, 1, -7]


def test_the_compiled_loops_refuse_bad_input_before_writing(compiled: ModuleType) -> None:
    candidates, steps, trim, gather = (
        compiled.candidates, compiled.steps, compiled.trim, compiled.gather
    )  # fmt: skip
    mark = np.zeros(4, np.int64)
    size = np.array([4, 4, 4, 4], np.int64)
    out = np.zeros(4, np.int64)
    with pytest.raises(TypeError, match="mark: expected a one-dimensional int64 array"):
        candidates(mark.astype(np.int32), size, 4, 1, 1, out, out.copy())
    frozen = np.zeros(4, np.int64)
    frozen.setflags(write=False)
    with pytest.raises(TypeError, match="slots_out: expected a writable"):
        candidates(mark, size, 4, 1, 1, frozen, out)
    with pytest.raises(TypeError, match="size: expected a"):
        candidates(mark, np.zeros(8, np.int64)[::2], 4, 1, 1, out, out.copy())
    with pytest.raises(ValueError, match="end: 5 is outside the arrays"):
        candidates(mark, size, 5, 1, 1, out, out.copy())
    with pytest.raises(ValueError, match="page: must be >= 1"):
        candidates(mark, size, 4, 1, 0, out, out.copy())
    with pytest.raises(TypeError, match=r"takes 7 arguments \(2 given\)"):
        candidates(mark, size)
    u, pages = np.full(8, 0.5), np.array([2, 3], np.int64)
    with pytest.raises(ValueError, match="k: 3 is outside the arrays"):
        steps(u, pages, 3, lambda label: None, out)
    with pytest.raises(ValueError, match=r"pages\[1\] = 0: every candidate must hold a page"):
        steps(u, np.array([2, 0], np.int64), 2, lambda label: None, out)
    with pytest.raises(TypeError, match="parent_joins: expected a callable"):
        steps(u, pages, 2, None, out)
    with pytest.raises(TypeError, match="parent_joins: must return an int or None"):
        steps(u, np.array([1, 1], np.int64), 2, lambda label: "A", out)
    with pytest.raises(ZeroDivisionError):  # the callback's own error goes through
        steps(u, np.array([1, 1], np.int64), 2, lambda label: 1 // 0, out)
    with pytest.raises(ValueError, match=r"uniforms\[1\] is not in \[0, 1\)"):
        steps(np.array([0.5, 1.0, 0.5]), pages, 2, lambda label: None, out)
    with pytest.raises(TypeError, match="uniforms: expected a one-dimensional float64"):
        steps(np.array([1, 2]), pages, 2, lambda label: None, out)
    before = size.tolist()
    with pytest.raises(ValueError, match=r"taken\[1\] = 5 pages: the leaf in slot 2 holds 4"):
        trim(size, np.array([0, 2], np.int64), np.array([1, 5], np.int64), 2, 1, None, None, None)
    with pytest.raises(IndexError, match=r"slots\[1\] = 9 is not a slot"):
        trim(size, np.array([0, 9], np.int64), np.array([1, 1], np.int64), 2, 1, None, None, None)
    assert size.tolist() == before, "a refused trim wrote nothing"
    with pytest.raises(ValueError, match=r"run 0 .* is outside source or out"):
        gather(np.arange(10), np.array([8], np.int64), np.array([5], np.int64), 1, out)
    trim_gather = compiled.trim_gather
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


def test_without_the_extension_the_reference_loop_runs() -> None:
    """An install that could not build the extension imports, says so and evicts (by the
    reference loop)."""
    script = """
import random, sys
sys.modules["engine_ext.cache._kernels"] = None  # what a failed build leaves: no module
from engine_ext.cache import RadixCache, kernels
assert not kernels.COMPILED and kernels.gather is kernels._numpy_gather
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
        if step % 9 == 0:  # small and large evictions: leaves and their parents empty
            cache.evict(rng.choice([4, 64, 1_000, 8_000, 30_000]))
    cache.check_invariants()
source = np.arange(5_000, dtype=np.int64)
for _ in range(200):  # gather and trim_gather against numpy
    k = rng.randint(0, 20)
    starts = np.array([rng.randrange(0, 4_000) for _ in range(k)], np.int64)
    lengths = np.array([rng.randrange(0, 900) for _ in range(k)], np.int64)
    out, twin = np.empty(20_000, np.int64), np.empty(20_000, np.int64)
    n = compiled.gather(source, starts, lengths, k, out)
    assert n == kernels._numpy_gather(source, starts, lengths, k, twin)
    assert (out[:n] == twin[:n]).all()
    sizes = np.array([rng.randrange(1, 250) for _ in range(k)], np.int64)  # in source
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    slots = np.array(rng.sample(range(k), k), np.int64)
    taken = np.array([rng.randrange(0, int(sizes[i]) + 1) for i in slots], np.int64)
    at = rng.randrange(0, 50)
    out = np.full(at + int(taken.sum()), -1, np.int64)
    cut = compiled.trim_gather(sizes, slots, taken, k, 1, off, source, out, at)
    assert cut == int(taken.sum())
print("clean")
"""


@pytest.mark.slow
def test_the_compiled_loops_are_memory_clean_under_sanitizers(tmp_path: Path) -> None:
    """The extension built with AddressSanitizer and UndefinedBehaviorSanitizer runs a
    workload of inserts, matches and evictions and gathers, and neither reports anything (a
    report aborts the process)."""
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
            "-fno-sanitize-recover=undefined", "-shared", "-fPIC",
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
