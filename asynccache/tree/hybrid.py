"""Match, insert, evict and lock for hybrid trees (FULL plus SWA and/or Mamba components).

A tree with auxiliary components routes these four operations here for a device-only tree,
where every node holds FULL device KV and nothing is in flight. With a host tier, match and
evict run in :mod:`asynccache.tree.hybrid_host` and the insert here is wrapped by it. The insert
also serves FULL-only trees without a host tier (its component branches are skipped); the
FULL-only match, evict, lock and host-tier insert keep their own loops in
:mod:`asynccache.tree.tree`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from asynccache.errors import InvalidInputError, LockError
from asynccache.tree.components.base import Component
from asynccache.tree.components.layout import ACCT, LOCK, STAMP
from asynccache.tree.config import _check_count
from asynccache.tree.events import Medium
from asynccache.tree.keys import DEFAULT_NAMESPACE, RadixKey
from asynccache.tree.node import DLEAF, HDUP, Node, frozen, joined, state_slot
from asynccache.tree.results import EMPTY_SLOTS, EvictResult, InsertResult, MatchResult

if TYPE_CHECKING:
    from asynccache.tree.base import TreeBase
    from asynccache.tree.host_tier import HostTier


_INF = 1 << 62


def _ceil_page(pos: int, page_size: int) -> int:
    return -(-pos // page_size) * page_size


def refresh_aux(tree: TreeBase, n: Node) -> None:
    """Recount ``n``'s component values and fix their LRU queue membership."""
    if n.parent is None:
        return
    aux = n.aux
    locked_below = False
    for c in tree._aux_low_first:
        c.refresh(n, locked_below)
        if aux[c.at + LOCK]:
            locked_below = True


def touch_aux(tree: TreeBase, node: Node) -> None:
    """Refresh each component's LRU for a match or insert ending at ``node`` (stamps only; the
    queues re-file lazily): SWA refreshes only the nodes holding SWA within window + one page
    above ``node`` (so deep matches do not keep old ancestors warm), deepest newest; Mamba the
    node itself, if it holds a state."""
    if node.parent is None:
        return
    clock = tree._clock
    swa = tree._swa
    if swa is not None:
        si = swa.at
        limit = (swa.window + swa.page_size) << tree._sh  # in key bytes
        span = 0
        hit: list[list[Any]] = []
        n = node
        while True:
            aux = n.aux
            if aux[si] is not None:
                hit.append(aux)
            span += len(n.key)
            parent = n.parent
            assert parent is not None
            if span >= limit or parent.parent is None:
                break
            n = parent
        k = len(hit)
        st = si + STAMP
        for aux in hit:
            aux[st] = clock + k
            k -= 1
        clock += len(hit)
    tree._clock = _stamp_state(tree, node, clock)


def _stamp_state(tree: TreeBase, node: Node, clock: int) -> int:
    """Refresh ``node``'s Mamba state (if it holds one) with the next stamp; returns the clock."""
    mamba = tree._mamba
    if mamba is not None:
        aux = node.aux
        if aux[mamba.at] is not None:
            clock += 1
            aux[mamba.at + STAMP] = clock
    return clock


# ---------------------------------------------------------------------------- match
def match(tree: TreeBase, key: RadixKey, cow_mamba: bool) -> MatchResult:
    """The validators are evaluated inline (a method call per node and component costs a
    third of a match): SWA accepts a node when the path has no SWA tombstone or the SWA-live
    tokens since the last one reach the window; Mamba accepts a node holding a state."""
    data = key.data
    pb = tree._pb
    sh = tree._sh
    end = len(data) - len(data) % pb
    ns = key.namespace
    swa = tree._swa
    mamba = tree._mamba
    si = swa.at if swa is not None else -1
    mi = mamba.at if mamba is not None else -1
    window = swa.window if swa is not None else 0
    live = _INF  # SWA-live tokens since the last SWA tombstone
    swa_bound = mamba_bound = 0  # deepest boundary (bytes) each component accepts
    root = tree._root
    best = root
    best_count = 0
    off = 0
    path: list[Node] = []
    children = root.children
    ck = tree._child_key(root, data[:pb], ns)
    while off < end:
        child = children.get(ck)
        if child is None:
            break
        ckey = child.key
        nb = len(ckey)
        if nb > end - off or not data.startswith(ckey, off):  # else the whole node matches
            child, nb = tree._match_child(child, data, off, end)
        path.append(child)
        off += nb
        aux = child.aux
        ok = True
        if si >= 0:
            if aux[si] is None:
                live = 0
                ok = False
            else:
                live += nb >> sh
                if live >= window:
                    swa_bound = off
                else:
                    ok = False
        if mi >= 0:
            if aux[mi] is None:
                ok = False
            else:
                mamba_bound = off
        if ok:
            best = child
            best_count = len(path)
        children = child.children
        ck = data[off : off + pb]
    # Access stamps from the best node up, as the reference's match does: the tail past it,
    # which no component accepts (e.g. no Mamba state), ages as if unmatched.
    tree._touch_path(path if best_count == len(path) else path[:best_count])
    touch_aux(tree, best)
    indices: np.ndarray | None
    if best_count == 0:
        indices = EMPTY_SLOTS
    elif best_count == 1:
        indices = path[0].value
        assert indices is not None
    else:
        indices = joined([n.value for n in path[:best_count]])
    full_hit = off >> sh
    res = MatchResult(
        device_indices=indices,
        device_prefix_len=len(indices),
        last_device_node=best.id,
        best_node=best.id,
        host_hit_length=0,
        full_kv_hit_length=full_hit,
    )
    set_branching(tree, res, swa_bound, mamba_bound, best if cow_mamba else None)
    return res


