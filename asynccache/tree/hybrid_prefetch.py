"""Host inserts of hybrid trees: pages fetched from storage (L3 -> L2) with their SWA pages and
the Mamba state at the end of the span: the last step of a prefetch, inserting what arrived
from storage into the host tier, as the reference (SGLang's HiCache) does.

The caller brings, for ``key[start:end]``: one FULL host slot per token; optionally one SWA
host slot per token, -1 where no SWA page was fetched (the fetched ones are a page-aligned
suffix of the span: the last window); optionally the host slot of the state after ``end``.
The FULL walk is the FULL-only tree's (``HostTier.insert_host``: it touches the anchor and the
nodes it walks; under the write-through policies a device node without a host copy takes the
FULL slots as its backup, and the SWA slots if its whole span has them; under write-back it
takes none). The node ending at ``end`` takes the state if it has a FULL host copy and no state
yet. Everything else comes back (FULL in ``device_frees``, SWA / state in ``component_frees``
— all *host* slots here). The uncached rest becomes host-only nodes, cut where the fetched SWA
begins, unless (write-through policies) it would hang below a node that is neither the root
nor backed up: then it comes back too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from asynccache.tree.components.layout import HOST
from asynccache.tree.events import Medium
from asynccache.tree.hybrid import refresh_aux
from asynccache.tree.keys import RadixKey
from asynccache.tree.node import Node, backed, frozen, state_slot
from asynccache.tree.results import InsertResult

if TYPE_CHECKING:
    from asynccache.tree.host_tier import HostTier


def _new_leaf(tree: HostTier, parent: Node, key: RadixKey, a: int, b: int, start: int,
              slots: np.ndarray, swa: np.ndarray | None) -> Node:
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


def insert_host(tree: HostTier, key: RadixKey, start: int, slots: np.ndarray,
                swa: np.ndarray | None, state: int | None) -> InsertResult:
    """See the module docstring; the arguments are validated by the caller."""
    data = key.data
    pb = tree._pb
    sh = tree._sh
    end_tok = start + len(slots)
    end = end_tok << sh
    ns = key.namespace
    swa_c = tree._swa
    swa_from = end_tok
    if swa is not None:
        live = np.flatnonzero(swa >= 0)
        swa_from = start + int(live[0]) if len(live) else end_tok
    res = InsertResult(prefix_len=0, cached_len=end_tok, last_node=0)
    swa_dups: list[np.ndarray] = []
    state_dups: list[np.ndarray] = []
    if swa_c is not None:
        res.component_frees["swa"] = swa_dups
    if tree._mamba is not None:
        res.component_frees["mamba"] = state_dups
    node = tree._root
    off = 0
    refill = not tree._write_back
    closed = True  # write-through: may host copies go below ``node``? (see HostTier)
    while off < end:
        child = node.children.get(tree._child_key(node, data[off : off + pb], ns))
        if child is None:
            break
        pos = off >> sh
        if pos + (len(child.key) >> sh) >= start:  # the anchor or below: touched
            tree._touch(child)
        child, nb = tree._match_child(child, data, off, end)
        hi = pos + (nb >> sh)
        if hi > start:
            lo = max(pos, start)
            span = slots[lo - start : hi - start]
            adopt = (refill and closed and child.host_value is None and child.pending == 0
                     and lo == pos)
            if adopt:
                child.host_value = frozen(span)
                tree._host_size += hi - pos
                tree._emit_stored(child, Medium.CPU_PINNED)
                tree._refresh(child)
            else:
                res.device_frees.append(span)
                closed = closed and backed(child)
            if swa is not None and swa_c is not None:
                mine = swa[lo - start : hi - start]
                aux = child.aux
                if adopt and lo >= swa_from and aux[swa_c.at + HOST] is None:
                    aux[swa_c.at + HOST] = frozen(mine)
                elif (mine >= 0).any():
                    swa_dups.append(mine[mine >= 0])
        else:
            closed = backed(child)
        node = child
        off += nb
    res.prefix_len = off >> sh
    if off < end and refill and not closed:  # below an un-backed node: dropped
        a = off >> sh
        res.device_frees.append(slots[a - start :])
        if swa is not None:
            mine = swa[a - start :]
            if (mine >= 0).any():
                swa_dups.append(mine[mine >= 0])
        res.cached_len = a
    elif off < end:
        a = off >> sh
        if a < swa_from < end_tok:
            node = _new_leaf(tree, node, key, a, swa_from, start, slots, None)
            a = swa_from
        node = _new_leaf(tree, node, key, a, end_tok, start, slots,
                         swa if a >= swa_from else None)
    if state is not None:
        one = state_slot(state)
        mamba = tree._mamba
        assert mamba is not None
        aux = node.aux
        if node is not tree._root and node.host_value is not None and (
            aux[mamba.at + HOST] is None
        ):
            aux[mamba.at + HOST] = one
        else:
            state_dups.append(one)
    if node is not tree._root:
        refresh_aux(tree, node)
    res.last_node = node.id
    return res
