"""Host inserts of hybrid trees: pages fetched from storage (L3 -> L2) with their SWA pages and
the Mamba state at the end of the span: the last step of a prefetch, inserting what arrived
from storage into the host tier, as the reference (SGLang's HiCache) does.

The caller brings, for ``key[start:end]``: one FULL host slot per token; optionally one SWA
host slot per token, -1 where no SWA page was fetched (the fetched ones are a page-aligned
suffix of the span: the last window); optionally the host slot of the state after ``end``.
The FULL walk is the FULL-only tree's (:func:`asynccache.tree.host_insert.walk`: it touches
the anchor and the nodes it walks; under the write-through policies a device node without a
host copy takes the FULL slots as its backup, and the SWA slots if its whole span has them;
under write-back it takes none). The node ending at ``end`` takes the state if it has a FULL
host copy and no state yet. Everything else comes back (FULL in ``device_frees``, SWA / state
in ``component_frees`` — all *host* slots here). The uncached rest becomes host-only nodes,
cut where the fetched SWA begins, unless (write-through policies) it would hang below a node
that is neither the root nor backed up: then it comes back too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from asynccache.tree import host_insert
from asynccache.tree.components.layout import HOST
from asynccache.tree.hybrid import refresh_aux
from asynccache.tree.keys import RadixKey
from asynccache.tree.node import Node, frozen, state_slot
from asynccache.tree.results import InsertResult

if TYPE_CHECKING:
    from asynccache.tree.host_tier import HostTier


def insert_host(tree: HostTier, key: RadixKey, start: int, slots: np.ndarray,
                swa: np.ndarray | None, state: int | None) -> InsertResult:
    """See the module docstring; the arguments are validated by the caller."""
    end_tok = start + len(slots)
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

    def give_back(mine: np.ndarray) -> None:
        if (mine >= 0).any():
            swa_dups.append(mine[mine >= 0])

    def step(child: Node, lo: int, hi: int, adopted: bool) -> None:  # SWA slots given
        assert swa is not None and swa_c is not None
        mine = swa[lo - start : hi - start]
        aux = child.aux
        if adopted and lo >= swa_from and aux[swa_c.at + HOST] is None:
            aux[swa_c.at + HOST] = frozen(mine)
        else:
            give_back(mine)

    with_swa = swa is not None and swa_c is not None
    node, a, dropped = host_insert.walk(tree, key, start, slots, res, step if with_swa else None)
    if dropped:
        if swa is not None:
            give_back(swa[a - start :])
    elif a < end_tok:
        if a < swa_from < end_tok:
            node = host_insert.new_leaf(tree, node, key, a, swa_from, start, slots)
            a = swa_from
        node = host_insert.new_leaf(tree, node, key, a, end_tok, start, slots,
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
