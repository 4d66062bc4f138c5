"""Component invariants of a hybrid tree, recomputed from scratch (part of ``sanity_check``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from asynccache.tree.components.layout import LOCK, WIDTH
from asynccache.tree.node import Node

if TYPE_CHECKING:
    from asynccache.tree.tree import RadixTree


def _fail(msg: str) -> None:
    raise AssertionError(f"tree invariant violated: {msg}")


def check_components(tree: RadixTree) -> None:
    comps = tree._aux
    nodes = tree._nodes
    root = tree._root
    # Expected pins from the receipts: SWA covers `extent` tokens above the anchor, Mamba the
    # anchor alone.
    expect: list[dict[int, int]] = [{} for _ in comps]
    if set(tree._aux_locks) != {t for t, (_, host) in tree._receipts.items() if not host}:
        _fail("component lock records do not match the held device receipts")
    if not tree._swa_released <= set(tree._aux_locks):
        _fail("an early SWA release is recorded for a receipt that is not held")
    for token, extents in tree._aux_locks.items():
        anchor, _ = tree._receipts[token]
        if tree._swa is not None and token in tree._swa_released and extents[tree._swa.index]:
            _fail(f"receipt {token} released its SWA part early but still holds it")
        for i, c in enumerate(comps):
            left = extents[i]
            if c.name == "mamba":
                if left:
                    expect[i][anchor.id] = expect[i].get(anchor.id, 0) + 1
                continue
            n: Node | None = anchor
            while left > 0:
                if n is None or n is root:
                    _fail(f"receipt {token}'s SWA span runs past the root")
                    return
                expect[i][n.id] = expect[i].get(n.id, 0) + 1
                left -= n.ntok
                n = n.parent
            if left:
                _fail(f"receipt {token}'s SWA span does not end at a node boundary")
    for i, c in enumerate(comps):
        evictable = protected = members = 0
        held: list[np.ndarray] = []
        host_held: list[np.ndarray] = []
        for n in nodes.values():
            aux = n.aux
            if len(aux) != len(tree._aux_empty):  # (an arc tree's entries come last)
                _fail(f"node {n.id} has no data for every component")
                return
            value, lock_ref, _, qe, acct, host_value = aux[c.at : c.at + WIDTH]
            if n is root:
                if value is not None or host_value is not None or lock_ref or qe:
                    _fail(f"the root holds {c.name} state")
                continue
            if lock_ref != expect[i].get(n.id, 0):
                _fail(f"node {n.id} {c.name} lock_ref {lock_ref} != {expect[i].get(n.id, 0)}")
            if lock_ref > n.lock_ref:
                _fail(f"node {n.id} is {c.name}-locked more than FULL-locked")
            if value is not None:
                if n.value is None:
                    _fail(f"node {n.id} holds {c.name} without FULL KV")
                if c.name == "swa":
                    if value is not n.value:
                        _fail(f"node {n.id}'s SWA entry is not its FULL slot array")
                else:
                    if len(value) != 1 or value.dtype != np.int64:
                        _fail(f"node {n.id} has {len(value)} {c.name} slots, want 1")
                    if value.flags.writeable:
                        _fail(f"node {n.id} {c.name} slots are writeable")
                    held.append(value)
                units = c.units(n)
                if lock_ref:
                    protected += units
                else:
                    evictable += units
            elif c.name == "mamba" and lock_ref:
                _fail(f"node {n.id} has a Mamba pin but no state")
            if host_value is not None:
                if n.host_value is None:
                    _fail(f"node {n.id} holds a host copy of {c.name} without a FULL host copy")
                want_len = n.ntok if c.name == "swa" else 1
                if len(host_value) != want_len or host_value.dtype != np.int64:
                    _fail(f"node {n.id} has {len(host_value)} {c.name} host slots, want "
                          f"{want_len}")
                if host_value.flags.writeable:
                    _fail(f"node {n.id} {c.name} host slots are writeable")
                host_held.append(host_value)
            want_acct = 0 if value is None else (2 if lock_ref else 1)
            if acct != want_acct:
                _fail(f"node {n.id} {c.name} counted in class {acct}, not {want_acct}")
            blocked = any(
                o.priority < c.priority and aux[o.at + LOCK] for o in comps
            )
            want_q = want_acct == 1 and not blocked and n.pending == 0
            if want_q != (qe is not None):
                _fail(f"node {n.id} {c.name} LRU membership is {not want_q}, want {want_q}")
            members += want_q
        if len(c.queue) != members:
            _fail(f"{c.name} LRU counts {len(c.queue)} live entries, {members} expected")
        if (evictable, protected) != (c.evictable, c.protected):
            _fail(
                f"{c.name} sizes (evictable, protected) = {(c.evictable, c.protected)}, "
                f"recomputed {(evictable, protected)}"
            )
        for where, parts in (("", held), ("host ", host_held)):
            if parts:
                allslots = np.concatenate(parts)
                if allslots.min() < 0:
                    _fail(f"a {c.name} {where}slot index is negative")
                if np.bincount(allslots).max() > 1:
                    _fail(f"a {c.name} {where}slot is held by two nodes")
