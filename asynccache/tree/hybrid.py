"""Match, insert, evict and lock for hybrid trees (FULL plus SWA and/or Mamba components).

The FULL-only tree keeps its own tight loops in :mod:`asynccache.tree.tree`; a tree with
auxiliary components routes these four operations here for a device-only tree, where every
node holds FULL device KV and nothing is in flight. With a host tier, match and evict run in
:mod:`asynccache.tree.hybrid_host` and the insert here is wrapped by it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from asynccache.errors import InvalidInputError, LockError
from asynccache.tree.components.base import CompData, Component
from asynccache.tree.config import _check_count, as_slots
from asynccache.tree.events import Medium
from asynccache.tree.keys import RadixKey
from asynccache.tree.node import DLEAF, Node, frozen
from asynccache.tree.results import EMPTY_SLOTS, EvictResult, InsertResult, MatchResult

if TYPE_CHECKING:
    from asynccache.tree.base import TreeBase


_INF = 1 << 62


def _ceil_page(pos: int, page_size: int) -> int:
    return -(-pos // page_size) * page_size


def refresh_aux(tree: TreeBase, n: Node) -> None:
    """Recount ``n``'s component values and fix their LRU queue membership."""
    if n.parent is None:
        return
    aux = n.aux
    assert aux is not None
    locked_below = False
    for c in reversed(tree._aux):  # lowest priority first
        c.refresh(n, locked_below)
        if aux[c.index].lock_ref:
            locked_below = True


def touch_aux(tree: TreeBase, node: Node) -> None:
    """Refresh each component's LRU for a match or insert ending at ``node`` (stamps only; the
    queues re-file lazily)."""
    for c in tree._aux:
        nodes = c.touched(node)
        if not nodes:
            continue
        base = tree._clock
        k = len(nodes)
        idx = c.index
        for i, n in enumerate(nodes):  # deepest first: ancestors end up slightly older
            aux = n.aux
            assert aux is not None
            aux[idx].stamp = base + k - i
        tree._clock = base + k


def new_aux(tree: TreeBase) -> list[CompData]:
    return [CompData() for _ in tree._aux]


# ---------------------------------------------------------------------------- match
def match(tree: TreeBase, key: RadixKey, cow_mamba: bool) -> MatchResult:
    """The validators are evaluated inline (a method call per node and component costs a
    third of a match): SWA accepts a node when the path has no SWA tombstone or the SWA-live
    tokens since the last one reach the window; Mamba accepts a node holding a state."""
    data = key.data
    pb = tree._pb
    end = len(data) - len(data) % pb
    ns = key.namespace
    swa = tree._swa
    mamba = tree._mamba
    si = swa.index if swa is not None else -1
    mi = mamba.index if mamba is not None else -1
    window = swa.window if swa is not None else 0
    live = _INF  # SWA-live tokens since the last SWA tombstone
    swa_bound = mamba_bound = 0  # deepest boundary (bytes) each component accepts
    root = tree._root
    node = root
    best = root
    best_count = 0
    off = 0
    path: list[Node] = []
    children = root.children
    while off < end:
        child = children.get(tree._child_key(node, data[off : off + pb], ns))
        if child is None:
            break
        nb = tree._match_bytes(child.key, data, off, end)
        if nb < len(child.key):
            child = tree._split(child, nb)
        path.append(child)
        off += nb
        aux = child.aux
        assert aux is not None
        ok = True
        if si >= 0:
            if aux[si].value is None:
                live = 0
                ok = False
            else:
                live += nb >> 2
                if live >= window:
                    swa_bound = off
                else:
                    ok = False
        if mi >= 0:
            if aux[mi].value is None:
                ok = False
            else:
                mamba_bound = off
        if ok:
            best = child
            best_count = len(path)
        node = child
        children = child.children
    if path:
        base = tree._clock
        for i, n in enumerate(path):
            n.last_access = base + i + 1
        tree._clock = base + len(path)
        if tree._touch_requeues:
            for n in path:
                if n.qe[DLEAF] is not None:
                    tree._requeue(n)
    touch_aux(tree, best)
    indices: np.ndarray | None
    if best_count == 0:
        indices = EMPTY_SLOTS
    elif best_count == 1:
        indices = path[0].value
        assert indices is not None
    else:
        indices = np.concatenate([n.value for n in path[:best_count]])
    full_hit = off >> 2
    res = MatchResult(
        device_indices=indices,
        device_prefix_len=len(indices),
        last_device_node=best.id,
        best_node=best.id,
        host_hit_length=0,
        full_kv_hit_length=full_hit,
    )
    if swa is not None and full_hit > swa_bound >> 2:
        res.swa_branching_seqlen = full_hit
    if mamba is not None:
        grid = tree._mamba_interval
        b = full_hit // grid * grid
        if b > mamba_bound >> 2:
            res.mamba_branching_seqlen = b
        if cow_mamba and best is not root:
            state = mamba.data(best).value
            assert state is not None
            res.mamba_cow_slot = int(state[0])
    return res


