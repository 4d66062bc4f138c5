"""Tree nodes: one compressed run of whole pages with its residency and locks."""

from __future__ import annotations

from typing import Any

import numpy as np

from asynccache.tree.keys import Namespace

# A node's entries in the tree's eviction queues (Node.aux[0:3]): evictable device leaf,
# evictable host leaf, reclaimable host duplicate (on device and on host).
DLEAF = 0
HLEAF = 1
HDUP = 2


class Node:
    """A node of the radix tree.

    ``key`` holds whole pages of tokens as uint32 bytes. ``value`` holds the device slot of
    each token (None when the node was demoted to host only); ``host_value`` the host slots
    (None when not backed up). Slot arrays are read-only numpy int64 arrays owned by the tree.
    ``aux`` is the node's one bookkeeping list (the tree makes it): its live entry in each
    eviction queue (indices ``DLEAF``, ``HLEAF``, ``HDUP``; None when not queued), then, in
    hybrid trees, the auxiliary components' entries (SWA, Mamba) laid out as
    :mod:`asynccache.tree.components.layout` says. One list, so that a hybrid node costs the
    cyclic garbage collector no more objects than a FULL-only one.
    """

    __slots__ = (
        "acct",
        "anchors",
        "aux",
        "children",
        "creation",
        "dchildren",
        "digests",
        "hit_count",
        "host_lock_ref",
        "host_value",
        "id",
        "key",
        "last_access",
        "lock_ref",
        "ns",
        "parent",
        "pending",
        "priority",
        "sref",
        "value",
    )

    def __init__(
        self, node_id: int, parent: Node | None, key: bytes, ns: Namespace, aux: list[Any]
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.key = key
        self.ns = ns
        self.children: dict[Any, Node] = {}
        self.value: np.ndarray | None = None
        self.host_value: np.ndarray | None = None
        self.lock_ref = 0
        self.host_lock_ref = 0
        self.last_access = 0
        self.creation = 0
        self.hit_count = 0
        self.priority = 0
        self.digests: list[bytes] | None = None
        self.pending = 0  # id of the in-flight backup or load-back covering this node
        self.dchildren = 0  # number of children holding a device value
        # How its device tokens are counted: 0 none, 1 evictable, 2 protected (device-locked),
        # 3 protected by host pins only.
        self.acct = 0
        # Session references: ``anchors`` are the tokens of the refs registered at this node,
        # ``sref`` counts the refs at this node and below (it orders eviction: referenced
        # nodes go last).
        self.anchors: list[int] | None = None
        self.sref = 0
        self.aux = aux

    # log2 of the bytes of one key unit: a token here, a bigram in a BigramNode
    UNIT_SHIFT = 2

    @property
    def ntok(self) -> int:
        """Positions (tokens; bigrams in an EAGLE tree) this node holds."""
        return len(self.key) >> self.UNIT_SHIFT

    def __repr__(self) -> str:
        where = ("D" if self.value is not None else "") + ("H" if self.host_value is not None else "")
        return (
            f"Node(id={self.id}, tokens={self.ntok}, {where or '-'}, lock={self.lock_ref}, "
            f"host_lock={self.host_lock_ref}, pending={self.pending})"
        )


class BigramNode(Node):
    """A node of an EAGLE tree: ``key`` holds whole pages of bigrams, 8 bytes each (see
    :class:`~asynccache.tree.keys.BigramKey`)."""

    __slots__ = ()
    UNIT_SHIFT = 3


def backed(n: Node) -> bool:
    """``n`` has a host copy, or one is being made (a backup in flight; the reference records
    the host copy when it issues the copy)."""
    return n.host_value is not None or n.pending != 0


def settled_dup(n: Node) -> bool:
    """``n`` is a host duplicate with no copy in flight: on device and on host, settled."""
    return n.value is not None and n.host_value is not None and not n.pending


def spared_dup(n: Node) -> bool:
    """``n`` is a settled duplicate that is an evictable device leaf (not locked on device or
    host, no device children): what write-back host eviction's first pass spares."""
    return settled_dup(n) and not n.host_lock_ref and not n.lock_ref and not n.dchildren


def frozen(slots: np.ndarray) -> np.ndarray:
    """A read-only copy of the 1-D slot array ``slots`` (the tree never aliases a caller's
    array): an array over a bytes copy, read-only from birth (a seventh cheaper than copying
    and then clearing the writeable flag)."""
    return np.frombuffer(slots.tobytes(), slots.dtype)


def joined(parts: list[Any]) -> np.ndarray:
    """The slot arrays ``parts`` (the tree's own: contiguous int64) end to end, as one read-only
    array over a bytes copy (bytes.join reads each array's buffer: for the few parts of a match
    path, two fifths cheaper than np.concatenate)."""
    return np.frombuffer(b"".join(parts), np.int64)


# One read-only table of state slot numbers: a node's Mamba state is a one-element view of it
# (a view costs a fifth of a fresh one-element array, on every insert of a Mamba tree).
_STATES_MAX = 1 << 20
_states = np.arange(1024, dtype=np.int64)
_states.flags.writeable = False


def state_slot(state: int) -> np.ndarray:
    """``state`` as a read-only one-element int64 array."""
    global _states
    table = _states
    if state >= len(table):
        if state >= _STATES_MAX:
            one = np.array([state], dtype=np.int64)
            one.flags.writeable = False
            return one
        table = np.arange(max(2 * len(table), state + 1), dtype=np.int64)
        table.flags.writeable = False
        _states = table
    return table[state : state + 1]
