"""Sliding-window attention (SWA) as a tree component.

Per node: one SWA-pool slot per token (the caller translates its FULL slots through the pool's
full->SWA map), or a tombstone. A match may end at a node only if the path has no SWA tombstone
or the last ``window`` tokens before the node's end are SWA-live. Locks pin one window above the
anchor; a long new leaf is cap-split so that it holds exactly one page-aligned window.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from asynccache.tree.components.base import CompData, Component

if TYPE_CHECKING:
    from asynccache.tree.node import Node

class SWAComponent(Component):
    name: ClassVar[str] = "swa"
    priority: ClassVar[int] = 1

    def __init__(self, index: int, page_size: int, window: int) -> None:
        super().__init__(index, page_size)
        self.window = window
        # The window rounded up to whole pages: what a capped leaf holds.
        self.window_span = math.ceil(window / page_size) * page_size

    def units(self, node: Node) -> int:
        return len(node.key) >> 2

    def accepts(self, node: Node, live: int) -> bool:
        return self.data(node).value is not None and live >= self.window

    def split(self, x: Node, p: Node, m: int) -> CompData:
        aux = x.aux
        assert aux is not None
        dx = aux[self.index]
        dp = CompData(stamp=dx.stamp)
        if dx.value is not None:
            dp.value = dx.value[:m]
            dx.value = dx.value[m:]
        dp.lock_ref = dx.lock_ref
        dp.acct = dx.acct  # the prefix's tokens keep the class they were counted in
        return dp

    def lock(self, node: Node) -> tuple[int, list[Node]]:
        """Pin SWA on the nodes covering ``window`` tokens above ``node`` (tombstones included);
        the extent is the number of tokens covered. It survives splits: both halves of a split
        node carry the pin, so the covered span stays the same."""
        span = 0
        pinned = []
        n = node
        while n.parent is not None and span < self.window:
            self.data(n).lock_ref += 1
            pinned.append(n)
            span += len(n.key) >> 2
            n = n.parent
        return span, pinned

    def unlock(self, node: Node, extent: int) -> list[Node]:
        changed = []
        n = node
        left = extent
        while left > 0:
            assert n.parent is not None, "SWA lock span runs past the root"
            d = self.data(n)
            assert d.lock_ref > 0, f"node {n.id} is not SWA-locked"
            d.lock_ref -= 1
            changed.append(n)
            left -= len(n.key) >> 2
            n = n.parent
        assert left == 0, "SWA lock span does not end at a node boundary"
        return changed
