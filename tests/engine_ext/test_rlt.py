"""RLT eviction: marking phases exactly as docs/design.md says, and its per-token distribution."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from engine_ext.cache import RadixCache, RLTEviction

pytestmark = pytest.mark.usefixtures("rlt_paths")

A, B, D, E = (1,) * 4, (2,) * 4, (3,) * 4, (4,) * 8


def rlt_cache(capacity: int, page_size: int = 1, seed: int = 0) -> tuple[RadixCache, RLTEviction]:
    cache = RadixCache(capacity, "rlt", page_size=page_size, rng=random.Random(seed))
    assert isinstance(cache.policy, RLTEviction)
    return cache, cache.policy


def _marked(cache: RadixCache, rlt: RLTEviction, key: tuple[int, ...]) -> bool:
    node = cache.root.children[key[0]]
    return rlt.is_marked(node)


# -- phases started on access -----------------------------------------------------------------
def test_marked_tokens_below_capacity_keep_the_phase() -> None:
    cache, rlt = rlt_cache(10)
    cache.insert((1, 2, 3, 4))
    cache.insert((5, 6, 7, 8))
    cache.match_prefix((1, 2, 3, 4))  # already marked: counted once
    assert rlt.marked_tokens == 8
    cache.insert((9,))
    assert rlt.marked_tokens == 9
    assert rlt.phases_started == 0
    assert all(_marked(cache, rlt, k) for k in [(1,), (5,), (9,)])


def test_marked_tokens_reaching_capacity_start_a_phase_and_remark_the_path() -> None:
    cache, rlt = rlt_cache(10)
    cache.insert((1, 2, 3, 4))
    cache.insert((5, 6, 7, 8))
    cache.insert((9, 9))  # 8 + 2 == C
    assert rlt.phases_started == 1
    assert rlt.marked_tokens == 2
    assert [_marked(cache, rlt, k) for k in [(1,), (5,), (9,)]] == [False, False, True]


def test_a_match_that_fills_the_phase_remarks_only_its_own_path() -> None:
    cache, rlt = rlt_cache(12)
    cache.insert((1, 1, 1, 1, 2, 2))
    rlt.new_phase()
    cache.insert((3,) * 6)  # marked: 6
    cache.insert((1, 1, 1, 1, 5, 5))  # marks (1,1,1,1) and (5,5): 12 == C -> new phase
    assert rlt.phases_started == 2
    assert rlt.marked_tokens == 6
    prefix = cache.root.children[1]
    assert rlt.is_marked(prefix)
    assert rlt.is_marked(prefix.children[5])
    assert not rlt.is_marked(prefix.children[2])
    assert not _marked(cache, rlt, (3,))


def test_pages_count_marked_tokens_in_whole_pages() -> None:
    cache, rlt = rlt_cache(16, page_size=4)
    cache.insert(tuple(range(10)))  # 8 aligned tokens
    assert rlt.marked_tokens == 8
    cache.insert(tuple(range(100, 107)))  # 4 more: 12
    assert rlt.phases_started == 0
    cache.insert(tuple(range(200, 204)))  # 16 == C
    assert rlt.phases_started == 1
    assert rlt.marked_tokens == 4


# -- phases started by evict ------------------------------------------------------------------
def four_leaves(capacity: int = 40) -> tuple[RadixCache, RLTEviction]:
    """Leaves A, B, D (4 tokens) and E (8); after a fresh phase A and E are marked (12)."""
    cache, rlt = rlt_cache(capacity)
    for key in (A, B, D, E):
        cache.insert(key)
    rlt.new_phase()
    cache.match_prefix(E)
    cache.match_prefix(A)
    assert rlt.marked_tokens == 12
    assert rlt.phases_started == 1
    return cache, rlt


def test_evict_within_the_unmarked_leaves_keeps_the_phase_and_the_marked_nodes() -> None:
    cache, rlt = four_leaves()
    assert cache.evict(8) == 8  # B and D hold exactly 8 unmarked tokens
    assert rlt.phases_started == 1
    assert [cache.peek_prefix(k) for k in (A, B, D, E)] == [4, 0, 0, 8]


def test_too_few_unmarked_tokens_start_a_phase() -> None:
    cache, rlt = four_leaves()
    assert cache.evict(9) == 9  # 9 + 12 < 40, but B and D hold only 8
    assert rlt.phases_started == 2
    assert cache.total_tokens == 20 - 9


def test_n_plus_marked_reaching_capacity_starts_a_phase() -> None:
    cache, rlt = four_leaves()
    assert cache.evict(28) == 20  # 28 + 12 == C: new phase, then all 20 tokens are too few
    assert rlt.phases_started == 3


def test_n_plus_marked_at_capacity_with_enough_tokens_starts_exactly_one_phase() -> None:
    cache, rlt = four_leaves(capacity=21)
    assert cache.evict(9) == 9  # 9 + 12 == C: one phase; all four leaves are candidates
    assert rlt.phases_started == 2
    assert rlt.marked_tokens == 0
    cache2, rlt2 = four_leaves(capacity=21)
    assert cache2.evict(8) == 8  # 8 + 12 < C and B, D hold 8: same phase
    assert rlt2.phases_started == 1
    assert [cache2.peek_prefix(k) for k in (A, B, D, E)] == [4, 0, 0, 8]


def test_evict_with_pages_rounds_up_to_whole_pages() -> None:
    cache, rlt = rlt_cache(40, page_size=4)
    for key in (A, B, D, E):
        cache.insert(key)
    rlt.new_phase()
    cache.match_prefix(E)
    cache.match_prefix(A)
    # 5 tokens = 2 pages = 8 tokens; 8 + 12 < 40 and B, D hold 2 pages: same phase.
    assert cache.evict(5) == 8
    assert rlt.phases_started == 1
    assert [cache.peek_prefix(k) for k in (A, B, D, E)] == [4, 0, 0, 8]


def test_no_candidates_at_all_frees_nothing() -> None:
    cache, rlt = rlt_cache(40)
    node = cache.insert(E).node
    cache.lock(node)
    assert cache.evict(3) == 0
    assert rlt.phases_started == 1  # none unmarked: new phase, still none (locked)
    assert cache.peek_prefix(E) == 8


def test_tokens_leave_from_the_tail_of_a_leaf() -> None:
    cache, rlt = rlt_cache(40)
    cache.insert((7, 8, 9, 10, 11, 12))
    rlt.new_phase()
    assert cache.evict(2) == 2
    assert cache.match_prefix((7, 8, 9, 10, 11, 12)).length == 4
    cache.check_invariants()


@pytest.mark.parametrize("parent_marked", [True, False])
def test_only_an_unmarked_parent_joins_the_candidates(parent_marked: bool) -> None:
    touched = 0
    for seed in range(200):
        cache, rlt = rlt_cache(100, seed=seed)
        cache.insert((1, 1, 1, 1, 1, 2, 2))
        cache.insert((1, 1, 1, 1, 1, 3, 3))
        cache.insert((4, 4, 4, 4))
        rlt.new_phase()
        if parent_marked:
            cache.match_prefix((1, 1, 1, 1, 1))  # marks the shared parent only
        # 5 picks over leaves of 2, 2 and 4 tokens: when both 2-token children empty within
        # the first 4, their parent competes for the last pick, unless it is marked.
        assert cache.evict(5) == 5
        assert rlt.phases_started == 1
        touched += cache.peek_prefix((1, 1, 1, 1, 1)) < 5
    if parent_marked:
        assert touched == 0
    else:
        assert touched > 0


def test_reset_clears_marks() -> None:
    cache, rlt = rlt_cache(40)
    cache.insert(A)
    cache.reset()
    assert rlt.marked_tokens == 0
    cache.insert(A)
    assert rlt.marked_tokens == 4


# -- the distribution, through the real cache --------------------------------------------------
# root -+- P(5) -+- X(3)      P is unmarked: it joins once X and Y have emptied
#       |        +- Y(2)
#       +- Z(4)
#       +- M(6, marked)
P, X, Y, Z, M = (1,) * 5, (2,) * 3, (3,) * 2, (4,) * 4, (5,) * 6
SIZES = {"X": 3, "Y": 2, "Z": 4, "P": 5}


def real_evictions(need: int, seed: int) -> tuple[int, ...]:
    cache, rlt = rlt_cache(100, seed=seed)
    for key in (P + X, P + Y, Z, M):
        cache.insert(key)
    rlt.new_phase()
    cache.match_prefix(M)
    assert cache.evict(need) == need
    px, py = cache.peek_prefix(P + X), cache.peek_prefix(P + Y)
    left = {
        "X": max(0, px - 5),
        "Y": max(0, py - 5),
        "Z": cache.peek_prefix(Z),
        "P": min(5, px),
    }
    assert cache.peek_prefix(M) == 6
    return tuple(SIZES[k] - left[k] for k in ("X", "Y", "Z", "P"))


def literal_evictions(need: int, rng: random.Random) -> tuple[int, ...]:
    left = {"X": 3, "Y": 2, "Z": 4}
    dropped = dict.fromkeys(("X", "Y", "Z", "P"), 0)
    for _ in range(need):
        name = rng.choice(sorted(left))
        dropped[name] += 1
        left[name] -= 1
        if left[name] == 0:
            del left[name]
            if name in ("X", "Y") and "X" not in left and "Y" not in left:
                left["P"] = 5  # childless, unmarked, unlocked: joins
    return tuple(dropped[k] for k in ("X", "Y", "Z", "P"))


@pytest.mark.parametrize("need", [4, 8])
def test_rlt_evict_matches_the_per_token_definition(need: int) -> None:
    n = 3_000
    rng = random.Random(need)
    real = Counter(real_evictions(need, seed=i) for i in range(n))
    literal = Counter(literal_evictions(need, rng) for _ in range(n))
    outcomes = sorted(o for o in real.keys() | literal.keys() if real[o] + literal[o] >= 10)
    table = np.asarray([[real[o] for o in outcomes], [literal[o] for o in outcomes]])
    assert table.sum() >= 2 * n - 40
    assert chi2_contingency(table).pvalue > 0.001
    if need == 8:
        assert any(o[3] > 0 for o in real), "the parent joined in some runs"


def leaf_state(cache: RadixCache) -> list[tuple[int, int]]:
    """The leaves in the registry's order, as (node id, tokens), after checking the tree."""
    cache.check_invariants()
    return [(node.node_id, len(node.key)) for node in cache.leaves]


