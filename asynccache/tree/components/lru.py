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

import heapq
from typing import TYPE_CHECKING, Any

from asynccache.tree.components.layout import QE, STAMP

if TYPE_CHECKING:
    from asynccache.tree.node import Node


class LruQueue:
    """Min-queue of nodes ordered by their component's access stamp."""

    __slots__ = ("_heap", "_live", "_qe", "_seq", "_stamp")

    def __init__(self, at: int) -> None:
        self._qe = at + QE  # where the component's entries of node.aux hold its queue entry
        self._stamp = at + STAMP
        self._heap: list[tuple[int, int, Node]] = []
        self._live = 0
        self._seq = 0

    def __len__(self) -> int:
        return self._live

    def push(self, node: Node) -> None:
        """Queue ``node`` (not queued) under its current stamp."""
        aux = node.aux
        assert aux is not None and aux[self._qe] is None
        self._live += 1
        self._seq += 1
        entry = (aux[self._stamp], self._seq, node)
        aux[self._qe] = entry
        heapq.heappush(self._heap, entry)

    def discard(self, node: Node) -> None:
        """Take ``node`` out (its entry becomes an orphan; only this makes orphans, so only
        this compacts)."""
        aux = node.aux
        assert aux is not None
        if aux[self._qe] is not None:
            aux[self._qe] = None
            self._live -= 1
            if len(self._heap) > 2 * self._live + 64:
                self._compact()

    def pop(self) -> Node | None:
        """Remove and return the least recently used node, or None when empty."""
        heap = self._heap
        qe = self._qe
        while heap:
            entry = heapq.heappop(heap)
            node = entry[2]
            aux = node.aux
            assert aux is not None
            if aux[qe] is not entry:
                continue  # orphaned
            stamp = aux[self._stamp]
            if entry[0] != stamp:  # touched since it was filed: re-file, look again
                self._seq += 1
                fresh = (stamp, self._seq, node)
                aux[qe] = fresh
                heapq.heappush(heap, fresh)
                continue
            aux[qe] = None
            self._live -= 1
            return node
        return None

    def clear(self) -> None:
        qe = self._qe
        for entry in self._heap:
            aux = entry[2].aux
            if aux is not None and aux[qe] is entry:
                aux[qe] = None
        self._heap = []
        self._live = 0

    def _compact(self) -> None:
        qe = self._qe
        live: list[Any] = []
        for e in self._heap:
            aux = e[2].aux
            if aux is not None and aux[qe] is e:
                live.append(e)
        heapq.heapify(live)
        self._heap = live
