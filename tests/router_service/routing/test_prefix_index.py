"""The router's approximate prefix index: one tree, per-worker ownership and LRU trimming."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router_service.routing import PrefixIndex
from sim.tokens import ids_to_key


def lcp(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_per_worker_match_lengths_include_partial_node_matches() -> None:
    index = PrefixIndex()
    index.insert("abcdef", "w1", now_ms=0)
    index.insert("abcxyz", "w2", now_ms=1)
    index.insert("q", "w3", now_ms=2)
    assert index.match("abcdxx") == (4, {"w1": 4, "w2": 3})
    assert index.match("abcdef") == (6, {"w1": 6, "w2": 3})
    assert index.match("ab") == (2, {"w1": 2, "w2": 2})
    assert index.match("zzz") == (0, {})
    assert index.match("") == (0, {})


def test_units_count_each_worker_once_per_node() -> None:
    index = PrefixIndex()
    index.insert("abcdef", "w1", now_ms=0)
    index.insert("abcdef", "w1", now_ms=1)  # same text again: nothing new
    index.insert("abcxyz", "w1", now_ms=2)  # shares "abc"
    index.insert("abc", "w2", now_ms=3)
    assert index.units("w1") == 9
    assert index.units("w2") == 3
    assert index.units("nobody") == 0
    assert sorted(index.workers()) == ["w1", "w2"]
    index.check_invariants()


def test_token_id_keys_work_too() -> None:
    index = PrefixIndex()
    index.insert((1, 2, 3, 4), "w1", now_ms=0)
    assert index.match((1, 2, 3, 9)) == (3, {"w1": 3})
    index.insert(ids_to_key([7, 8, 9]), "w2", now_ms=0)
    assert index.match(ids_to_key([7, 8])) == (2, {"w2": 2})


def test_trim_drops_least_recently_sent_units_down_to_the_cap() -> None:
    index = PrefixIndex()
    index.insert("aaaa", "w1", now_ms=0)
    index.insert("bbbb", "w1", now_ms=1)
    index.insert("cccc", "w1", now_ms=2)
    index.insert("aaaa", "w2", now_ms=0)
    assert index.trim(max_units=8) == 4
    assert index.units("w1") == 8
    assert index.match("aaaa") == (4, {"w2": 4})  # w2's copy of the node stays
    assert index.match("bbbb") == (4, {"w1": 4})
    assert index.units("w2") == 4
    index.check_invariants()


def test_trim_goes_leaf_first_and_a_refreshed_path_is_recent() -> None:
    index = PrefixIndex()
    index.insert("abcd", "w1", now_ms=0)
    index.insert("xyz", "w1", now_ms=3)
    index.insert("abcdefgh", "w1", now_ms=5)  # refreshes "abcd" too
    assert index.units("w1") == 11
    # Leaves of w1: "efgh" (t=5), "xyz" (t=3): "xyz" goes first, then "efgh"; then "abcd"
    # is a leaf but the cap is met.
    assert index.trim(max_units=6) == 7
    assert index.units("w1") == 4
    assert index.match("abcdefgh") == (4, {"w1": 4})
    assert index.match("xyz") == (0, {})
    index.check_invariants()


def test_trim_leaves_workers_under_the_cap_alone() -> None:
    index = PrefixIndex()
    index.insert("abcdefgh", "w1", now_ms=0)
    index.insert("ab", "w2", now_ms=0)
    assert index.trim(max_units=8) == 0
    assert (index.units("w1"), index.units("w2")) == (8, 2)


def test_remove_worker_drops_its_entries_only() -> None:
    index = PrefixIndex()
    index.insert("abcdef", "w1", now_ms=0)
    index.insert("abcxyz", "w2", now_ms=1)
    index.remove_worker("w1")
    assert index.match("abcdef") == (3, {"w2": 3})
    assert index.units("w1") == 0
    assert index.workers() == ["w2"]
    index.check_invariants()
    index.remove_worker("w2")
    assert index.match("abcxyz") == (0, {})
    assert index.root.children == {}


texts = st.text(alphabet="abc", max_size=10)
index_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), texts, st.sampled_from(["w1", "w2", "w3"])),
        st.tuples(st.just("remove"), st.sampled_from(["w1", "w2", "w3"])),
        st.tuples(st.just("trim"), st.integers(0, 20)),
        st.tuples(st.just("match"), texts),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=index_ops)
def test_random_operations_keep_the_index_consistent(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    index = PrefixIndex()
    sent: dict[str, list[str]] = {}  # what each worker was sent (since its last removal)
    trimmed = False
    for now_ms, op in enumerate(ops):
        if op[0] == "insert":
            _, text, w = op
            index.insert(text, w, now_ms)
            sent.setdefault(w, []).append(text)
        elif op[0] == "remove":
            index.remove_worker(op[1])
            sent.pop(op[1], None)
            assert index.units(op[1]) == 0
        elif op[0] == "trim":
            before = {w: index.units(w) for w in index.workers()}
            dropped = index.trim(op[1])
            assert dropped == sum(b - index.units(w) for w, b in before.items())
            assert all(index.units(w) <= max(op[1], 0) for w in index.workers())
            trimmed = True
        index.check_invariants()
        query = op[1] if op[0] in ("insert", "match") else "abcabc"
        deepest, matched = index.match(query)
        for w, texts_sent in sent.items():
            truth = max((lcp(query, t) for t in texts_sent), default=0)
            got = matched.get(w, 0)
            # Without trimming the index is exact; trimming may only forget.
            assert got <= truth
            if not trimmed:
                assert got == truth
        assert deepest == max(matched.values(), default=0)
        if not trimmed:
            for w in sent:
                distinct: set[str] = set()
                for t in sent[w]:
                    distinct.update(t[:i] for i in range(1, len(t) + 1))
                assert index.units(w) == len(distinct)
