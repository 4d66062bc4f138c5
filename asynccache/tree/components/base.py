"""The component interface: what an attention type adds to the radix tree.

FULL attention is the tree's primary component and is built into :mod:`asynccache.tree.tree`
(its value is ``Node.value``; its eviction queue is the policy-ordered device-leaf queue).
Auxiliary components (sliding-window attention, Mamba state) plug in through
:class:`Component`: each keeps its per-node entries in ``Node.aux[at : at + WIDTH]`` (see
:mod:`~asynccache.tree.components.layout`) and provides the hooks the hybrid walks call — a
match validator (``accepts``), split redistribution, lock acquire / release, the LRU refresh
after a match or insert, and tombstoning (dropping its value while the node stays). Insert
overlap and commit are component-specific and live in the hybrid insert
(:mod:`asynccache.tree.hybrid`), which asks the component for its rules.

Eviction priority on internal nodes: FULL 2 > SWA 1 > Mamba 0. When a component's value is
dropped from a node, every component of lower priority on that node goes too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from asynccache.tree.components.layout import ACCT, HOST, LOCK, QE, QUEUES, WIDTH
from asynccache.tree.components.lru import LruQueue

if TYPE_CHECKING:
    from asynccache.tree.node import Node


class Component:
    """Base of the auxiliary components; see the module docstring for the hooks."""

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0

    def __init__(self, index: int, page_size: int, nodes: dict[int, Node]) -> None:
        self.index = index  # its position among the tree's components
        self.at = QUEUES + index * WIDTH  # where its entries start in Node.aux
        self.page_size = page_size
        self.queue = LruQueue(self.at, nodes)
        self.evictable = 0  # units (tokens or states) eviction may free
        self.protected = 0  # units pinned by locks

    # -------------------------------------------------------------- per-node hooks
    def units(self, node: Node) -> int:
        """How many units a value on ``node`` counts: tokens, or states."""
        raise NotImplementedError

    def accepts(self, node: Node, live: int) -> bool:
        """The match validator: may a match end at ``node``? ``live`` is the count of SWA-live
        tokens since the last SWA tombstone up to ``node``'s end (the hybrid match walk keeps
        it and evaluates the same rules inline)."""
        raise NotImplementedError

    def split(self, x: Node, p: Node, m: int) -> None:
        """``x`` loses its first ``m`` tokens to the new prefix ``p``: fill ``p``'s entries."""
        raise NotImplementedError

    def lock(self, node: Node) -> tuple[int, list[Node]]:
        """Pin this component for a request anchored at ``node``; returns the lock's extent
        (what :meth:`unlock` needs to release exactly the same pins) and the nodes pinned."""
        raise NotImplementedError

    def unlock(self, node: Node, extent: int) -> list[Node]:
        """Release a lock taken by :meth:`lock`; returns the nodes whose pins changed."""
        raise NotImplementedError

    # -------------------------------------------------------------- shared mechanics
    def value(self, node: Node) -> np.ndarray | None:
        """This component's device slots on ``node`` (None: a tombstone)."""
        aux = node.aux
        v: np.ndarray | None = aux[self.at]
        return v

    def host_value(self, node: Node) -> np.ndarray | None:
        """This component's host slots on ``node`` (None: no host copy)."""
        aux = node.aux
        v: np.ndarray | None = aux[self.at + HOST]
        return v

    def refresh(self, node: Node, blocked: bool) -> None:
        """Recount ``node``'s value and put it in the LRU queue iff it can be evicted now.

        ``blocked``: a lower-priority component on the node is locked, so dropping this value
        (which cascades down) is not allowed.
        """
        aux = node.aux
        at = self.at
        if aux[at] is None:
            want = 0
        elif aux[at + LOCK]:
            want = 2
        else:
            want = 1
        have = aux[at + ACCT]
        if want != have:
            k = self.units(node)
            if have == 1:
                self.evictable -= k
            elif have == 2:
                self.protected -= k
            if want == 1:
                self.evictable += k
            elif want == 2:
                self.protected += k
            aux[at + ACCT] = want
        if want == 1 and not blocked and node.pending == 0:
            if aux[at + QE] is None:
                self.queue.push(node)
        elif aux[at + QE] is not None:
            self.queue.discard(node)

    def drop_value(self, node: Node) -> np.ndarray:
        """Tombstone this component on ``node``; returns the freed slots (the caller refreshes)."""
        aux = node.aux
        at = self.at
        value: np.ndarray | None = aux[at]
        assert value is not None and aux[at + LOCK] == 0
        aux[at] = None
        return value

    def reset(self) -> None:
        self.queue.clear()
        self.evictable = 0
        self.protected = 0
