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
    # LRU with a reuse credit: a node reused since its insert (hit_count >= 2) ranks as if last
    # accessed half its lifetime so far (last access - creation) later (docs/eviction.md).
    "lru_credit": lambda n: (
        n.last_access + ((n.last_access - n.creation) >> 1 if n.hit_count >= 2 else 0),
        n.last_access,
    ),
    # ARC-style adaptive split of the device leaves (asynccache/tree/arc.py): each class in LRU
    # order; host leaves and host duplicates in plain LRU order.
    "arc": lambda n: (n.last_access,),
}

# Policies whose order changes when a node is touched, hit or re-prioritised.
USES_ACCESS: Final = frozenset({"lru", "mru", "lfu", "priority", "lru_credit", "arc"})
USES_HITS: Final = frozenset({"lfu", "lru_credit"})
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
            # orphans stay bounded without a push too (amortised O(1) a discard)
            if len(self._heap) > 2 * self._live + 64:
                self._compact()

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


class StampQueue:
    """The eviction queue of ``lru`` / ``mru`` trees (without sessions): nodes by their access
    stamp, with no orphans, so a call never pops through stale entries.

    A touch gives a node a new stamp from the tree's clock, and its order is just that stamp.
    So the queue is a two-level bitmap over stamps: a chunk of 256 bytes per run of 256 stamps
    holding a queued node (1: a node has that stamp), an index byte per chunk (1: the chunk
    holds one), and a dict from stamp to node id. Filing, re-filing and removing are O(1)
    (clear the old byte, set the new one); the next victim is the first set index byte from the
    low-water mark, then the first set byte of its chunk (``bytearray.find``, memchr speed:
    skipping 100,000 freed stamps costs microseconds). With a heap and lazy deletion, a match
    pass that re-filed 20,000 leaves left 20,000 orphans at the top of the heap, and the next
    evict call popped through all of them (55 ms).

    Memory: 256 bytes per chunk holding a queued node, plus one index byte per 256 ticks
    between the oldest queued stamp and the newest (the index is trimmed as the low-water mark
    advances; a node filed under an older stamp extends it down).

    A node's entry (``node.aux[slot]``) is its stamp, an int. Stamps are unique in practice
    (every tick goes to one node; a split moves the suffix's old stamp to the prefix and gives
    the suffix a new one); equal stamps are still kept, in filing order.
    """

    __slots__ = ("_chunks", "_counts", "_dups", "_hi", "_ids", "_index", "_kbase", "_live",
                 "_lo", "_newest", "_nodes", "_slot")

    _SHIFT: Final = 8
    _MASK: Final = 255

    def __init__(self, slot: int, nodes: dict[int, Node], *, newest_first: bool = False) -> None:
        self._slot = slot
        self._nodes = nodes
        self._newest = newest_first
        self._chunks: dict[int, bytearray] = {}  # chunk number -> a byte per stamp
        self._counts: dict[int, int] = {}  # chunk number -> stamps set in it
        self._index = bytearray()  # a byte per chunk number from _kbase: 1 if it has a stamp
        self._kbase = 0
        self._lo = 0  # no index byte below it is set
        self._hi = 0  # no index byte at or above it is set
        self._ids: dict[int, int] = {}  # stamp -> node id
        self._dups: dict[int, list[int]] = {}  # stamp -> more node ids (equal stamps, rare)
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, node: Node) -> None:
        """Add ``node`` or re-file it under its current stamp."""
        stamp = node.last_access
        slot = self._slot
        old = node.aux[slot]
        if old is not None:
            if old == stamp:
                return
            if self._dups:
                self._remove(old, node.id)
            else:  # no equal stamps anywhere (the usual case): _remove's last branch
                assert self._ids.get(old) == node.id, "queue entry does not match its node"
                self._clear(old)
        else:
            self._live += 1
        node.aux[slot] = stamp
        if stamp in self._ids:
            self._dups.setdefault(stamp, []).append(node.id)
            return
        self._ids[stamp] = node.id
        k = stamp >> self._SHIFT
        chunk = self._chunks.get(k)
        if chunk is None:
            chunk = self._chunks[k] = bytearray(self._MASK + 1)
            self._counts[k] = 1
            p = k - self._kbase
            if p < 0:
                self._grow_down(-p)
                p = 0
            index = self._index
            if p >= len(index):
                index.extend(bytes(max(p + 1 - len(index), len(index), 64)))
            index[p] = 1
            if p < self._lo:
                self._lo = p
            if p >= self._hi:
                self._hi = p + 1
        else:
            self._counts[k] += 1
        chunk[stamp & self._MASK] = 1

    def discard(self, node: Node) -> None:
        stamp = node.aux[self._slot]
        if stamp is not None:
            self._remove(stamp, node.id)
            node.aux[self._slot] = None
            self._live -= 1

    def pop(self) -> Node | None:
        """Remove and return the node first in eviction order, or None when empty."""
        if not self._live:
            return None
        index = self._index
        if self._newest:
            p = index.rfind(1, self._lo, self._hi)
            self._hi = p + 1
            k = p + self._kbase
            j = self._chunks[k].rfind(1)
        else:
            p = index.find(1, self._lo, self._hi)
            self._lo = p
            k = p + self._kbase
            j = self._chunks[k].find(1)
        assert p >= 0 and j >= 0, "a live entry has no stamp byte"
        stamp = (k << self._SHIFT) | j
        node_id = self._ids[stamp]
        more = self._dups.get(stamp)
        if more:  # the next node filed under the same stamp takes its place
            self._ids[stamp] = more.pop(0)
            if not more:
                del self._dups[stamp]
        else:
            self._clear(stamp)
        node = self._nodes[node_id]
        node.aux[self._slot] = None
        self._live -= 1
        if self._lo > 4096 and self._lo > len(index) // 2:
            self._trim()
        return node

    def clear(self) -> None:
        nodes = self._nodes
        for node_id in [*self._ids.values(), *(i for ids in self._dups.values() for i in ids)]:
            n = nodes.get(node_id)
            if n is not None:
                n.aux[self._slot] = None
        self._chunks.clear()
        self._counts.clear()
        self._index = bytearray()
        self._ids.clear()
        self._dups.clear()
        self._kbase = self._lo = self._hi = self._live = 0

    def _remove(self, stamp: int, node_id: int) -> None:
        more = self._dups.get(stamp)
        if more is not None and node_id in more:
            more.remove(node_id)
        elif more:
            self._ids[stamp] = more.pop(0)
        else:
            assert self._ids.get(stamp) == node_id, "queue entry does not match its node"
            self._clear(stamp)
        if more is not None and not more:
            del self._dups[stamp]

    def _clear(self, stamp: int) -> None:
        """No node has ``stamp`` any more."""
        del self._ids[stamp]
        k = stamp >> self._SHIFT
        left = self._counts[k] - 1
        if left:
            self._counts[k] = left
            self._chunks[k][stamp & self._MASK] = 0
        else:
            del self._counts[k], self._chunks[k]
            self._index[k - self._kbase] = 0

    def _grow_down(self, n: int) -> None:
        """Make room for ``n`` chunk numbers below the index's base (an old stamp filed)."""
        n = max(n, len(self._index) // 4, 64)
        self._index[0:0] = bytes(n)
        self._kbase -= n
        self._lo += n
        self._hi += n

    def _trim(self) -> None:
        """Drop the index bytes below the low-water mark (all clear)."""
        lo = self._lo
        del self._index[:lo]
        self._kbase += lo
        self._lo = 0
        self._hi -= lo