# ---------------------------------------------------------------------------- insert
def _slot(value: Any, what: str) -> int:
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
    swa_value: Any,
    component_evicted_seqlens: Mapping[str, int] | None,
    mamba_value: Any,
) -> tuple[np.ndarray | None, int, int | None]:
    """Validate the component arguments of an insert; returns (SWA slots, SWA floor, state)."""
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
    swa_slots = None
    if swa_value is not None:
        if "swa" not in names:
            raise InvalidInputError("swa_value given but the tree has no SWA component")
        swa_slots = as_slots(swa_value, "swa_value")
        if len(swa_slots) != total:
            raise InvalidInputError(
                f"swa_value has {len(swa_slots)} slots but the key has {total} tokens"
            )
    elif "swa" in names:
        cached = total - total % tree.page_size
        if floor < cached:
            raise InvalidInputError(
                f"swa_value is required: SWA slots from position {floor} to {cached} are cached"
            )
    state = None
    if mamba_value is not None:
        if "mamba" not in names:
            raise InvalidInputError("mamba_value given but the tree has no Mamba component")
        state = _slot(mamba_value, "mamba_value")
    return swa_slots, floor, state


def insert(
    tree: TreeBase,
    key: RadixKey,
    slots: np.ndarray,
    prev_prefix_len: int,
    inserted_len: int,
    priority: int,
    swa_slots: np.ndarray | None,
    floor: int,
    state: int | None,
) -> InsertResult:
    data = key.data
    pb = tree._pb
    ps = tree.page_size
    end = len(data) - len(data) % pb
    n_tok = end >> 2
    ns = key.namespace
    swa = tree._swa
    mamba = tree._mamba
    floor_a = _ceil_page(floor, ps)
    si = swa.index if swa is not None else -1
    recover_from = max(floor_a, n_tok - swa.window_span) if swa is not None else n_tok
    res = InsertResult(prefix_len=0, cached_len=n_tok, last_node=0)
    frees = res.device_frees
    swa_frees: list[np.ndarray] = []
    mamba_frees: list[np.ndarray] = []
    if swa is not None:
        res.component_frees["swa"] = swa_frees
    if mamba is not None:
        res.component_frees["mamba"] = mamba_frees
    node = tree._root
    off = 0
    while off < end:
        child = node.children.get(tree._child_key(node, data[off : off + pb], ns))
        if child is None:
            break
        nb = tree._match_bytes(child.key, data, off, end)
        if nb < len(child.key):
            child = tree._split(child, nb)
        pos = off >> 2
        hi = pos + (nb >> 2)
        child.last_access = tree._tick()
        requeue = tree._touch_requeues
        if priority > child.priority:
            child.priority = int(priority)
            requeue = requeue or tree._prio_requeues
        if hi > inserted_len:
            child.hit_count += 1
            requeue = requeue or tree._hit_requeues
        lo = max(pos, prev_prefix_len)
        if hi > lo:
            dup = slots[lo:hi]
            own = child.value
            assert own is not None
            own = own[lo - pos :]
            if dup[0] != own[0] or not np.array_equal(dup, own):
                frees.append(dup)
            if swa_slots is not None:
                aux = child.aux
                assert aux is not None and swa is not None
                live = aux[si].value
                if live is None:
                    _swa_overlap(tree, swa, child, pos, lo, hi, floor, recover_from, swa_slots,
                                 swa_frees, res.swa_adopted)
                else:  # the common case, inline: the caller's SWA slots here are duplicates
                    s_lo = lo if lo > floor else floor
                    if s_lo < hi:
                        mine = swa_slots[s_lo:hi]
                        theirs = live[s_lo - pos :]
                        if mine[0] != theirs[0] or not np.array_equal(mine, theirs):
                            swa_frees.append(mine)
        if requeue and child.qe[DLEAF] is not None:
            tree._requeue(child)
        node = child
        off += nb
    res.prefix_len = off >> 2
    if off < end:
        node = _commit_tail(tree, node, key, slots, off >> 2, n_tok, priority, swa_slots,
                            floor, floor_a, swa_frees)
    if mamba is not None and node.parent is not None:
        d = mamba.data(node)
        if d.value is not None:
            res.mamba_exist = True
            if state is not None and int(d.value[0]) != state:
                mamba_frees.append(np.array([state], dtype=np.int64))
        elif state is not None:
            one = np.array([state], dtype=np.int64)
            one.flags.writeable = False
            d.value = one
            refresh_aux(tree, node)
    touch_aux(tree, node)
    res.last_node = node.id
    return res


