"""Mamba (state-space) layers as a tree component.

A node holds at most one state slot: the recurrent state after its last token, checkpointed
only where a request stored one (usually a leaf). A match may end only at a node holding a
state. Locks pin the anchor's state alone; a split leaves the state on the suffix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from asynccache.tree.components.base import Component
from asynccache.tree.components.layout import LOCK, STAMP

if TYPE_CHECKING:
    from asynccache.tree.node import Node


class MambaComponent(Component):
    name: ClassVar[str] = "mamba"
    priority: ClassVar[int] = 0

    def __init__(
        self, index: int, page_size: int, nodes: dict[int, Node], track_interval: int
    ) -> None:
        super().__init__(index, page_size, nodes)
        self.track_interval = track_interval  # the checkpoint grid of branching seqlens

    def units(self, node: Node) -> int:
        return 1

    def accepts(self, node: Node, live: int) -> bool:
        return self.value(node) is not None

    def split(self, x: Node, p: Node, m: int) -> None:
        # The state describes the end of x, which the suffix keeps (with its pins).
        ax = x.aux
        ap = p.aux
        assert ax is not None and ap is not None
        ap[self.at + STAMP] = ax[self.at + STAMP]

    def lock(self, node: Node) -> tuple[int, list[Node]]:
        aux = node.aux
        if node.parent is None or aux[self.at] is None:
            return 0, []
        aux[self.at + LOCK] += 1
        return 1, [node]

    def unlock(self, node: Node, extent: int) -> list[Node]:
        if not extent:
            return []
        aux = node.aux
        assert aux[self.at + LOCK] > 0, f"node {node.id} is not Mamba-locked"
        aux[self.at + LOCK] -= 1
        return [node]
