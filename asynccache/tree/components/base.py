"""The component interface: what an attention type adds to the radix tree.

FULL attention is the tree's primary component and is built into :mod:`asynccache.tree.tree`
(its value is ``Node.value``; its eviction queue is the policy-ordered device-leaf queue).
Auxiliary components (sliding-window attention, Mamba state) plug in through
:class:`Component`: each keeps one :class:`CompData` per node in ``Node.aux[index]`` and
provides the hooks the hybrid walks call — a match validator (``accepts``), split redistribution,
lock acquire / release, the LRU refresh after a match or insert, and tombstoning (dropping its
value while the node stays). Insert overlap and commit are component-specific and live in the
hybrid insert (:mod:`asynccache.tree.hybrid`), which asks the component for its rules.

Eviction priority on internal nodes: FULL 2 > SWA 1 > Mamba 0. When a component's value is
dropped from a node, every component of lower priority on that node goes too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from asynccache.tree.components.lru import LruQueue

if TYPE_CHECKING:
    from asynccache.tree.node import Node


class CompData:
    """One auxiliary component's state on one node.

    ``value``: read-only int64 slot array (None is a *tombstone*: evicted, structure kept).
    ``lock_ref``: pins. ``stamp``: the component's own LRU clock value. ``qe``: live LRU queue
    entry. ``acct``: how the value is counted: 0 not at all, 1 evictable, 2 protected.
    ``host_value``: the host copy of the value (trees with a host tier; None: not backed up).
    """

    __slots__ = ("acct", "host_value", "lock_ref", "qe", "stamp", "value")

    def __init__(self, value: np.ndarray | None = None, stamp: int = 0) -> None:
        self.value = value
        self.lock_ref = 0
        self.stamp = stamp
        self.qe: tuple[int, int, Node] | None = None
        self.acct = 0
        self.host_value: np.ndarray | None = None

    def __repr__(self) -> str:
        v = "tomb" if self.value is None else f"{len(self.value)} slots"
        return f"CompData({v}, lock={self.lock_ref})"


class Component:
    """Base of the auxiliary components; see the module docstring for the hooks."""

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0

    def __init__(self, index: int, page_size: int) -> None:
        self.index = index
        self.page_size = page_size
        self.queue = LruQueue(index)
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

    def split(self, x: Node, p: Node, m: int) -> CompData:
        """``x`` loses its first ``m`` tokens to the new prefix ``p``; return ``p``'s data."""
        raise NotImplementedError

    def lock(self, node: Node) -> tuple[int, list[Node]]:
        """Pin this component for a request anchored at ``node``; returns the lock's extent
        (what :meth:`unlock` needs to release exactly the same pins) and the nodes pinned."""
        raise NotImplementedError

    def unlock(self, node: Node, extent: int) -> list[Node]:
        """Release a lock taken by :meth:`lock`; returns the nodes whose pins changed."""
        raise NotImplementedError

    # -------------------------------------------------------------- shared mechanics
    def data(self, node: Node) -> CompData:
        aux = node.aux
        assert aux is not None
        return aux[self.index]

    def refresh(self, node: Node, blocked: bool) -> None:
        """Recount ``node``'s value and put it in the LRU queue iff it can be evicted now.

        ``blocked``: a lower-priority component on the node is locked, so dropping this value
        (which cascades down) is not allowed.
        """
        aux = node.aux
        assert aux is not None
        d = aux[self.index]
        if d.value is None:
            want = 0
        elif d.lock_ref:
            want = 2
        else:
            want = 1
        if want != d.acct:
            k = self.units(node)
            if d.acct == 1:
                self.evictable -= k
            elif d.acct == 2:
                self.protected -= k
            if want == 1:
                self.evictable += k
            elif want == 2:
                self.protected += k
            d.acct = want
        if want == 1 and not blocked and node.pending == 0:
            if d.qe is None:
                self.queue.push(node)
        elif d.qe is not None:
            self.queue.discard(node)

    def drop_value(self, node: Node) -> np.ndarray:
        """Tombstone this component on ``node``; returns the freed slots (the caller refreshes)."""
        d = self.data(node)
        value = d.value
        assert value is not None and d.lock_ref == 0
        d.value = None
        return value

    def reset(self) -> None:
        self.queue.clear()
        self.evictable = 0
        self.protected = 0
