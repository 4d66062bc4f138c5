"""``sanity_check``: recompute every invariant of a tree from scratch and compare."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from asynccache.tree.hashing import chain_digests
from asynccache.tree.keys import DEFAULT_NAMESPACE
from asynccache.tree.node import DLEAF, HDUP, HLEAF, Node, settled_dup, spared_dup

if TYPE_CHECKING:
    from asynccache.tree.tree import RadixTree


def _fail(msg: str) -> None:
    raise AssertionError(f"tree invariant violated: {msg}")


def check_tree(tree: RadixTree) -> None:
    root = tree._root
    pb = tree._pb
    nodes = tree._nodes
    if nodes.get(0) is not root:
        _fail("node id 0 is not the root")
    # Reachability and structure.
    seen: dict[int, Node] = {}
    stack = [root]
    while stack:
        n = stack.pop()
        if n.id in seen:
            _fail(f"node {n.id} reachable twice")
        seen[n.id] = n
        for ck, c in n.children.items():
            if c.parent is not n:
                _fail(f"node {c.id} parent link does not point to {n.id}")
            page = c.key[:pb]
            expect_key: object = (c.ns, page) if n is root and c.ns is not DEFAULT_NAMESPACE else page
            if ck != expect_key:
                _fail(f"node {c.id} is filed under the wrong child key")
            if n is not root and c.ns is not n.ns:
                _fail(f"node {c.id} namespace differs from its parent {n.id}")
            stack.append(c)
    if len(seen) != len(nodes) or any(nodes.get(i) is not n for i, n in seen.items()):
        _fail(f"{len(nodes)} registered nodes but {len(seen)} reachable")

    # Expected lock counts from receipts and in-flight ops.
    dev_anchor: dict[int, int] = {}
    host_anchor: dict[int, int] = {}
    for node, is_host in tree._receipts.values():
        if node.id not in nodes:
            _fail(f"a lock receipt is anchored at deleted node {node.id}")
        d = host_anchor if is_host else dev_anchor
        d[node.id] = d.get(node.id, 0) + 1
    for op_id, op in tree._pending.items():
        frags = op.fragments
        for i, f in enumerate(frags):
            if f.pending != op_id:
                _fail(f"node {f.id} is a fragment of op {op_id} but marked pending={f.pending}")
            if i and f.parent is not frags[i - 1]:
                _fail(f"fragments of op {op_id} are not a parent chain")
        dev_anchor[frags[-1].id] = dev_anchor.get(frags[-1].id, 0) + 1
    exp_dev: dict[int, int] = {}
    exp_host: dict[int, int] = {}
    for anchors, exp in ((dev_anchor, exp_dev), (host_anchor, exp_host)):
        for nid, cnt in anchors.items():
            walk: Node | None = nodes[nid]
            while walk is not None and walk is not root:
                exp[walk.id] = exp.get(walk.id, 0) + cnt
                walk = walk.parent

    # Session references: each held ref anchors at a live node (or the root), listed there.
    for token, node in tree._srefs.items():
        if node is not root and (nodes.get(node.id) is not node or token not in (node.anchors or ())):
            _fail(f"session ref {token} is anchored at node {node.id}, which does not list it")

    evictable = protected = host_pinned = host_size = 0
    dev_slots: list[np.ndarray] = []
    host_slots: list[np.ndarray] = []
    members = [0, 0, 0]
    for n in seen.values():
        if n is root:
            continue
        parent = n.parent
        assert parent is not None
        k = n.ntok
        if k == 0 or len(n.key) % pb:
            _fail(f"node {n.id} key of {len(n.key)} bytes is not whole pages")
        if n.value is None and n.host_value is None:
            _fail(f"node {n.id} holds neither device nor host KV")
        if n.value is not None:
            if len(n.value) != k:
                _fail(f"node {n.id} has {len(n.value)} device slots for {k} tokens")
            if parent is not root and parent.value is None:
                _fail(f"node {n.id} is on device below host-only node {parent.id}")
            dev_slots.append(n.value)
            if n.lock_ref or (n.host_value is None and n.host_lock_ref):
                protected += k
                if not n.lock_ref:
                    host_pinned += k
            else:
                evictable += k
        elif n.lock_ref:
            _fail(f"host-only node {n.id} is device-locked")
        if n.host_value is not None:
            if len(n.host_value) != k:
                _fail(f"node {n.id} has {len(n.host_value)} host slots for {k} tokens")
            host_slots.append(n.host_value)
            host_size += k
        if n.lock_ref != exp_dev.get(n.id, 0):
            _fail(f"node {n.id} lock_ref {n.lock_ref} != expected {exp_dev.get(n.id, 0)}")
        if n.host_lock_ref != exp_host.get(n.id, 0):
            _fail(f"node {n.id} host_lock_ref {n.host_lock_ref} != {exp_host.get(n.id, 0)}")
        if n.value is not None and n.acct != (
            2 if n.lock_ref else 3 if n.host_value is None and n.host_lock_ref else 1
        ):
            _fail(f"node {n.id} is counted in size class {n.acct}, not its state's")
        sref = len(n.anchors or ()) + sum(c.sref for c in n.children.values())
        if n.sref != sref:
            _fail(f"node {n.id} counts {n.sref} session refs, {sref} expected")
        if any(tree._srefs.get(t) is not n for t in n.anchors or ()):
            _fail(f"node {n.id} lists a session ref anchored elsewhere")
        dch = sum(1 for c in n.children.values() if c.value is not None)
        if n.dchildren != dch:
            _fail(f"node {n.id} dchildren {n.dchildren} != {dch}")
        if n.pending and n.pending not in tree._pending:
            _fail(f"node {n.id} pending on unknown op {n.pending}")
        free = n.pending == 0
        wanted = (
            free
            and n.value is not None
            and n.lock_ref == 0
            and dch == 0
            and not (n.host_value is None and n.host_lock_ref > 0),
            free and n.value is None and n.host_value is not None and not n.children
            and n.host_lock_ref == 0,
            free and n.value is not None and n.host_value is not None and n.host_lock_ref == 0,
        )
        for slot in (DLEAF, HLEAF, HDUP):
            if wanted[slot] != (n.aux[slot] is not None):
                _fail(f"node {n.id} queue {slot} membership is {not wanted[slot]}, want {wanted[slot]}")
            members[slot] += wanted[slot]
        if n.digests is not None:
            pd = parent.digests
            if parent is root or pd is not None:
                prev = None if pd is None or parent is root else pd[-1]
                if n.digests != chain_digests(n.ns, prev, n.key, pb):
                    _fail(f"node {n.id} page hashes do not continue its parent's chain")
            if len(n.digests) != k // tree.page_size:
                _fail(f"node {n.id} has {len(n.digests)} page hashes for {k} tokens")
    for slot, q in enumerate(tree._queues):
        if len(q) != members[slot]:
            _fail(f"queue {slot} counts {len(q)} live entries, {members[slot]} expected")
    if (evictable, protected, host_pinned, host_size) != (
        tree._evictable,
        tree._protected,
        tree._host_pinned,
        tree._host_size,
    ):
        _fail(
            f"sizes (evictable, protected, host-pinned, host) = "
            f"{(tree._evictable, tree._protected, tree._host_pinned, tree._host_size)}, "
            f"recomputed {(evictable, protected, host_pinned, host_size)}"
        )
    if tree._arc is not None:
        check_arc(tree, seen)
    check_dup_order(tree, seen)
    for name, parts in (("device", dev_slots), ("host", host_slots)):
        if parts:
            allslots = np.concatenate(parts)
            if allslots.min() < 0:
                _fail(f"a {name} slot index is negative")
            if np.bincount(allslots).max() > 1:
                _fail(f"a {name} slot is held by two nodes")


def check_dup_order(tree: RadixTree, seen: dict[int, Node]) -> None:
    """Write-back trees: every settled host duplicate has an entry in the reclaim order, and
    every entry names a live node (entries of nodes that stopped being duplicates may stay)."""
    order = tree._dup_order
    if not tree._write_back:
        if order:
            _fail(f"a tree without write-back keeps {len(order)} duplicate-order entries")
        return
    for node_id, n in order.items():
        if seen.get(node_id) is not n:
            _fail(f"the duplicate order names node {node_id}, which is not in the tree")
    for n in seen.values():
        if n is not tree._root and settled_dup(n) and n.id not in order:
            _fail(f"host duplicate {n.id} has no place in the duplicate order")
    if tree._dup_place.keys() != order.keys():
        _fail("the duplicate order's places do not match its entries")
    for node_id, n in order.items():
        if not spared_dup(n) and node_id not in tree._dup_queued:
            _fail(f"duplicate-order entry {node_id} is not an evictable device leaf but is not "
                  "queued for the first reclaim pass")
    if not tree._dup_queued <= order.keys():
        _fail("a node queued for the first reclaim pass has no entry in the duplicate order")


def check_arc(tree: RadixTree, seen: dict[int, Node]) -> None:
    """The arc policy's bookkeeping (asynccache/tree/arc.py): the class sizes recount, each
    evictable leaf is filed in its class's heap, cached page keys continue their parents',
    ghost lists and the target within bounds."""
    from asynccache.tree.arc import ArcQueue

    arc = tree._arc
    assert arc is not None
    at = arc.at
    root = tree._root
    once = reused = 0
    filed = [0, 0]
    for n in seen.values():
        if n is root:
            continue
        cls = n.aux[at]
        if cls not in (0, 1):
            _fail(f"node {n.id} has arc class {cls!r}")
        if n.value is None:
            if cls:
                _fail(f"node {n.id} is off the device but of the reused class")
        elif cls:
            reused += n.ntok
        else:
            once += n.ntok
        entry = n.aux[DLEAF]
        if entry is not None:
            if entry[0] != cls:
                _fail(f"leaf {n.id} of class {cls} is filed in the heap of class {entry[0]}")
            filed[cls] += 1
        key = n.aux[at + 1]
        if key is not None:
            k = key
            n.aux[at + 1] = None
            if arc.chain_key(n) != k:
                _fail(f"node {n.id} caches a page key that does not continue its parent's")
    if reused != arc.reused:
        _fail(f"arc counts {arc.reused} reused-class device tokens, recomputed {reused}")
    if once != arc.once_tokens():
        _fail(f"arc counts {arc.once_tokens()} once-class device tokens, recomputed {once}")
    dq = tree._queues[DLEAF]
    assert isinstance(dq, ArcQueue)
    if (dq.live(0), dq.live(1)) != tuple(filed):
        _fail(f"arc heaps count {(dq.live(0), dq.live(1))} live leaves, {tuple(filed)} filed")
    for i, ghost in enumerate(arc.ghosts):
        if len(ghost) > arc.ghost_cap:
            _fail(f"ghost list {i} holds {len(ghost)} keys, more than {arc.ghost_cap}")
    if not 0 <= arc.p <= arc.capacity:
        _fail(f"arc target p = {arc.p} is outside [0, {arc.capacity}]")
