"""Sliding-window attention (SWA) as a tree component.

Per node: SWA-live or a tombstone. A live node's value entry is the node's FULL slot array
itself: its SWA KV lives at the pool's full->SWA translation of those slots, which the cache
keeps (the tree never sees SWA slot numbers, and stores no second copy). A match may end at a
node only if the path has no SWA tombstone or the last ``window`` tokens before the node's end
are SWA-live. Locks pin one window above the anchor; a long new leaf is cap-split so that it
holds exactly one page-aligned window.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from asynccache.tree.components.base import Component
from asynccache.tree.components.layout import ACCT, LOCK, STAMP

if TYPE_CHECKING:
    from asynccache.tree.node import Node

class SWAComponent(Component):
    name: ClassVar[str] = "swa"
    priority: ClassVar[int] = 1

    def __init__(self, index: int, page_size: int, nodes: dict[int, Node], window: int) -> None:
        super().__init__(index, page_size, nodes)
        self.window = window
        # The window rounded up to whole pages: what a capped leaf holds.
        self.window_span = math.ceil(window / page_size) * page_size

    def units(self, node: Node) -> int:
        return node.ntok

    def accepts(self, node: Node, live: int) -> bool:
        return self.value(node) is not None and live >= self.window

    def split(self, x: Node, p: Node, m: int) -> None:
        ax = x.aux
        ap = p.aux
        at = self.at
        if ax[at] is not None:  # FULL split first: the halves alias the new FULL arrays
            ap[at] = p.value
            ax[at] = x.value
        ap[at + LOCK] = ax[at + LOCK]
        ap[at + STAMP] = ax[at + STAMP]
        ap[at + ACCT] = ax[at + ACCT]  # the prefix's tokens keep the class they were counted in

    def lock(self, node: Node) -> tuple[int, list[Node]]:
        """Pin SWA on the nodes covering ``window`` tokens above ``node`` (tombstones included);
        the extent is the number of tokens covered. It survives splits: both halves of a split
        node carry the pin, so the covered span stays the same."""
        span = 0
        pinned = []
        n = node
        lock = self.at + LOCK
        while n.parent is not None and span < self.window:
            aux = n.aux
            aux[lock] += 1
            pinned.append(n)
            span += n.ntok
            n = n.parent
        return span, pinned

    def unlock(self, node: Node, extent: int) -> list[Node]:
        changed = []
        n = node
        left = extent
        lock = self.at + LOCK
        while left > 0:
            aux = n.aux
            assert n.parent is not None, "SWA lock span runs past the root"
            assert aux[lock] > 0, f"node {n.id} is not SWA-locked"
            aux[lock] -= 1
            changed.append(n)
            left -= n.ntok
            n = n.parent
        assert left == 0, "SWA lock span does not end at a node boundary"
        return changed