def _swa_overlap(
    tree: TreeBase,
    swa: Component,
    child: Node,
    pos: int,
    lo: int,
    hi: int,
    floor: int,
    recover_from: int,
    swa_slots: np.ndarray,
    swa_frees: list[np.ndarray],
    adopted: list[tuple[np.ndarray, np.ndarray]],
) -> None:
    """The caller's SWA slots over an already cached span ``[lo, hi)`` of ``child``: duplicates
    are freed; an in-window SWA tombstone is recovered from them instead."""
    d = swa.data(child)
    s_lo = max(lo, floor)  # below the floor the caller has no SWA slots any more
    if d.value is None:
        r = _ceil_page(max(lo, recover_from), tree.page_size)
        if r < hi:
            if s_lo < r:
                swa_frees.append(swa_slots[s_lo:r])
            if r > pos:
                tree._split(child, (r - pos) * 4)  # child keeps the recovered suffix
            d.value = frozen(swa_slots[r:hi])
            assert child.value is not None
            adopted.append((child.value, d.value))
            refresh_aux(tree, child)
        elif s_lo < hi:
            swa_frees.append(swa_slots[s_lo:hi])
    elif s_lo < hi:
        mine = swa_slots[s_lo:hi]
        own = d.value[s_lo - pos :]
        if mine[0] != own[0] or not np.array_equal(mine, own):
            swa_frees.append(mine)


def _commit_tail(
    tree: TreeBase,
    parent: Node,
    key: RadixKey,
    slots: np.ndarray,
    start: int,
    n_tok: int,
    priority: int,
    swa_slots: np.ndarray | None,
    floor: int,
    floor_a: int,
    swa_frees: list[np.ndarray],
) -> Node:
    """Create the leaf chain for ``[start, n_tok)``: an SWA tombstone part below the floor, and
    the live part cap-split so that the leaf holds exactly one page-aligned window."""
    swa = tree._swa
    cuts = [start]
    if swa is not None:
        assert swa_slots is not None or floor_a >= n_tok
        live_from = max(start, floor_a)
        if start < live_from < n_tok:
            cuts.append(live_from)
        cap = n_tok - swa.window_span
        if cap > live_from:
            cuts.append(cap)
        s_lo = max(start, floor)
        s_hi = min(floor_a, n_tok)
        if swa_slots is not None and s_lo < s_hi:
            swa_frees.append(swa_slots[s_lo:s_hi])  # a partly freed page is not kept
    cuts.append(n_tok)
    data = key.data
    pb = tree._pb
    ns = key.namespace
    node = parent
    full = frozen(slots[start:n_tok])  # one copy; the segments are read-only views of it
    live = None
    if swa is not None and swa_slots is not None and floor_a < n_tok:
        live = frozen(swa_slots[start:n_tok])
    swa_i = swa.index if swa is not None else -1
    n_aux = len(tree._aux)
    tick = tree._clock
    created = []
    for a, b in itertools.pairwise(cuts):
        leaf = Node(next(tree._ids), node, data[a * 4 : b * 4], ns)
        tree._nodes[leaf.id] = leaf
        leaf.value = full[a - start : b - start]
        tick += 1
        leaf.creation = leaf.last_access = tick
        leaf.hit_count = 1
        leaf.priority = priority
        aux = [CompData(), CompData()] if n_aux == 2 else [CompData()]
        if live is not None and a >= floor_a:
            assert swa is not None
            d = aux[swa_i]
            d.value = live[a - start : b - start]
            d.acct = 1  # counted (and queued) as evictable just below
            swa.evictable += b - a
        leaf.aux = aux
        node.children[tree._child_key(node, data[a * 4 : a * 4 + pb], ns)] = leaf
        node.dchildren += 1
        created.append(leaf)
        node = leaf
    tree._clock = tick
    tree._refresh(parent)
    for leaf in created:
        if tree._eager_hashes:
            tree._digests(leaf)
        tree._emit_stored(leaf, Medium.GPU)
        tree._refresh(leaf)
        if swa is not None and swa.data(leaf).acct:
            swa.queue.push(leaf)
    return node


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
        if c.priority <= trigger.priority and c.data(n).value is not None:
            _free_aux(c, n, res)
    refresh_aux(tree, n)


def _delete_leaf(tree: TreeBase, n: Node, res: EvictResult) -> None:
    """Delete the unlocked leaf ``n`` with all its components, then every ancestor that became
    an unlocked leaf and is a tombstone of some component (it can never end a match)."""
    root = tree._root
    while True:
        parent = n.parent
        assert parent is not None and not n.children and n.lock_ref == 0
        for q in tree._queues:
            q.discard(n)
        value = n.value
        assert value is not None
        tree._emit_removed(n, Medium.GPU)
        res.device_frees.append(value)
        res.num_evicted += len(value)
        n.value = None
        tree._account(n)
        for c in tree._aux:
            if c.data(n).value is not None:
                _free_aux(c, n, res)
            c.refresh(n, False)
        tree._detach(n)
        if n.anchors:
            tree._move_anchors(n, parent)
        del tree._nodes[n.id]
        parent.dchildren -= 1
        paux = parent.aux
        assert paux is not None
        if (
            parent is root
            or parent.children
            or parent.lock_ref
            or parent.pending
            or all(d.value is not None for d in paux)
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
    comp = next((c for c in tree._aux if c.name == name), None)
    if comp is None:
        raise InvalidInputError(
            f"the tree has no component {name!r}; it has {[c.name for c in tree._aux]}"
        )
    parts = [v for n in tree.iter_nodes() if (v := comp.data(n).value) is not None]
    return np.concatenate(parts) if parts else EMPTY_SLOTS
