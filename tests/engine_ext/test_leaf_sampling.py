"""The batched RLT sampler against the literal per-page definition (docs/design.md).

The literal loop is written here from the definition: ``need`` times, pick one candidate leaf
uniformly at random and drop one page from it; a leaf that empties leaves the set and its
parent joins when it is now childless and neither marked nor locked. Both are run many times
on a small tree with nested parents and the distributions of the per-node evicted pages are
compared with a chi-square test of homogeneity.
"""

from __future__ import annotations

import copy
import pickle
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from leaf_plans import draw_leaf_evictions
from scipy.stats import chi2_contingency, chisquare, gamma, kstest

from engine_ext.cache import leaf_sampling
from engine_ext.cache.leaf_sampling import _choose


@dataclass(eq=False)
class Node:
    """A tree node in pages; ``blocked`` stands for marked or locked (it never joins)."""

    name: str
    pages: int
    parent: Node | None = None
    blocked: bool = False
    children: int = 0


SMALL = {"A": 3, "A1": 2, "A2": 1, "B": 2, "B1": 1, "B11": 2, "C": 4, "E": 2, "E1": 1}
# Leaves of 2 pages or more: the sampler starts with whole multinomial rounds and switches to
# the continuous-time draw once the smallest leaf shrinks (both paths in one draw).
BIG = {"A": 3, "A1": 3, "A2": 2, "B": 2, "B1": 2, "B11": 3, "C": 5, "E": 2, "E1": 2}


def small_tree(sizes: dict[str, int] = SMALL) -> tuple[list[Node], list[Node]]:
    """Leaves (initial candidates, in order) and every node, in a fixed order.

    Pages per node as in ``SMALL`` (shown) or ``BIG``::

        root -+- A(3) -+- A1(2)        A joins when A1 and A2 have both emptied
              |        +- A2(1)
              +- B(2) --- B1(1) --- B11(2)   nested: B11 empties -> B1 joins -> B joins
              +- C(4)
              +- E(2, marked) --- E1(1)      E never joins
    """
    a = Node("A", sizes["A"])
    b = Node("B", sizes["B"])
    b1 = Node("B1", sizes["B1"], b)
    e = Node("E", sizes["E"], blocked=True)
    leaves = [
        Node("A1", sizes["A1"], a),
        Node("A2", sizes["A2"], a),
        Node("B11", sizes["B11"], b1),
        Node("C", sizes["C"]),
        Node("E1", sizes["E1"], e),
    ]
    everything = [*leaves, a, b1, b, e]
    for node in everything:
        if node.parent is not None:
            node.parent.children += 1
    return leaves, everything


def joins_tracker() -> Callable[[Node], tuple[Node, int] | None]:
    """A fresh ``parent_joins`` callback (it counts the children left per parent)."""
    left: dict[Node, int] = {}

    def parent_joins(leaf: Node) -> tuple[Node, int] | None:
        parent = leaf.parent
        if parent is None or parent.blocked:
            return None
        left[parent] = left.get(parent, parent.children) - 1
        return (parent, parent.pages) if left[parent] == 0 else None

    return parent_joins


def literal_evictions(leaves: list[Node], need: int, rng: random.Random) -> dict[Node, int]:
    """The definition, one page at a time."""
    active = [[leaf, leaf.pages] for leaf in leaves]
    parent_joins = joins_tracker()
    dropped: Counter[Node] = Counter()
    for _ in range(need):
        if not active:
            break
        i = rng.randrange(len(active))
        node, left = active[i]
        dropped[node] += 1
        if left > 1:
            active[i][1] = left - 1
            continue
        active.pop(i)
        joined = parent_joins(node)
        if joined is not None:
            active.append(list(joined))
    return dict(dropped)


def batched_evictions(
    leaves: list[Node], need: int, gen: np.random.Generator, **options: Any
) -> dict[Node, int]:
    candidates = [(leaf, leaf.pages) for leaf in leaves]
    plan = draw_leaf_evictions(candidates, need, gen, joins_tracker(), **options)
    out: dict[Node, int] = {}
    for node, pages in plan:
        assert node not in out, f"{node.name} appears twice in the plan"
        out[node] = pages
    return out


