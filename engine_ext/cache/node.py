"""The radix-tree node shared by the cache and its eviction policies."""

from __future__ import annotations

from typing import Any

__all__ = ["RadixNode"]


class RadixNode:
    """One run of tokens in the radix tree.

    ``key`` holds the node's own tokens (a slice of the full prefix); ``children`` is keyed by
    the first page of each child's key. ``lock_ref`` counts running requests that use the
    node (a locked node is never evicted). ``last_access`` (a logical tick, for LRU) and
    ``mark_phase`` (the RLT phase in which the node was last marked) are policy state kept on
    the node, as SGLang keeps ``last_access_time`` on its ``TreeNode``. ``slot`` is the
    node's place in the cache's leaf registry (-1: not a leaf); a leaf's ``key`` may still
    hold tokens that an eviction cut (``RadixCache.settle`` applies the cut).
    """

    __slots__ = (
        "children",
        "key",
        "last_access",
        "lock_ref",
        "mark_phase",
        "node_id",
        "parent",
        "slot",
    )

    def __init__(self, key: Any, parent: RadixNode | None, node_id: int) -> None:
        self.key = key
        self.children: dict[Any, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.mark_phase = -1
        self.node_id = node_id
        self.slot = -1

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"RadixNode(id={self.node_id}, tokens={len(self.key)}, lock_ref={self.lock_ref})"
