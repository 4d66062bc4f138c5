"""An O(log n) least-recently-used queue of one component's per-node data.

The same lazy-deletion idea as :mod:`asynccache.tree.queues`: the node remembers its live heap
entry (in its component's ``QE`` entry of ``Node.aux``); a pop skips orphans; a discard (the
only way to make one) compacts the heap when orphans outnumber live entries. No call re-heaps
all nodes.

Recency refreshes are lazier still: stamps only grow, so touching a node just raises its stamp
(O(1), no heap work). A pop that meets an entry whose key is older than the node's stamp re-files
it under the current stamp and goes on; each touch costs at most one such re-push, at eviction
time.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from asynccache.tree.components.layout import QE, STAMP

if TYPE_CHECKING:
    from asynccache.tree.node import Node


_ID_BITS = 64  # an entry is ``stamp << 64 | node id`` (ids never reach 2**64)
_ID_MASK = (1 << _ID_BITS) - 1


class LruQueue:
    """Min-queue of nodes ordered by their component's access stamp (ties: oldest node first).

    An entry is one int, ``stamp << 64 | node id``, looked up in the tree's node map on a pop:
    ints are not tracked by the cyclic garbage collector, so a queued node adds nothing to its
    collections (a tuple holding the node would be one more object for every full collection
    to traverse, and would bring the next one closer)."""

    __slots__ = ("_heap", "_live", "_nodes", "_qe", "_stamp")

    def __init__(self, at: int, nodes: dict[int, Node]) -> None:
        self._qe = at + QE  # where the component's entries of node.aux hold its queue entry
        self._stamp = at + STAMP
        self._nodes = nodes  # the tree's node map
        self._heap: list[int] = []
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, node: Node) -> None:
        """Queue ``node`` (not queued) under its current stamp."""
        aux = node.aux
        qe = self._qe
        assert aux[qe] is None
        self._live += 1
        aux[qe] = entry = aux[self._stamp] << _ID_BITS | node.id
        heappush(self._heap, entry)

    def discard(self, node: Node) -> None:
        """Take ``node`` out (its entry becomes an orphan; only this makes orphans, so only
        this compacts)."""
        aux = node.aux
        if aux[self._qe] is not None:
            aux[self._qe] = None
            self._live -= 1
            if len(self._heap) > 2 * self._live + 64:
                self._compact()

    def pop(self) -> Node | None:
        """Remove and return the least recently used node, or None when empty."""
        heap = self._heap
        qe = self._qe
        nodes = self._nodes
        while heap:
            entry = heappop(heap)
            node = nodes.get(entry & _ID_MASK)
            if node is None:
                continue  # orphaned (deleted)
            aux = node.aux
            if aux[qe] != entry:
                continue  # orphaned
            stamp = aux[self._stamp]
            if entry >> _ID_BITS != stamp:  # touched since it was filed: re-file, look again
                fresh = stamp << _ID_BITS | node.id
                aux[qe] = fresh
                heappush(heap, fresh)
                continue
            aux[qe] = None
            self._live -= 1
            return node
        return None

    def clear(self) -> None:
        nodes = self._nodes
        for e in self._live_entries():
            aux = nodes[e & _ID_MASK].aux
            aux[self._qe] = None
        self._heap = []
        self._live = 0

    def _live_entries(self) -> list[int]:
        qe = self._qe
        nodes = self._nodes
        live = []
        for e in self._heap:
            node = nodes.get(e & _ID_MASK)
            if node is not None and node.aux[qe] == e:
                live.append(e)
        return live

    def _compact(self) -> None:
        live = self._live_entries()
        heapify(live)
        self._heap = live