def outcome(dropped: dict[Node, int], everything: list[Node]) -> tuple[int, ...]:
    return tuple(dropped.get(node, 0) for node in everything)


SAMPLES = 6_000  # detects, e.g., parents' clocks running 30% fast (p < 1e-4)
REACHABLE_PAGES = 2 + 1 + 2 + 4 + 1 + 3 + 1 + 2  # leaves plus A, B1, B (E is marked)


@pytest.mark.parametrize(
    ("sizes", "need", "method", "max_rounds"),
    [
        (SMALL, 1, None, None),  # one pick
        (SMALL, 2, None, None),  # A2 and E1 (one page) may empty
        (SMALL, 5, None, None),  # leaves empty, A and B1 may join
        (SMALL, 9, None, None),  # around the leaves' total (10): parents join in most runs
        (SMALL, 13, None, None),  # deep into the parents: B joins after B1
        (BIG, 12, None, None),  # the default choice of rounds and the continuous-time draw
        (BIG, 18, None, None),  # beyond the leaves' total (15)
        (SMALL, 9, "continuous", None),  # the continuous-time draw alone
        (BIG, 12, "multinomial", None),  # multinomial rounds, then the continuous-time draw
        (BIG, 12, "cut", 2),  # two cut rounds (each ends at an emptying), then continuous
        (SMALL, 9, "cut", 100),  # cut rounds alone, parents joining between them
        (SMALL, 9, "steps", None),  # page by page, parents joining on the way
        (SMALL, 13, "steps", None),  # deep into the parents
        (BIG, 18, "steps", None),  # beyond the leaves' total
        # the same draws by compiled rounds of counts, cut at each first emptying
        (SMALL, 2, "rounds", None),
        (SMALL, 9, "rounds", None),
        (SMALL, 13, "rounds", None),
        (BIG, 12, "rounds", None),
        (BIG, 18, "rounds", None),
    ],
    ids=[
        "small-1",
        "small-2",
        "small-5",
        "small-9",
        "small-13",
        "big-12",
        "big-18",
        "small-9-continuous",
        "big-12-multinomial",
        "big-12-cut-then-continuous",
        "small-9-cut",
        "small-9-steps",
        "small-13-steps",
        "big-18-steps",
        "small-2-rounds",
        "small-9-rounds",
        "small-13-rounds",
        "big-12-rounds",
        "big-18-rounds",
    ],
)
def test_batched_sampler_matches_the_per_page_definition(
    sizes: dict[str, int], need: int, method: str | None, max_rounds: int | None
) -> None:
    extra: dict[str, Any] = {"method": method}
    if max_rounds is not None:
        extra["max_rounds"] = max_rounds
    check_against_definition(sizes, need, extra)


