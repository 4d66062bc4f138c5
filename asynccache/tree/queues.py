"""Eviction order: policy keys and an O(log n) queue of evictable nodes.

Each queue is a binary heap with lazy deletion. A node remembers its live entry in
``node.aux[slot]``; re-keying pushes a new entry and orphans the old one, and a pop skips
entries that are no longer the node's live entry. The heap is compacted when orphans
outnumber live entries, so memory stays O(live) and every operation is O(log n) amortised —
no call ever re-heaps all leaves.

Entries name the node by id (looked up in the tree's node map), so they hold only ints: the
cyclic garbage collector stops tracking them at its first pass, instead of traversing one more
object per queued node in every full collection.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, Final

from asynccache.errors import ConfigError
from asynccache.tree.node import Node

PolicyKey = Callable[[Node], tuple[int, ...]]

POLICIES: Final[dict[str, PolicyKey]] = {
    "lru": lambda n: (n.last_access,),
    "mru": lambda n: (-n.last_access,),
    "fifo": lambda n: (n.creation,),
    "filo": lambda n: (-n.creation,),
    "lfu": lambda n: (n.hit_count, n.last_access),
    "priority": lambda n: (n.priority, n.last_access),
}

# Policies whose order changes when a node is touched, hit or re-prioritised.
USES_ACCESS: Final = frozenset({"lru", "mru", "lfu", "priority"})
USES_HITS: Final = frozenset({"lfu"})
USES_PRIORITY: Final = frozenset({"priority"})


def policy_key(name: str) -> PolicyKey:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None


def sessions_last(key: PolicyKey) -> PolicyKey:
    """``key`` with session-referenced nodes ordered after all others (fewest refs first)."""
    return lambda n: (n.sref, *key(n))


class NodeQueue:
    """A min-queue of nodes ordered by a policy key, with O(log n) push/discard/pop."""

    __slots__ = ("_heap", "_key", "_live", "_nodes", "_seq", "_slot")

    def __init__(self, slot: int, key: PolicyKey, nodes: dict[int, Node]) -> None:
        self._slot = slot
        self._nodes = nodes  # the tree's node map (entries name nodes by id)
        self._key = key
        self._heap: list[tuple[Any, ...]] = []
        self._live = 0
        self._seq = 0

    def __len__(self) -> int:
        return self._live

    def push(self, node: Node) -> None:
        """Add ``node`` or re-key it if it is already queued."""
        if node.aux[self._slot] is None:
            self._live += 1
        self._seq += 1
        entry = (*self._key(node), self._seq, node.id)
        node.aux[self._slot] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * self._live + 64:
            self._compact()

    def discard(self, node: Node) -> None:
        if node.aux[self._slot] is not None:
            node.aux[self._slot] = None
            self._live -= 1

    def pop(self) -> Node | None:
        """Remove and return the node first in eviction order, or None when empty."""
        heap = self._heap
        slot = self._slot
        nodes = self._nodes
        while heap:
            entry = heapq.heappop(heap)
            node = nodes.get(entry[-1])
            if node is not None and node.aux[slot] is entry:
                node.aux[slot] = None
                self._live -= 1
                return node
        return None

    def clear(self) -> None:
        nodes = self._nodes
        for entry in self._live_entries():
            nodes[entry[-1]].aux[self._slot] = None
        self._heap = []
        self._live = 0

    def _live_entries(self) -> list[tuple[Any, ...]]:
        slot = self._slot
        nodes = self._nodes
        return [e for e in self._heap if (n := nodes.get(e[-1])) is not None and n.aux[slot] is e]

    def _compact(self) -> None:
        self._heap = self._live_entries()
        heapq.heapify(self._heap)
