"""An O(log n) least-recently-used queue of one component's per-node data.

The same lazy-deletion idea as :mod:`asynccache.tree.queues`: the data remembers its live heap
entry; a pop skips orphans; the heap is compacted when orphans outnumber live entries. No call
re-heaps all nodes.

Recency refreshes are lazier still: stamps only grow, so touching a node just raises its stamp
(O(1), no heap work). A pop that meets an entry whose key is older than the node's stamp re-files
it under the current stamp and goes on; each touch costs at most one such re-push, at eviction
time.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asynccache.tree.node import Node


class LruQueue:
    """Min-queue of nodes ordered by their component's access stamp."""

    __slots__ = ("_heap", "_index", "_live", "_seq")

    def __init__(self, index: int) -> None:
        self._index = index  # which entry of node.aux this queue orders
        self._heap: list[tuple[int, int, Node]] = []
        self._live = 0
        self._seq = 0

    def __len__(self) -> int:
        return self._live

    def push(self, node: Node) -> None:
        """Add ``node`` or re-key it (its stamp changed) if it is already queued."""
        assert node.aux is not None
        d = node.aux[self._index]
        if d.qe is None:
            self._live += 1
        self._seq += 1
        entry = (d.stamp, self._seq, node)
        d.qe = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * self._live + 64:
            self._compact()

    def discard(self, node: Node) -> None:
        assert node.aux is not None
        d = node.aux[self._index]
        if d.qe is not None:
            d.qe = None
            self._live -= 1

    def pop(self) -> Node | None:
        """Remove and return the least recently used node, or None when empty."""
        heap = self._heap
        i = self._index
        while heap:
            entry = heapq.heappop(heap)
            node = entry[2]
            aux = node.aux
            assert aux is not None
            d = aux[i]
            if d.qe is not entry:
                continue  # orphaned
            if entry[0] != d.stamp:  # touched since it was filed: re-file, look again
                self._seq += 1
                fresh = (d.stamp, self._seq, node)
                d.qe = fresh
                heapq.heappush(heap, fresh)
                continue
            d.qe = None
            self._live -= 1
            return node
        return None

    def clear(self) -> None:
        i = self._index
        for entry in self._heap:
            aux = entry[2].aux
            if aux is not None and aux[i].qe is entry:
                aux[i].qe = None
        self._heap = []
        self._live = 0

    def _compact(self) -> None:
        i = self._index
        live: list[Any] = []
        for e in self._heap:
            aux = e[2].aux
            if aux is not None and aux[i].qe is e:
                live.append(e)
        heapq.heapify(live)
        self._heap = live