@pytest.mark.parametrize(
    ("sizes", "need", "method", "patch"),
    [
        # The walk stops when the expected rings reach `need` exactly: the sample there
        # falls short about half the time, so both the early stop and the walk on from it run.
        (SMALL, 9, "continuous", {"_STOP_MARGIN_SD": 0.0, "_STOP_MARGIN_RINGS": 0.0}),
        (BIG, 18, "continuous", {"_STOP_MARGIN_SD": 0.0, "_STOP_MARGIN_RINGS": 0.0}),
        (BIG, 14, "continuous", {"_STOP_MARGIN_SD": 1.0, "_STOP_MARGIN_RINGS": 0.0}),
        # A narrow margin: the probe below the target often lands above it (bisect below).
        (BIG, 14, "continuous", {"_STOP_MARGIN_SD": 0.3, "_STOP_MARGIN_RINGS": 0.0}),
        # Bisection over the emptyings down to a gap with none, then a hypergeometric draw
        # (by default a gap this small has its rings ordered by time at once).
        (SMALL, 9, "continuous", {"_SORT_GAP_RINGS": 0}),
        (BIG, 18, "continuous", {"_SORT_GAP_RINGS": 0}),
        (BIG, 14, "continuous", {"_SORT_GAP_RINGS": 0, "_STOP_MARGIN_SD": 0.3}),
        # Bisection until the span holds at most 3 rings, then their times (both, mostly).
        (BIG, 18, "continuous", {"_SORT_GAP_RINGS": 3}),
        # Cut rounds whose picks come as counts (one binomial per leaf, ``Draws.even_counts``),
        # their order drawn only if a leaf empties; multinomial rounds drawn the same way.
        (SMALL, 5, "cut", {"_MULTINOMIAL_PICKS_PER_LEAF": 0, "_BINOMIAL_PICKS_PER_LEAF": 0}),
        (BIG, 12, "cut", {"_MULTINOMIAL_PICKS_PER_LEAF": 0, "_BINOMIAL_PICKS_PER_LEAF": 0}),
        (BIG, 12, "multinomial", {"_BINOMIAL_PICKS_PER_LEAF": 0}),
        (BIG, 12, None, {"_MULTINOMIAL_PICKS_PER_LEAF": 0, "_BINOMIAL_PICKS_PER_LEAF": 0}),
    ],
    ids=[
        "small-9-stop",
        "big-18-stop",
        "big-14-stop",
        "big-14-narrow-stop",
        "small-9-bisect",
        "big-18-bisect",
        "big-14-narrow-bisect",
        "big-18-bisect-then-sort",
        "small-5-counts",
        "big-12-counts",
        "big-12-multinomial-counts",
        "big-12-default-counts",
    ],
)
def test_shortcuts_match_the_per_page_definition(
    sizes: dict[str, int],
    need: int,
    method: str | None,
    patch: dict[str, float],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in patch.items():
        assert hasattr(leaf_sampling, name)
        monkeypatch.setattr(leaf_sampling, name, value)
    check_against_definition(sizes, need, {"method": method})


@pytest.mark.parametrize(
    ("sizes", "need", "method"),
    [(SMALL, 5, "cut"), (BIG, 12, "cut"), (BIG, 12, None), (SMALL, 9, "rounds")],
    ids=["small-5", "big-12", "big-12-default", "small-9-rounds"],
)
def test_counts_rounds_on_any_generator_match_the_per_page_definition(
    sizes: dict[str, int], need: int, method: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain numpy generator draws a round's counts as one multinomial; where the first
    leaf empties among them comes from its own uniforms (``_counts_emptying``); compiled
    rounds (``rounds``) fill and refill a buffer of their own from it."""
    monkeypatch.setattr(leaf_sampling, "_MULTINOMIAL_PICKS_PER_LEAF", 0)
    check_against_definition(sizes, need, {"method": method}, np.random.default_rng(need))


@pytest.mark.parametrize("need", [5, 9, 13])
def test_rounds_chosen_for_a_plain_generator_match_the_per_page_definition(
    need: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_choose`` takes the compiled rounds with any generator; a first round through
    ``draw_first_round`` (a handful of leaves) then draws nothing from a plain generator,
    which has no buffer to read ahead, and the rounds draw it all."""
    monkeypatch.setattr(leaf_sampling, "_BINOMIAL_PICKS_PER_LEAF", 1)  # rounds on a small tree
    monkeypatch.setattr(leaf_sampling, "FEW_LEAVES", 32)  # the lists' path, as without C
    pages = [size for name, size in SMALL.items() if name in ("A1", "A2", "B11", "C", "E1")]
    assert leaf_sampling._choose(pages, need, leaf_sampling._MAX_ROUNDS) == "rounds"
    check_against_definition(SMALL, need, {}, np.random.default_rng(need))


def check_against_definition(
    sizes: dict[str, int],
    need: int,
    extra: dict[str, Any],
    gen: np.random.Generator | None = None,
) -> None:
    leaves, everything = small_tree(sizes)
    rng = random.Random(1234 + need)
    if gen is None:
        gen = leaf_sampling.Draws(4321 + need, buffer=64)  # RLT's generator; refills often
    literal_draws = [
        outcome(literal_evictions(leaves, need, rng), everything) for _ in range(SAMPLES)
    ]
    batched_draws = [
        outcome(batched_evictions(leaves, need, gen, **extra), everything) for _ in range(SAMPLES)
    ]
    for result in batched_draws:
        assert sum(result) == need, "every draw drops exactly `need` pages when enough exist"
    # Joint distribution of the per-node counts: chi-square test of homogeneity, rare
    # outcomes pooled so that every cell of the table is well populated.
    literal, batched = Counter(literal_draws), Counter(batched_draws)
    common = sorted(o for o in literal.keys() | batched.keys() if literal[o] + batched[o] >= 20)
    table = [[literal[o] for o in common], [batched[o] for o in common]]
    rare = [SAMPLES - sum(row) for row in table]
    if sum(rare) >= 20:
        for row, count in zip(table, rare, strict=True):
            row.append(count)
    if len(table[0]) > 1:
        p_value = chi2_contingency(np.asarray(table)).pvalue
        assert p_value > 0.001, f"need={need}: distributions differ (p={p_value:.2e})"
    else:
        assert literal == batched
    # Mean pages per node: a sharper check of one statistic.
    lit, bat = np.asarray(literal_draws, float), np.asarray(batched_draws, float)
    stderr = np.sqrt((lit.var(axis=0) + bat.var(axis=0)) / SAMPLES) + 1e-12
    z = np.abs(lit.mean(axis=0) - bat.mean(axis=0)) / stderr
    assert (z < 4.5).all(), dict(zip([x.name for x in everything], z.round(2), strict=True))


@pytest.mark.parametrize("need", [REACHABLE_PAGES, REACHABLE_PAGES + 1, 100])
def test_need_at_or_above_every_reachable_page_drops_them_all(need: int) -> None:
    leaves, everything = small_tree()
    dropped = batched_evictions(leaves, need, np.random.default_rng(need))
    expected = {node: node.pages for node in everything if node.name not in ("E",)}
    assert dropped == expected


def test_plan_lists_emptied_leaves_in_order_children_first_then_partial_trims() -> None:
    gen = np.random.default_rng(11)
    saw_partial = saw_parent = False
    for _ in range(2_000):
        leaves, _ = small_tree()
        plan = draw_leaf_evictions([(leaf, leaf.pages) for leaf in leaves], 9, gen, joins_tracker())
        full = [i for i, (node, pages) in enumerate(plan) if pages == node.pages]
        partial = [i for i, (node, pages) in enumerate(plan) if 0 < pages < node.pages]
        assert len(full) + len(partial) == len(plan), "no entry drops 0 pages"
        assert not full or not partial or max(full) < min(partial), "emptied leaves come first"
        position = {node: i for i, (node, _) in enumerate(plan)}
        for node, i in position.items():
            if node.parent is not None and node.parent in position:
                saw_parent = True
                assert i < position[node.parent], f"{node.name} must come before its parent"
                assert plan[i][1] == node.pages, "a parent is only trimmed once its child is gone"
        saw_partial = saw_partial or bool(partial)
    assert saw_partial
    assert saw_parent


@pytest.mark.parametrize("need", [0, -3])
def test_nothing_to_do_for_non_positive_need(need: int) -> None:
    leaves, _ = small_tree()
    gen = np.random.default_rng(0)
    assert draw_leaf_evictions([(x, x.pages) for x in leaves], need, gen, joins_tracker()) == []


def test_nothing_to_do_without_candidates() -> None:
    assert draw_leaf_evictions([], 5, np.random.default_rng(0), joins_tracker()) == []


def test_small_need_uses_uniform_picks_over_all_candidates() -> None:
    """need <= every leaf's size: nothing empties early; picks are uniform over leaves."""
    leaves = [Node(f"L{i}", 10) for i in range(4)]
    gen = np.random.default_rng(3)
    totals = Counter[str]()
    for _ in range(5_000):
        plan = draw_leaf_evictions([(x, x.pages) for x in leaves], 3, gen, joins_tracker())
        assert sum(pages for _, pages in plan) == 3
        for node, pages in plan:
            totals[node.name] += pages
    # 15000 picks over 4 leaves: each near 3750 (sd ~53).
    assert all(abs(totals[x.name] - 3_750) < 300 for x in leaves), totals


def test_an_unknown_method_is_refused() -> None:
    leaves, _ = small_tree()
    with pytest.raises(ValueError, match="unknown method 'fast'; known: multinomial, cut"):
        batched_evictions(leaves, 3, np.random.default_rng(0), method="fast")


@pytest.mark.parametrize(
    ("sizes", "need", "expected"),
    [
        ([5_000] * 12, 40_000, "multinomial"),  # a few big leaves: O(leaves) rounds
        ([200] * 260, 1_000, "cut"),  # many leaves, none can empty: one O(need) round
        ([40] * 380, 10_000, "continuous"),  # most leaves empty: one step per emptying
        ([30] * 20 + [200] * 300, 400, "cut"),  # no leaf is likely to empty
    ],
)
def test_the_cheapest_exact_path_is_chosen_from_the_sizes(
    sizes: list[int], need: int, expected: str
) -> None:
    assert _choose(np.asarray(sizes), need, 8) == expected
    assert _choose(sizes, need, 8) == expected  # the list form decides alike


@pytest.mark.parametrize(
    ("sizes", "need", "expected"),
    [
        ([40] * 380, 10_000, "steps"),  # leaves empty within a buffer's worth of pages
        ([1] + [200] * 300, 400, "steps"),  # one short leaf (a cache RLT has trimmed)
        # long documents, one trimmed short: 533 picks a leaf, drawn as a binomial a leaf
        # each round, a round per emptying (``kernels.cut_rounds``)
        ([300] + [8_000] * 14, 8_000, "rounds"),
        ([100] + [8_000] * 14, 1_900, "steps"),  # 127 picks a leaf: page by page
        ([100] * 10 + [50_000] * 5, 2_000, "steps"),  # 10 leaves likely to empty: pages
        ([30] * 20 + [200] * 300, 400, "cut"),  # none likely to empty: one round
        ([200] * 260, 1_000, "cut"),  # none can empty
        ([5_000] * 12, 40_000, "multinomial"),  # past the step limit
        ([40] * 380, 14_000, "continuous"),
    ],
)
def test_a_draw_likely_to_empty_a_leaf_goes_page_by_page(
    sizes: list[int], need: int, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a generator that can (a ``Draws`` whose buffer holds ``need`` uniforms), a draw
    of at most ``_STEP_PAGES`` pages in which a leaf is likely to empty runs page by page."""
    monkeypatch.setattr(leaf_sampling, "_STEP_PAGES", 12_000)
    gen = leaf_sampling.Draws(0)
    assert _choose(np.asarray(sizes), need, 8, None, leaf_sampling._stepwise(gen, need)) == expected
    assert not leaf_sampling._stepwise(np.random.default_rng(0), need)  # needs a buffer
    assert not leaf_sampling._stepwise(leaf_sampling.Draws(0, buffer=need - 1), need)


@pytest.mark.parametrize("sizes", [SMALL, BIG], ids=["small", "big"])
def test_few_leaves_start_with_python_lists_and_make_the_same_draws(
    sizes: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to ``FEW_LEAVES`` candidates the first round runs on lists; it consumes the
    generator exactly as the array path does, so a seed gives the same plan either way
    (with and without a leaf emptying in that round)."""
    plans: dict[bool, list[list[tuple[str, int]]]] = {}
    for few in (True, False):
        monkeypatch.setattr(leaf_sampling, "FEW_LEAVES", 32 if few else -1)
        gen = leaf_sampling.Draws(5, buffer=64)
        plans[few] = []
        for need in [1, 2, 3, 5, 9, 13] * 40:
            leaves, _ = small_tree(sizes)
            plan = draw_leaf_evictions([(x, x.pages) for x in leaves], need, gen, joins_tracker())
            plans[few].append([(node.name, pages) for node, pages in plan])
    assert plans[True] == plans[False]
    emptied = sum(any(p == sizes[n] for n, p in plan) for plan in plans[True])
    assert 0 < emptied < len(plans[True])  # both outcomes of the first round occur


def test_parent_clocks_are_gamma_distributed_whether_drawn_alone_or_in_batches() -> None:
    """``_GammaDraws``: the first draw of a size is a scalar call, later ones come from
    batches; all of them together are Gamma(c, 1) (Kolmogorov-Smirnov, fixed seed)."""
    draws = leaf_sampling._GammaDraws(np.random.default_rng(7))
    for pages in (1, 3, 40):
        values = [draws(pages) for _ in range(5_000)]
        assert kstest(values, gamma(pages).cdf).pvalue > 1e-3, pages
    firsts = [leaf_sampling._GammaDraws(np.random.default_rng(s))(3) for s in range(2_000)]
    assert kstest(firsts, gamma(3).cdf).pvalue > 1e-3  # the scalar first draws alone


def test_buffered_picks_are_uniform_and_each_uniform_is_used_once() -> None:
    """``Draws.picks``: i.i.d. uniform picks from a buffer of uniforms, across refills and
    for a request larger than the buffer (drawn directly)."""
    draws = leaf_sampling.Draws(9, buffer=1_000)
    sizes = [1, 999, 500, 501, 1_000, 3, 2_500, *range(1, 400, 7)] * 12
    picks = np.concatenate([draws.picks(7, n) for n in sizes])
    assert len(picks) == sum(sizes)
    assert picks.dtype.kind == "i"
    assert picks.min() == 0
    assert picks.max() == 6
    counts = np.bincount(picks, minlength=7)
    assert chisquare(counts).pvalue > 1e-3, counts
    # With ~2**52 leaves, two picks are equal only if they came from the same uniform: no
    # uniform is served twice, within a buffer or after a refill.
    many = np.concatenate([draws.picks(2**52, n) for n in (600, 300, 300, 1_200, 999)])
    assert len(np.unique(many)) == len(many)


def test_the_largest_uniform_still_picks_a_leaf_in_range() -> None:
    """floor(u * leaves) for the largest uniform below 1 is ``leaves - 1``, never
    ``leaves``, whatever the leaf count (up to 2**53)."""
    draws = leaf_sampling.Draws(0, buffer=8)
    for leaves in (1, 3, 264, 1_000_003, 2**31 - 1, 2**40 + 7, 2**52 + 1, 2**53 - 1):
        draws._uniforms[:] = np.nextafter(1.0, 0.0)
        draws._used = 0
        assert draws.picks(leaves, 8).tolist() == [leaves - 1] * 8, leaves


def test_a_seed_gives_the_same_picks() -> None:
    def run(seed: int) -> list[int]:
        draws = leaf_sampling.Draws(seed, buffer=50)
        return np.concatenate([draws.picks(11, n) for n in (20, 40, 60, 5)]).tolist()

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_the_buffer_is_refilled_in_place_with_the_generators_next_uniforms() -> None:
    """A refill draws over the used buffer (no new array) the values a fresh ``random``
    call would give: the buffer holds the generator's stream, block after block."""
    draws = leaf_sampling.Draws(9, buffer=8)
    stream = np.random.Generator(np.random.PCG64(9)).random(24)
    buffer, start = draws.window(8)
    assert start == 0
    assert buffer.tolist() == stream[:8].tolist()
    draws.consume(5)
    again, start = draws.window(4)  # 3 left: refilled
    assert again is buffer
    assert (start, again.tolist()) == (0, stream[8:16].tolist())
    draws.consume(4)
    assert draws.window(4) == (buffer, 4)  # enough left: as it was
    draws.picks(3, 6)  # past the end: refilled before the picks are taken
    assert buffer.tolist() == stream[16:24].tolist()


def test_a_copy_or_a_pickle_of_draws_goes_on_with_the_same_stream() -> None:
    draws = leaf_sampling.Draws(8, buffer=40)
    draws.picks(9, 25)
    for duplicate in (copy.deepcopy, lambda d: pickle.loads(pickle.dumps(d))):
        copied = duplicate(draws)
        assert type(copied) is leaf_sampling.Draws
        assert copied.picks(9, 30).tolist() == draws.picks(9, 30).tolist()  # a refill too
        assert copied.random() == draws.random()
        draws = copied