def served(path: str, seed: int, page: int, marking: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A seeded workload (matches that lock their prefix for a while, inserts, evictions of
    1 to 2,000 tokens) on a 3,000-token cache, by RLT's ``path``: what every eviction freed
    and the leaves after every step, and the phases started."""
    from rlt_paths import use_path

    use_path(path, monkeypatch)
    rng = random.Random(seed)
    cache = RadixCache(3_000, "rlt", page_size=page, rng=random.Random(seed), marking=marking)
    prefixes = [
        tuple(rng.randrange(1, 999) for _ in range(rng.randint(1, 16) * 4)) for _ in range(6)
    ]
    trace: list[Any] = []
    locked: list[Any] = []
    for step in range(200):
        key = rng.choice(prefixes) + tuple(
            rng.randrange(1, 999) for _ in range(rng.randint(1, 60) * 4)
        )
        match = cache.match_prefix(key)
        cache.lock(match.node)
        locked.append(match.node)
        if cache.ensure_free(len(key)):
            cache.insert(key)
        if len(locked) > 3 or step % 3:
            cache.unlock(locked.pop(0))
        if step % 7 == 0:
            trace.append(cache.evict(rng.choice([1, 4, 64, 500, 2_000])))
        trace.append(leaf_state(cache))
    return trace, cache.policy.phases_started  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_draw_is_the_reference_loop(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled path makes the reference loop's picks from the same uniforms and applies
    them in a batch: the same tokens freed by every eviction and the same leaves, in the
    same order, after every step (locks, both markings, pages, leaves and their parents
    emptying)."""
    page, marking = (1, 2, 4)[seed % 3], ("path", "split")[seed % 2]
    reference = served("reference", seed, page, marking, monkeypatch)
    compiled = served("compiled", seed, page, marking, monkeypatch)
    assert compiled == reference
    trace, phases = reference
    assert phases > 1
    assert any(isinstance(freed, int) and freed > 0 for freed in trace)


@pytest.mark.parametrize("seed", range(40))
def test_a_large_eviction_from_chains_frees_exactly_what_is_asked(seed: int) -> None:
    """Chains under a shared prefix (multi-turn chats): a big eviction empties leaves and
    their parents join, some after the last pick (they must lose nothing)."""
    gen = np.random.default_rng(seed)
    cache, _ = rlt_cache(100_000, seed=seed)
    system = tuple(range(10_000, 10_064))
    for _chat in range(48):
        history = system
        for _turn in range(int(gen.integers(2, 5))):
            history += tuple(int(t) for t in gen.integers(0, 10_000, size=int(gen.integers(8, 24))))
            cache.insert(history)
    before = cache.total_tokens
    need = int(gen.integers(200, 900))
    assert cache.evict(need) == need
    assert cache.total_tokens == before - need
    cache.check_invariants()


# -- what a match marks: the whole path (ours) or only what it splits (the paper's) -----------
def split_cache(capacity: int) -> tuple[RadixCache, RLTEviction]:
    cache = RadixCache(capacity, "rlt", rng=random.Random(0), marking="split")
    assert isinstance(cache.policy, RLTEviction)
    return cache, cache.policy


@pytest.mark.parametrize("marking", ["path", "split"])
def test_an_insert_marks_its_path_under_either_marking(marking: str) -> None:
    cache = RadixCache(100, "rlt", rng=random.Random(0), marking=marking)
    rlt = cache.policy
    assert isinstance(rlt, RLTEviction)
    cache.insert((1, 2, 3, 4))
    rlt.new_phase()
    cache.insert((1, 2, 3, 4, 5, 6))  # walks (1,2,3,4), adds (5,6)
    assert rlt.marked_tokens == 6
    assert _marked(cache, rlt, (1,))


def test_a_whole_node_match_marks_under_path_and_not_under_split() -> None:
    ours, ours_rlt = rlt_cache(100)
    paper, paper_rlt = split_cache(100)
    for cache, rlt in ((ours, ours_rlt), (paper, paper_rlt)):
        cache.insert((1, 2, 3, 4))
        rlt.new_phase()
        assert cache.match_prefix((1, 2, 3, 4, 9)).length == 4  # no split: the node is whole
    assert _marked(ours, ours_rlt, (1,))
    assert ours_rlt.marked_tokens == 4
    assert not _marked(paper, paper_rlt, (1,))
    assert paper_rlt.marked_tokens == 0


def test_a_split_match_marks_only_the_split_off_node_under_split() -> None:
    cache, rlt = split_cache(100)
    cache.insert((1, 2))
    cache.insert((1, 2, 3, 4, 5, 6))  # (1,2) -> (3,4,5,6)
    rlt.new_phase()
    assert cache.match_prefix((1, 2, 3, 4, 9)).length == 4  # splits (3,4,5,6) at 2
    upper = cache.root.children[1].children[3]
    assert upper.key == (3, 4)
    assert rlt.is_marked(upper)
    assert not rlt.is_marked(cache.root.children[1])  # the whole node above: not marked
    assert not rlt.is_marked(upper.children[5])  # the lower half keeps its (old) mark
    assert rlt.marked_tokens == 2


def test_a_split_match_that_fills_the_phase_remarks_its_whole_path_under_split() -> None:
    cache, rlt = split_cache(8)
    cache.insert((1, 2))
    cache.insert((1, 2, 3, 4, 5, 6))
    rlt.new_phase()
    cache.insert((7,) * 6)  # marked: 6
    cache.match_prefix((1, 2, 3, 4, 9))  # + the split-off (3,4): 8 == C -> a new phase
    assert rlt.phases_started == 2
    assert rlt.is_marked(cache.root.children[1])
    assert rlt.marked_tokens == 4
    assert not _marked(cache, rlt, (7,))


def test_path_marking_is_the_default_and_unknown_markings_are_refused() -> None:
    assert RadixCache(8, "rlt").marking == "path"
    with pytest.raises(ValueError, match="unknown marking 'all'; known: path, split"):
        RadixCache(8, "rlt", marking="all")
