"""The walk of a host insert (pages fetched from storage recorded on the host tier), shared by
the FULL-only insert (:meth:`HostTier.insert_host <asynccache.tree.host_tier.HostTier.insert_host>`)
and the hybrid one (:mod:`asynccache.tree.hybrid_prefetch`, which adds the SWA pages and the
Mamba state as it goes).

The tree never touches a pool: host slots it does not take come back in the result's
``device_frees``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from asynccache.tree.components.layout import HOST
from asynccache.tree.events import Medium
from asynccache.tree.keys import RadixKey
from asynccache.tree.node import Node, backed, frozen
from asynccache.tree.results import InsertResult

if TYPE_CHECKING:
    from asynccache.tree.host_tier import HostTier

#: ``step(node, lo, hi, adopted)``: the span's tokens ``[lo, hi)`` reached ``node``, which took
#: their slots as its host copy (``adopted``) or gave them back.
Step = Callable[[Node, int, int, bool], None]


def walk(tree: HostTier, key: RadixKey, start: int, slots: np.ndarray, res: InsertResult,
         step: Step | None = None) -> tuple[Node, int, bool]:
    """Walk ``key`` from the root over what the tree holds, up to the span's end.

    The anchor and every node below it are touched (top first). A node the span covers from
    its first token takes the span's slots as its host copy (a refill) under the
    write-through policies when it has none, none is being made, and every node from the
    anchor down is backed up; otherwise the slots come back. Sets ``res.prefix_len``.

    Returns the node reached, the token where the uncached rest of the span begins, and
    whether that rest is dropped (write-through policies, below a node without a host copy:
    its slots come back and ``res.cached_len`` ends there).
    """
    data = key.data
    pb, sh = tree._pb, tree._sh
    end = (start + len(slots)) << sh
    ns = key.namespace
    node = tree._root
    off = 0
    refill = not tree._write_back
    closed = True  # write-through: may host copies go below ``node``?
    while off < end:
        child = node.children.get(tree._child_key(node, data[off : off + pb], ns))
        if child is None:
            break
        pos = off >> sh
        if pos + (len(child.key) >> sh) >= start:  # the anchor or below: touched
            tree._touch(child)  # (before a split: the suffix ends up the newer)
        child, nb = tree._match_child(child, data, off, end)
        hi = pos + (nb >> sh)
        if hi > start:
            lo = max(pos, start)
            span = slots[lo - start : hi - start]
            adopted = (refill and closed and child.host_value is None and child.pending == 0
                       and lo == pos)
            if adopted:
                child.host_value = frozen(span)
                tree._host_size += hi - pos
                tree._emit_stored(child, Medium.CPU_PINNED)
                tree._refresh(child)
            else:
                res.device_frees.append(span)
                closed = closed and backed(child)
            if step is not None:
                step(child, lo, hi, adopted)
        else:
            closed = backed(child)  # (at the anchor: whether it is backed up)
        node = child
        off += nb
    a = off >> sh
    res.prefix_len = a
    dropped = off < end and refill and not closed
    if dropped:
        res.device_frees.append(slots[a - start :])
        res.cached_len = a
    return node, a, dropped


def new_leaf(tree: HostTier, parent: Node, key: RadixKey, a: int, b: int, start: int,
             slots: np.ndarray, swa: np.ndarray | None = None) -> Node:
    """A host-only node for ``key[a:b]`` below ``parent`` (the span's slots from ``start``;
    ``swa``: its SWA host slots, hybrid), with no hits (one under write-back) and its parent's
    priority."""
    data = key.data
    sh = tree._sh
    leaf = tree._node_cls(next(tree._ids), parent, data[a << sh : b << sh], key.namespace,
                          tree._aux_empty[:])
    tree._nodes[leaf.id] = leaf
    leaf.host_value = frozen(slots[a - start : b - start])
    leaf.creation = leaf.last_access = tree._tick()
    leaf.hit_count = tree._host_insert_hit_count()
    leaf.priority = parent.priority
    if swa is not None and tree._swa is not None:
        leaf.aux[tree._swa.at + HOST] = frozen(swa[a - start : b - start])
    parent.children[tree._child_key(parent, data[a << sh : (a << sh) + tree._pb],
                                    key.namespace)] = leaf
    tree._host_size += b - a
    if tree._eager_hashes:
        tree._digests(leaf)
    tree._emit_stored(leaf, Medium.CPU_PINNED)
    tree._refresh(parent)
    tree._refresh(leaf)
    return leaf