def set_branching(tree: TreeBase, res: MatchResult, swa_bound: int, mamba_bound: int,
                  cow_node: Node | None) -> None:
    """Fill ``res``'s branching seqlens (past each component's deepest valid boundary, in key
    bytes) and, for copy-on-write, the state slot of ``cow_node``."""
    full_hit = res.full_kv_hit_length
    sh = tree._sh
    if tree._swa is not None and full_hit > swa_bound >> sh:
        res.swa_branching_seqlen = full_hit
    mamba = tree._mamba
    if mamba is not None:
        grid = tree._mamba_interval
        b = full_hit // grid * grid
        if b > mamba_bound >> sh:
            res.mamba_branching_seqlen = b
        if cow_node is not None and cow_node is not tree._root:
            state = mamba.value(cow_node)
            assert state is not None
            res.mamba_cow_slot = int(state[0])


# ---------------------------------------------------------------------------- insert
def _slot(value: Any, what: str) -> int:
    if type(value) is int and value >= 0:
        return value  # the usual case, checked cheaply
    if hasattr(value, "numel") and hasattr(value, "item"):
        if value.numel() != 1:
            raise InvalidInputError(f"{what} must be one state slot, got {value.numel()} values")
        value = value.item()
    elif isinstance(value, np.ndarray):
        if value.size != 1:
            raise InvalidInputError(f"{what} must be one state slot, got {value.size} values")
        value = value.reshape(-1)[0]
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise InvalidInputError(f"{what} must be a non-negative int slot, got {value!r}")
    return int(value)


def check_insert_args(
    tree: TreeBase,
    total: int,
    component_evicted_seqlens: Mapping[str, int] | None,
    mamba_value: Any,
) -> tuple[int, int | None]:
    """Validate the component arguments of an insert; returns (SWA floor, state)."""
    names = tree._aux_names
    floor = 0
    if component_evicted_seqlens:
        if not isinstance(component_evicted_seqlens, Mapping):
            raise InvalidInputError(
                f"component_evicted_seqlens must be a mapping, got {component_evicted_seqlens!r}"
            )
        for name, seqlen in component_evicted_seqlens.items():
            if name != "swa" or name not in names:
                raise InvalidInputError(
                    f"component_evicted_seqlens names {name!r}; only 'swa' has an evicted floor "
                    f"and this tree's components are {sorted(names)}"
                )
            floor = _check_count("component_evicted_seqlens['swa']", seqlen)
            if floor > total:
                raise InvalidInputError(
                    f"SWA evicted seqlen {floor} exceeds the key length {total}"
                )
    state = None
    if mamba_value is not None:
        if "mamba" not in names:
            raise InvalidInputError("mamba_value given but the tree has no Mamba component")
        state = _slot(mamba_value, "mamba_value")
    return floor, state


