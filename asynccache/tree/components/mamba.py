"""Mamba (state-space) layers as a tree component.

A node holds at most one state slot: the recurrent state after its last token, checkpointed
only where a request stored one (usually a leaf). A match may end only at a node holding a
state. Locks pin the anchor's state alone; a split leaves the state on the suffix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from asynccache.tree.components.base import CompData, Component

if TYPE_CHECKING:
    from asynccache.tree.node import Node


class MambaComponent(Component):
    name: ClassVar[str] = "mamba"
    priority: ClassVar[int] = 0

    def __init__(self, index: int, page_size: int, track_interval: int) -> None:
        super().__init__(index, page_size)
        self.track_interval = track_interval  # the checkpoint grid of branching seqlens

    def units(self, node: Node) -> int:
        return 1

    def accepts(self, node: Node, live: int) -> bool:
        return self.data(node).value is not None

    def split(self, x: Node, p: Node, m: int) -> CompData:
        # The state describes the end of x, which the suffix keeps (with its pins).
        aux = x.aux
        assert aux is not None
        return CompData(stamp=aux[self.index].stamp)

    def lock(self, node: Node) -> tuple[int, list[Node]]:
        if node.parent is None or self.data(node).value is None:
            return 0, []
        self.data(node).lock_ref += 1
        return 1, [node]

    def unlock(self, node: Node, extent: int) -> list[Node]:
        if not extent:
            return []
        d = self.data(node)
        assert d.lock_ref > 0, f"node {node.id} is not Mamba-locked"
        d.lock_ref -= 1
        return [node]
