"""The router's approximate prefix index: one radix tree for all workers.

Each node records which workers were sent its units and when (ms). A request is matched once
for all workers: walking its path gives, for every worker, the deepest (partially) matched
node that worker holds, i.e. its approximate cached prefix. Like sglang-router's tree, the
index only knows what the router *sent*, not what the worker kept; per-worker size is capped
by trimming least-recently-used units on a timer (``trim``).

>>> index = PrefixIndex()
>>> index.insert("You are a helpful assistant. Hi", "http://w1", now_ms=0)
>>> index.insert("You are a helpful assistant. Bye", "http://w2", now_ms=1)
>>> index.match("You are a helpful assistant. Hi again")
(31, {'http://w1': 31, 'http://w2': 29})
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

from engine_ext.cache.keys import Key, common_prefix_length
from router_service.routing.survival import Segment

__all__ = ["PrefixIndex"]


class _Node:
    __slots__ = ("children", "key", "parent", "tenants")

    def __init__(self, key: Any, parent: _Node | None) -> None:
        self.key = key
        self.children: dict[Any, _Node] = {}
        self.parent = parent
        self.tenants: dict[str, float] = {}  # worker -> last time it was sent these units


class PrefixIndex:
    """Shared approximate tree with per-worker ownership and per-worker LRU trimming."""

    def __init__(self) -> None:
        self.root = _Node((), None)
        self._units: dict[str, int] = {}

    def units(self, worker: str) -> int:
        """How many units the index believes ``worker`` holds."""
        return self._units.get(worker, 0)

    def workers(self) -> list[str]:
        return list(self._units)

    def _walk(self, key: Key) -> Iterator[tuple[_Node, int, int]]:
        """The nodes ``key`` matches, root down, each with the units ``[start, end)`` of
        ``key`` it matches (the last may match part of its units)."""
        node, pos, n = self.root, 0, len(key)
        while pos < n:
            child = node.children.get(key[pos])
            if child is None:
                return
            common = common_prefix_length(child.key, key[pos : pos + len(child.key)])
            yield child, pos, pos + common
            if common < len(child.key):
                return
            node, pos = child, pos + common

    def match(self, key: Key) -> tuple[int, dict[str, int]]:
        """Deepest match overall and per worker; touches nothing."""
        pos = 0
        matched: dict[str, int] = {}
        for child, _, pos in self._walk(key):
            for worker in child.tenants:
                matched[worker] = pos
        return pos, matched

    def match_segments(self, key: Key, now_ms: float) -> dict[str, list[Segment]]:
        """Per worker, its matched part of ``key`` as segments ``(start, end, age_ms)``: the
        units of one node and how long ago the worker was last sent them (consecutive nodes of
        the same age merge). A worker's last segment ends where ``match`` says it matches.

        >>> index = PrefixIndex()
        >>> index.insert("abcdef", "w", now_ms=0)
        >>> index.insert("abcxyz", "w", now_ms=5_000)
        >>> index.match_segments("abcdeq", now_ms=6_000)
        {'w': [(0, 3, 1000.0), (3, 5, 6000.0)]}
        """
        segments: dict[str, list[Segment]] = {}
        for child, start, end in self._walk(key):
            for worker, sent_ms in child.tenants.items():
                age = max(0.0, float(now_ms - sent_ms))
                runs = segments.setdefault(worker, [])
                if runs and runs[-1][1] == start and runs[-1][2] == age:
                    runs[-1] = (runs[-1][0], end, age)
                else:
                    runs.append((start, end, age))
        return segments

    def insert(self, key: Key, worker: str, now_ms: float) -> None:
        """Record that ``worker`` was sent ``key``."""
        node, pos, n = self.root, 0, len(key)
        units = self._units.get(worker, 0)
        while pos < n:
            child = node.children.get(key[pos])
            if child is None:
                leaf = _Node(key[pos:], node)
                leaf.tenants[worker] = now_ms
                node.children[key[pos]] = leaf
                units += n - pos
                break
            common = common_prefix_length(child.key, key[pos : pos + len(child.key)])
            if common < len(child.key):
                child = self._split(child, common)
            if worker not in child.tenants:
                units += len(child.key)
            child.tenants[worker] = now_ms
            node, pos = child, pos + common
        self._units[worker] = units

    def _split(self, child: _Node, at: int) -> _Node:
        parent = child.parent
        assert parent is not None
        upper = _Node(child.key[:at], parent)
        upper.tenants = dict(child.tenants)
        parent.children[child.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def remove_worker(self, worker: str) -> None:
        """Forget everything sent to ``worker`` (it left the fleet)."""
        for node in list(self._iter_nodes()):
            node.tenants.pop(worker, None)
            if not node.tenants and node is not self.root:
                self._detach(node)
        self._units.pop(worker, None)

    def trim(self, max_units: int) -> int:
        """Cut every worker down to ``max_units`` by dropping its least recent leaves."""
        dropped = 0
        for worker, units in list(self._units.items()):
            if units > max_units:
                dropped += self._trim_worker(worker, units - max_units)
        return dropped

    def _trim_worker(self, worker: str, excess: int) -> int:
        heap = [
            (node.tenants[worker], i, node)
            for i, node in enumerate(self._iter_nodes())
            if worker in node.tenants
            and not any(worker in c.tenants for c in node.children.values())
        ]
        heapq.heapify(heap)
        dropped, seq = 0, len(heap)
        while dropped < excess and heap:
            _, _, node = heapq.heappop(heap)
            del node.tenants[worker]
            dropped += len(node.key)
            parent = node.parent
            if not node.tenants:
                self._detach(node)
            if (
                parent is not None
                and parent is not self.root
                and worker in parent.tenants
                and not any(worker in c.tenants for c in parent.children.values())
            ):
                seq += 1
                heapq.heappush(heap, (parent.tenants[worker], seq, parent))
        self._units[worker] -= dropped
        return dropped

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        if parent is not None and parent.children.get(node.key[0]) is node:
            del parent.children[node.key[0]]

    def _iter_nodes(self) -> Iterator[_Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Recount per-worker units; a child's tenants are a subset of its parent's (tests)."""
        counted: dict[str, int] = {}
        for node in self._iter_nodes():
            for worker in node.tenants:
                counted[worker] = counted.get(worker, 0) + len(node.key)
            parent = node.parent
            in_tree = parent is not None and parent is not self.root
            if in_tree and not set(node.tenants) <= set(parent.tenants):  # type: ignore[union-attr]
                raise AssertionError("a child holds a worker its parent does not")
        for worker, units in self._units.items():
            if counted.get(worker, 0) != units:
                raise AssertionError(f"{worker}: counted {counted.get(worker, 0)} != {units}")