def insert(
    tree: TreeBase,
    key: RadixKey,
    slots: np.ndarray,
    prev_prefix_len: int,
    inserted_len: int,
    priority: int,
    floor: int,
    state: int | None,
    unevicted: Collection[int] = (),
) -> InsertResult:
    """The insert of every tree without a host tier, FULL-only included (with no components
    their branches are skipped), and of hybrid trees with one (after hybrid_host.prepare_insert;
    ``unevicted``: the nodes it gave the caller's slots, whose SWA tombstone is recovered for
    the whole node above the SWA floor, not only within the insert's last window).
    The walk inlines the per-node work (tick, page match, duplicate checks): every call saved
    per node counts.

    SWA needs no slots of its own here: the caller's SWA KV is the translation of its FULL
    slots, so a duplicate FULL slot given back takes its SWA side along, and a recovered or new
    SWA-live node names its FULL slots."""
    data = key.data
    pb = tree._pb
    sh = tree._sh
    ps = tree.page_size
    end = len(data) - len(data) % pb
    n_tok = end >> sh
    ns = key.namespace
    swa = tree._swa
    mamba = tree._mamba
    floor_a = -(-floor // ps) * ps
    res = InsertResult(0, n_tok, 0)  # (prefix_len, cached_len, last_node)
    frees = res.device_frees
    swa_frees: list[np.ndarray] = []
    si = -1
    recover_from = n_tok
    # touch_aux's SWA refresh, on the way down: the path nodes holding SWA that end past
    # ``near`` (within window + page of the end, where the insert ends) take the next stamps,
    # top first, so the deepest is the newest; the new nodes (_commit_tail) take later ones.
    near = end
    if swa is not None:
        si = swa.at
        recover_from = max(floor_a, n_tok - swa.window_span)
        res.component_frees["swa"] = swa_frees
        near = end - ((swa.window + ps) << sh)
    mamba_frees: list[np.ndarray] = []
    if mamba is not None:
        res.component_frees["mamba"] = mamba_frees
    node = tree._root
    children = node.children
    off = 0
    clock = tree._clock
    touch_rq = tree._touch_requeues
    hit_rq = tree._hit_requeues
    count_hits = tree._count_hits
    prio_rq = tree._prio_requeues
    intents = tree._intents
    ck = data[:pb] if ns is DEFAULT_NAMESPACE else (ns, data[:pb])  # (_child_key at the root)
    # The caller's duplicate slots come back as runs (one array per run, not per node).
    fa = fb = 0
    while off < end:
        child = children.get(ck)
        if child is None:
            break
        ckey = child.key
        nb = len(ckey)
        if nb > end - off or not data.startswith(ckey, off):
            tree._clock = clock  # a split stamps the suffix with the next tick
            child, nb = tree._match_child(child, data, off, end)
            clock = tree._clock
            if child.value is None:  # host-only (hybrid_host.prepare_insert left it whole)
                cast("HostTier", tree)._unevict(child, slots[off >> sh : (off + nb) >> sh])
                refresh_aux(tree, child)
                unevicted = (*unevicted, child.id)  # (its SWA is rebuilt as below)
        pos = off >> sh
        hi = pos + (nb >> sh)
        clock += 1
        child.last_access = clock
        requeue = touch_rq
        if priority > child.priority:
            child.priority = priority
            requeue = requeue or prio_rq
        if hi > inserted_len and count_hits:
            child.hit_count += 1
            requeue = requeue or hit_rq
            if intents and child.hit_count >= tree._threshold:
                res.intents.append(child.id)
        lo = pos if pos > prev_prefix_len else prev_prefix_len
        if hi > lo:
            own = child.value
            assert own is not None
            k = lo - pos
            # A caller handing back the tree's own slots is not a duplicate.
            if slots[lo] != own[k] or not np.array_equal(slots[lo:hi], own[k:]):
                if fb != lo:  # extend the run of duplicates, or start a new one
                    if fb > fa:
                        frees.append(slots[fa:fb])
                    fa = lo
                fb = hi
            if si >= 0 and child.aux[si] is None and hi > floor:
                tree._clock = clock
                _swa_tombstone(tree, child, pos, lo, hi, floor,
                               floor_a if child.id in unevicted else recover_from, slots,
                               swa_frees, res.swa_adopted)
                clock = tree._clock
        # (A walked node can be queued as a device leaf or, with a host tier, as a host
        # duplicate; a host-only one was given the caller's slots by prepare_insert or above.)
        if requeue and (child.aux[DLEAF] is not None or child.aux[HDUP] is not None):
            tree._requeue(child)
        node = child
        children = child.children
        off += nb
        ck = data[off : off + pb]
        if off > near:
            aux = child.aux
            if aux[si] is not None:
                clock += 1
                aux[si + STAMP] = clock
    tree._clock = clock
    if fb > fa:
        frees.append(slots[fa:fb])
    res.prefix_len = off >> sh
    fresh = off < end
    if fresh:
        top = node
        node = _commit_tail(tree, node, key, slots, off >> sh, n_tok, priority, floor, floor_a,
                            swa_frees, near)
        if intents and tree._threshold <= 1:  # every new node, root first
            new = res.intents
            at = len(new)
            n = node
            while n is not top:
                new.insert(at, n.id)
                assert n.parent is not None
                n = n.parent
    if node.parent is not None:
        # touch_aux(tree, node)'s Mamba part (its SWA part was done on the way down).
        clock = tree._clock
        if mamba is not None:
            aux = node.aux
            mv = mamba.at
            v = aux[mv]
            if v is not None:
                res.mamba_exist = True
                if state is not None and int(v[0]) != state:
                    mamba_frees.append(state_slot(state))
                clock += 1
                aux[mv + STAMP] = clock
            elif state is not None:
                aux[mv] = state_slot(state)
                clock += 1
                aux[mv + STAMP] = clock
                if fresh:
                    # refresh_aux on a new leaf (unlocked, nothing in flight, SWA already
                    # counted): the state becomes evictable and joins the Mamba LRU.
                    aux[mv + ACCT] = 1
                    mamba.evictable += 1
                    mamba.queue.push(node)
                else:
                    refresh_aux(tree, node)
        tree._clock = clock
    res.last_node = node.id
    return res


def _swa_tombstone(
    tree: TreeBase,
    child: Node,
    pos: int,
    lo: int,
    hi: int,
    floor: int,
    recover_from: int,
    slots: np.ndarray,
    swa_frees: list[np.ndarray],
    adopted: list[tuple[np.ndarray, np.ndarray]],
) -> None:
    """The caller covers ``[lo, hi)`` of the SWA tombstone ``child``. From the page boundary at
    or after ``recover_from`` (inside the last window, above the SWA floor; for a node that was
    host-only before this insert, anywhere above the floor) the node is SWA-live
    again (split there); where the caller's FULL slots there are not the node's own, the node
    adopts their SWA side (``swa_adopted``). Above the floor and before that boundary the
    caller's SWA side is given up (``swa_frees``): the node stays a tombstone there."""
    s_lo = lo if lo > floor else floor
    r = _ceil_page(max(lo, recover_from), tree.page_size)
    if r >= hi:
        swa_frees.append(slots[s_lo:hi])
        return
    if s_lo < r:
        swa_frees.append(slots[s_lo:r])
    if r > pos:
        tree._split(child, (r - pos) << tree._sh)  # child keeps the recovered suffix
    own = child.value
    assert own is not None
    mine = slots[r:hi]
    if not np.array_equal(mine, own):
        adopted.append((own, mine))
    swa = tree._swa
    assert swa is not None
    child.aux[swa.at] = own
    refresh_aux(tree, child)


def _commit_tail(
    tree: TreeBase,
    parent: Node,
    key: RadixKey,
    slots: np.ndarray,
    start: int,
    n_tok: int,
    priority: int,
    floor: int,
    floor_a: int,
    swa_frees: list[np.ndarray],
    near: int,
) -> Node:
    """Create the leaf chain for ``[start, n_tok)``: an SWA tombstone part below the floor, and
    the live part cap-split so that the leaf holds exactly one page-aligned window. New SWA
    data joins the SWA LRU here: stamped with its node's creation tick if it ends past
    ``near`` (the insert's refresh, see insert), else unstamped."""
    swa = tree._swa
    if swa is None:
        return _commit_leaf(tree, parent, key, slots, start, n_tok, priority)
    cuts = [start]
    live_from = n_tok
    si = 0
    if swa is not None:
        si = swa.at
        live_from = floor_a if floor_a > start else start
        if start < live_from < n_tok:
            cuts.append(live_from)
        cap = n_tok - swa.window_span
        if cap > live_from:
            cuts.append(cap)
        s_lo = floor if floor > start else start
        s_hi = floor_a if floor_a < n_tok else n_tok
        if s_lo < s_hi:
            # A partly freed page is not kept: the SWA side of its FULL slots above the floor
            # goes (the page becomes part of the tombstone).
            swa_frees.append(slots[s_lo:s_hi])
    cuts.append(n_tok)
    one = len(cuts) == 2  # a single new leaf holds the whole copy
    data = key.data
    pb = tree._pb
    sh = tree._sh
    new_node = tree._node_cls
    ns = key.namespace
    full = frozen(slots[start:n_tok])  # one copy; the segments are read-only views of it
    empty = tree._aux_empty
    nodes = tree._nodes
    ids = tree._ids
    tick = tree._clock
    eager = tree._eager_hashes
    events = tree._events is not None
    node = parent
    ck = data[start << sh : (start << sh) + pb]
    if parent is tree._root:
        ck = tree._child_key(parent, ck, ns)
    a = start
    for b in cuts[1:]:
        leaf = new_node(next(ids), node, data[a << sh : b << sh], ns, empty[:])
        nodes[leaf.id] = leaf
        leaf.value = v = full if one else full[a - start : b - start]
        tick += 1
        leaf.creation = leaf.last_access = tick
        leaf.hit_count = 1
        leaf.priority = priority
        leaf.acct = 1  # tree._refresh of a new device leaf: unlocked, no host copy, not in flight
        node.children[ck] = leaf
        node.dchildren += 1
        if eager:
            tree._digests(leaf)
        if events:
            tree._emit_stored(leaf, Medium.GPU)
        if a >= live_from:
            assert swa is not None
            aux = leaf.aux
            aux[si] = v
            aux[si + ACCT] = 1  # counted and queued as evictable
            swa.evictable += b - a
            if b << sh > near:
                aux[si + STAMP] = tick
            swa.queue.push(leaf)
        node = leaf
        a = b
        ck = data[a << sh : (a << sh) + pb]
    tree._clock = tick
    if parent.dchildren == 1:
        # Its first device child: it may stop being an evictable leaf. (With device children
        # already, a new one changes none of its queue conditions.)
        tree._refresh(parent)
    tree._evictable += n_tok - start
    tree._queues[DLEAF].push(node)
    return node


def _commit_leaf(
    tree: TreeBase,
    parent: Node,
    key: RadixKey,
    slots: np.ndarray,
    start: int,
    n_tok: int,
    priority: int,
) -> Node:
    """_commit_tail without an SWA component: one new device leaf holds ``[start, n_tok)``
    (the cut-free case of its loop, without the loop)."""
    data = key.data
    sh = tree._sh
    a = start << sh
    ns = key.namespace
    leaf = tree._node_cls(next(tree._ids), parent, data[a : n_tok << sh], ns,
                          tree._aux_empty[:])
    tree._nodes[leaf.id] = leaf
    leaf.value = frozen(slots[start:n_tok])
    tick = tree._clock + 1
    tree._clock = tick
    leaf.creation = leaf.last_access = tick
    leaf.hit_count = 1
    leaf.priority = priority
    leaf.acct = 1  # tree._refresh of a new device leaf: unlocked, no host copy, not in flight
    ck = data[a : a + tree._pb]
    if parent is tree._root:
        ck = tree._child_key(parent, ck, ns)
    parent.children[ck] = leaf
    parent.dchildren += 1
    if tree._eager_hashes:
        tree._digests(leaf)
    if tree._events is not None:
        tree._emit_stored(leaf, Medium.GPU)
    if parent.dchildren == 1:
        tree._refresh(parent)  # its first device child (see _commit_tail)
    tree._evictable += n_tok - start
    tree._queues[DLEAF].push(leaf)
    return leaf


# ---------------------------------------------------------------------------- eviction
def evict(tree: TreeBase, num_tokens: int, swa_num_tokens: int, mamba_num: int) -> EvictResult:
    res = EvictResult()
    for c in tree._aux:
        res.component_frees[c.name] = []
    dq = tree._queues[DLEAF]
    while res.num_evicted < num_tokens:
        n = dq.pop()
        if n is None:
            break
        _delete_leaf(tree, n, res)
    if not (swa_num_tokens or mamba_num):
        return res
    for c in tree._aux:
        target = swa_num_tokens if c.name == "swa" else mamba_num
        while (res.swa_num_evicted if c.name == "swa" else res.mamba_num_evicted) < target:
            n = c.queue.pop()
            if n is None:
                break
            if not n.children and n.lock_ref == 0 and n.pending == 0:
                tree._queues[DLEAF].discard(n)
                _delete_leaf(tree, n, res)
            else:
                _tombstone(tree, n, c, res)
    return res


def _free_aux(c: Component, n: Node, res: EvictResult) -> None:
    value = c.drop_value(n)
    res.component_frees[c.name].append(value)
    if c.name == "swa":
        res.swa_num_evicted += len(value)
    else:
        res.mamba_num_evicted += 1


def _tombstone(tree: TreeBase, n: Node, trigger: Component, res: EvictResult) -> None:
    """Drop ``trigger``'s value on ``n`` and, by cascade, every lower-priority component's."""
    for c in tree._aux:
        if c.priority <= trigger.priority and c.value(n) is not None:
            _free_aux(c, n, res)
    refresh_aux(tree, n)


def _delete_leaf(tree: TreeBase, n: Node, res: EvictResult) -> None:
    """Delete the unlocked leaf ``n`` with all its components, then every ancestor that became
    an unlocked leaf and is a tombstone of some component (it can never end a match).

    The component part is ``_free_aux`` + ``Component.refresh`` inlined, per component, for a
    value that goes away: uncount it and leave the component's LRU."""
    root = tree._root
    swa = tree._swa
    mamba = tree._mamba
    swa_frees = res.component_frees["swa"] if swa is not None else []
    mamba_frees = res.component_frees["mamba"] if mamba is not None else []
    events = tree._events is not None
    while True:
        parent = n.parent
        assert parent is not None and not n.children and n.lock_ref == 0
        aux = n.aux
        if aux[0] is not None or aux[1] is not None or aux[2] is not None:
            for q in tree._queues:
                q.discard(n)
        value = n.value
        assert value is not None
        if events:
            tree._emit_removed(n, Medium.GPU)
        res.device_frees.append(value)
        res.num_evicted += len(value)
        n.value = None
        tree._account(n)
        if swa is not None:
            at = swa.at
            v = aux[at]
            if v is not None:
                assert aux[at + LOCK] == 0
                aux[at] = None
                swa_frees.append(v)
                res.swa_num_evicted += len(v)
            acct = aux[at + ACCT]
            if acct:
                if acct == 1:
                    swa.evictable -= n.ntok
                else:
                    swa.protected -= n.ntok
                aux[at + ACCT] = 0
            swa.queue.discard(n)
        if mamba is not None:
            at = mamba.at
            v = aux[at]
            if v is not None:
                assert aux[at + LOCK] == 0
                aux[at] = None
                mamba_frees.append(v)
                res.mamba_num_evicted += 1
            acct = aux[at + ACCT]
            if acct:
                if acct == 1:
                    mamba.evictable -= 1
                else:
                    mamba.protected -= 1
                aux[at + ACCT] = 0
            mamba.queue.discard(n)
        tree._detach(n)
        if n.anchors:
            tree._move_anchors(n, parent)
        del tree._nodes[n.id]
        parent.dchildren -= 1
        paux = parent.aux
        if (
            parent is root
            or parent.children
            or parent.lock_ref
            or parent.pending
            or all(paux[c.at] is not None for c in tree._aux)
        ):
            tree._refresh(parent)
            return
        n = parent


# ---------------------------------------------------------------------------- locks
def lock(tree: TreeBase, node: Node, skip: tuple[str, ...]) -> list[int]:
    """Take each component's lock for a request anchored at ``node``; returns the extents."""
    extents = []
    for c in tree._aux:
        if c.name in skip:
            extents.append(0)
            continue
        extent, pinned = c.lock(node)
        extents.append(extent)
        for n in pinned:
            refresh_aux(tree, n)
    return extents


def release(tree: TreeBase, node: Node, extents: list[int], min_priority: int) -> None:
    """Release the components of priority <= ``min_priority`` still held in ``extents``."""
    for i, c in enumerate(tree._aux):
        if c.priority <= min_priority and extents[i]:
            for n in c.unlock(node, extents[i]):
                refresh_aux(tree, n)
            extents[i] = 0


def release_swa(tree: TreeBase, token: int) -> None:
    swa = tree._swa
    if swa is None:
        raise LockError("release_swa: the tree has no SWA component")
    extents = tree._aux_locks.get(token)
    if extents is None:
        raise LockError(f"lock receipt {token} is not a held device lock")
    if token in tree._swa_released:
        raise LockError(f"the SWA part of lock {token} was already released")
    node, _ = tree._receipts[token]
    release(tree, node, extents, swa.priority)
    tree._swa_released.add(token)


def slots_of(tree: TreeBase, name: str) -> np.ndarray:
    comp = tree._component(name)
    parts = [v for n in tree.iter_nodes() if (v := comp.value(n)) is not None]
    return np.concatenate(parts) if parts else EMPTY_SLOTS
