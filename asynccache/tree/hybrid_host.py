"""The host (L2) tier of hybrid trees: host copies of the SWA and Mamba component values.

A node backed up to host keeps, next to its FULL ``host_value``, a host copy of each component
value it had on device when the backup was taken (its ``HOST`` entry of ``Node.aux``: one host
SWA slot per token, or one host Mamba state slot). A component host copy exists only on a node
with a FULL host copy and goes with it (host eviction, deletion).

* Match (as in the reference's ``match_prefix``): two validator sets walk together.
  Device-or-host validators (a component counts where it has a device *or* a host value) pick
  ``best_node``; device-only validators pick ``last_device_node``. The tokens in between are
  the host hit.
* Load-back: every node from below the last device-valid ancestor down to the anchor that
  lacks a device value its host copy can supply gets it back — FULL KV of host-only nodes,
  SWA of nodes whose SWA is only on host, the anchor's Mamba state. The caller supplies the
  device slots of each part (:func:`load_back_sizes` says how many).
* Demotion frees the device component values with the FULL ones; deletion frees both copies.

FULL-only trees never come here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from asynccache.errors import InvalidInputError
from asynccache.tree.components.base import Component
from asynccache.tree.components.layout import HOST
from asynccache.tree.config import as_slots
from asynccache.tree.events import Medium
from asynccache.tree.hybrid import refresh_aux, set_branching, touch_aux
from asynccache.tree.keys import RadixKey
from asynccache.tree.node import DLEAF, Node, frozen
from asynccache.tree.results import EMPTY_SLOTS, EvictResult, LoadBackTicket, MatchResult

if TYPE_CHECKING:
    from asynccache.tree.base import TreeBase, _PendingOp
    from asynccache.tree.host_tier import HostTier

_INF = 1 << 62


def _is_loading(tree: TreeBase, n: Node) -> bool:
    return bool(n.pending) and tree._pending[n.pending].kind == "load"


# ---------------------------------------------------------------------------- splits
def split_host(tree: TreeBase, x: Node, p: Node, m: int) -> None:
    """``x`` lost its first ``m`` tokens to ``p``: slice the SWA host copy, and let ``p`` join
    every part of ``x``'s in-flight op (the Mamba state stays on the suffix ``x``)."""
    swa = tree._swa
    if swa is not None:
        ax = x.aux
        ap = p.aux
        assert ax is not None and ap is not None
        h = swa.at + HOST
        if ax[h] is not None:
            ap[h] = ax[h][:m]
            ax[h] = ax[h][m:]
    if x.pending:
        parts = tree._pending[x.pending].aux
        if parts is not None:
            for name, ids in parts.items():
                if name != "mamba" and x.id in ids:
                    ids.add(p.id)


# ---------------------------------------------------------------------------- match
def match(tree: HostTier, key: RadixKey, cow_mamba: bool) -> MatchResult:
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
    dlive = hlive = _INF  # SWA-live tokens since the last tombstone: device / device-or-host
    swa_bound = mamba_bound = 0  # deepest boundary (bytes) each component accepts (dev or host)
    root = tree._root
    node = root
    best = last_dev = root
    best_count = dev_count = 0
    blocked = False  # a node above is host only or still loading: no device prefix past it
    pending: list[int] = []
    off = 0
    path: list[Node] = []
    children = root.children
    while off < end:
        child = children.get(tree._child_key(node, data[off : off + pb], ns))
        if child is None:
            break
        child, nb = tree._match_child(child, data, off, end)
        path.append(child)
        off += nb
        ntok = nb >> sh
        if _is_loading(tree, child):
            pending.append(child.pending)
            blocked = True
        elif child.value is None:
            blocked = True
        aux = child.aux
        dev_ok = not blocked
        host_ok = True
        if si >= 0:
            v = aux[si]
            if v is None or blocked:
                dlive = 0
                dev_ok = False
            else:
                dlive += ntok
                dev_ok = dev_ok and dlive >= window
            if v is None and aux[si + HOST] is None:
                hlive = 0
                host_ok = False
            else:
                hlive += ntok
                if hlive >= window:
                    swa_bound = off
                else:
                    host_ok = False
        if mi >= 0:
            v = aux[mi]
            if v is None or blocked:
                dev_ok = False
            if v is None and aux[mi + HOST] is None:
                host_ok = False
            else:
                mamba_bound = off
        if dev_ok:
            last_dev = child
            dev_count = len(path)
        if host_ok:
            best = child
            best_count = len(path)
        node = child
        children = child.children
    tree._touch_path(path if best_count == len(path) else path[:best_count])  # (hybrid.match)
    touch_aux(tree, best)
    indices: np.ndarray
    if dev_count == 0:
        indices = EMPTY_SLOTS
    else:
        vals = []
        for n in path[:dev_count]:
            assert n.value is not None
            vals.append(n.value)
        indices = _concat(vals)
    full_hit = off >> sh
    res = MatchResult(
        device_indices=indices,
        device_prefix_len=len(indices),
        last_device_node=last_dev.id,
        best_node=best.id,
        host_hit_length=sum(n.ntok for n in path[dev_count:best_count]),
        pending_loads=tuple(dict.fromkeys(pending)),
        full_kv_hit_length=full_hit,
    )
    set_branching(tree, res, swa_bound, mamba_bound, last_dev if cow_mamba else None)
    return res


# ---------------------------------------------------------------------------- insert
def prepare_insert(tree: HostTier, key: RadixKey, slots: np.ndarray) -> tuple[int, set[int]]:
    """Before a hybrid insert: give host-only nodes on the key's path the caller's FULL slots
    (their SWA stays a device tombstone, which the insert recovers for the whole node above the
    request's SWA floor: the caller's FULL slots come with their SWA side). Returns the tokens
    the insert may cover (it stops before a node still loading) and the ids of the nodes that
    took the caller's slots. A node the key ends inside is left whole: the insert's walk splits
    it (and gives a host-only prefix the caller's slots) when it gets there, so that the split
    stamps the suffix after the nodes above, as every insert does (docs/tree.md)."""
    data = key.data
    pb = tree._pb
    sh = tree._sh
    end = len(data) - len(data) % pb
    ns = key.namespace
    root = tree._root
    children = root.children
    ck = tree._child_key(root, data[:pb], ns)
    off = 0
    unevicted: set[int] = set()
    while off < end:
        child = children.get(ck)
        if child is None:
            break
        if _is_loading(tree, child):
            return off >> sh, unevicted
        ckey = child.key
        nb = len(ckey)
        if nb > end - off or not data.startswith(ckey, off):  # the key ends inside it
            break
        if child.value is None:
            pos = off >> sh
            tree._unevict(child, slots[pos : pos + (nb >> sh)])
            unevicted.add(child.id)
            refresh_aux(tree, child)
        children = child.children
        off += nb
        ck = data[off : off + pb]
    return len(key), unevicted


def backups_after_insert(
    tree: HostTier, last_node: int, cached_len: int, inserted_len: int, out: list[Any]
) -> None:
    """Write-through: back up every node of the inserted path that reached the threshold and
    ends past ``inserted_len``, with its un-backed ancestors, root first."""
    root = tree._root
    n = tree._nodes[last_node]
    end = cached_len
    due: list[Node] = []
    while n is not root:
        if end > inserted_len and n.hit_count >= tree._threshold:
            due.append(n)
        end -= n.ntok
        assert n.parent is not None
        n = n.parent
    for n in reversed(due):
        tree._backup_chain(n, out)


# ---------------------------------------------------------------------------- backups
def backup_parts(tree: HostTier, n: Node, op: _PendingOp) -> dict[str, np.ndarray]:
    """The component values a backup of ``n`` copies (recorded on ``op``)."""
    out: dict[str, np.ndarray] = {}
    parts: dict[str, set[int]] = {}
    for c in tree._aux:
        v = c.value(n)
        if v is not None:
            out[c.name] = v
            parts[c.name] = {n.id}
    op.aux = parts
    refresh_aux(tree, n)  # pending: out of the component LRUs
    return out


def check_backup_slots(
    op: _PendingOp, component_host_slots: Mapping[str, Any] | None
) -> dict[str, np.ndarray]:
    """Validate the host slots a backup commit brings for the components (nothing changes)."""
    parts = op.aux or {}
    given = dict(component_host_slots or {})
    if set(given) != set(parts):
        raise InvalidInputError(
            f"backup needs host slots for components {sorted(parts)}, got {sorted(given)}"
        )
    out = {}
    for name, ids in parts.items():
        slots = as_slots(given[name], f"component_host_slots[{name!r}]")
        need = 1 if name == "mamba" else sum(f.ntok for f in op.fragments if f.id in ids)
        if len(slots) != need:
            raise InvalidInputError(f"backup needs {need} {name} host slots, got {len(slots)}")
        out[name] = frozen(slots)
    return out


def attach_backup(tree: HostTier, op: _PendingOp, stored: dict[str, np.ndarray]) -> None:
    """Record the components' host copies of a committed backup (its fragments are no longer
    pending) and put the fragments back in the component LRUs."""
    for f in op.fragments:
        refresh_aux(tree, f)
    for c in tree._aux:
        slots = stored.get(c.name)
        if slots is None:
            continue
        h = c.at + HOST
        if c.name == "mamba":
            aux = op.fragments[-1].aux  # the state stays on the suffix
            aux[h] = slots
            continue
        ids = (op.aux or {})[c.name]
        pos = 0
        for f in op.fragments:
            if f.id in ids:
                aux = f.aux
                aux[h] = slots[pos : pos + f.ntok]
                pos += f.ntok


# ---------------------------------------------------------------------------- eviction
def _free_device(c: Component, n: Node, res: EvictResult) -> None:
    aux = n.aux
    value = aux[c.at]
    assert value is not None
    aux[c.at] = None
    res.component_frees[c.name].append(value)
    if c.name == "swa":
        res.swa_num_evicted += len(value)
    else:
        res.mamba_num_evicted += 1


def drop_host_parts(n: Node, comps: tuple[Component, ...], out: dict[str, list[np.ndarray]]) -> None:
    """``n`` loses its FULL host copy: its component host copies go too (into ``out``)."""
    aux = n.aux
    for c in comps:
        h = c.at + HOST
        if aux[h] is not None:
            out.setdefault(c.name, []).append(aux[h])
            aux[h] = None


def _strip(tree: HostTier, top: Node, res: EvictResult) -> None:
    """Free every component value (device and host) of ``top``'s subtree before its deletion."""
    stack = [top]
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        for c in tree._aux:
            if c.value(n) is not None:
                _free_device(c, n, res)
            c.refresh(n, False)
        drop_host_parts(n, tree._aux, res.component_host_frees)


def delete_subtree(tree: HostTier, top: Node, res: EvictResult) -> None:
    """Delete the unlocked device leaf ``top`` with its host-only subtree and all component
    values, then every ancestor that became a plain device leaf with a component it can never
    offer again (neither on device nor on host)."""
    root = tree._root
    while True:
        parent = top.parent
        assert parent is not None
        _strip(tree, top, res)
        tree._delete_subtree(top, res)
        paux = parent.aux
        if (
            parent is root
            or parent.children
            or parent.lock_ref
            or parent.pending
            or parent.host_lock_ref
            or parent.host_value is not None
            or all(paux[c.at] is not None or paux[c.at + HOST] is not None for c in tree._aux)
        ):
            return
        tree._queues[DLEAF].discard(parent)
        top = parent


def demote(tree: HostTier, n: Node, res: EvictResult) -> None:
    """The backed-up device leaf ``n`` goes host only: its device component values are freed."""
    for c in tree._aux:
        if c.value(n) is not None:
            _free_device(c, n, res)
    refresh_aux(tree, n)
    tree._demote(n, res)


def evict(tree: HostTier, num_tokens: int, swa_num_tokens: int, mamba_num: int) -> EvictResult:
    res = EvictResult()
    for c in tree._aux:
        res.component_frees[c.name] = []
        res.component_host_frees[c.name] = []
    dq = tree._queues[DLEAF]
    if tree._write_back:  # victims in the reference's order (HostTier._evict_write_back)
        tree._evict_write_back(num_tokens, res, lambda n, r: demote(tree, n, r))
    else:
        while res.num_evicted < num_tokens:
            n = dq.pop()
            if n is None:
                break
            if n.host_value is not None:
                demote(tree, n, res)
            else:
                delete_subtree(tree, n, res)
    for c in tree._aux:
        target = swa_num_tokens if c.name == "swa" else mamba_num
        while (res.swa_num_evicted if c.name == "swa" else res.mamba_num_evicted) < target:
            n = c.queue.pop()
            if n is None:
                break
            if (
                not n.children
                and n.lock_ref == 0
                and n.pending == 0
                and n.host_value is None
                and n.host_lock_ref == 0
            ):
                dq.discard(n)
                delete_subtree(tree, n, res)
            else:  # tombstone c and every lower-priority component (host copies stay)
                for o in tree._aux:
                    if o.priority <= c.priority and o.value(n) is not None:
                        _free_device(o, n, res)
                refresh_aux(tree, n)
    return res


def drop(tree: HostTier, n: Node) -> EvictResult:
    res = EvictResult()
    for c in tree._aux:
        res.component_frees[c.name] = []
        res.component_host_frees[c.name] = []
    delete_subtree(tree, n, res)
    return res


def host_slots_of(tree: TreeBase, name: str) -> np.ndarray:
    comp = tree._component(name)
    parts = [v for n in tree.iter_nodes() if (v := comp.host_value(n)) is not None]
    return np.concatenate(parts) if parts else EMPTY_SLOTS


# ---------------------------------------------------------------------------- load-back
def _load_plan(tree: HostTier, node: Node) -> tuple[list[Node], dict[str, list[Node]]]:
    """The fragments of a load-back anchored at ``node`` (root first) and, per part, the nodes
    whose value of that part is loaded."""
    path: list[Node] = []
    n = node
    while n is not tree._root:
        if _is_loading(tree, n):
            raise InvalidInputError(f"node {n.id} is already being loaded (load {n.pending})")
        path.append(n)
        assert n.parent is not None
        n = n.parent
    path.reverse()
    swa = tree._swa
    mamba = tree._mamba
    window = swa.window if swa is not None else 0
    live = _INF
    ok_upto = 0  # path[:ok_upto] ends at the deepest device-valid node
    for i, n in enumerate(path):
        if n.value is None:
            break
        ok = True
        if swa is not None:
            if swa.value(n) is None:
                live = 0
                ok = False
            else:
                live += n.ntok
                ok = live >= window
        if mamba is not None and mamba.value(n) is None:
            ok = False
        if ok:
            ok_upto = i + 1
    below = path[ok_upto:]
    parts: dict[str, list[Node]] = {"full": [n for n in below if n.value is None]}
    if swa is not None:
        parts["swa"] = [
            n for n in below if swa.value(n) is None and swa.host_value(n) is not None
        ]
    if mamba is not None:
        loadable = (
            node in below and mamba.value(node) is None and mamba.host_value(node) is not None
        )
        parts["mamba"] = [node] if loadable else []
    need = {id(n) for nodes in parts.values() for n in nodes}
    top = next((i for i, n in enumerate(below) if id(n) in need), None)
    if top is None:
        raise InvalidInputError(f"node {node.id} has nothing to load: its path is on device")
    frags = below[top:]
    for f in frags:
        if f.pending:
            raise InvalidInputError(f"node {f.id} is busy with a backup (op {f.pending})")
    return frags, parts


def _units(name: str, nodes: list[Node]) -> int:
    return len(nodes) if name == "mamba" else sum(n.ntok for n in nodes)


def load_back_sizes(tree: HostTier, node: Node) -> dict[str, int]:
    _, parts = _load_plan(tree, node)
    return {name: _units(name, nodes) for name, nodes in parts.items()}


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return EMPTY_SLOTS
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def start_load_back(
    tree: HostTier,
    node: Node,
    device_slots: Any,
    component_slots: Mapping[str, Any] | None,
) -> LoadBackTicket:
    from asynccache.tree.base import _PendingOp

    frags, parts = _load_plan(tree, node)
    given = {"full": device_slots, **dict(component_slots or {})}
    stored: dict[str, np.ndarray] = {}
    for name, nodes in parts.items():
        need = _units(name, nodes)
        if name not in given:
            if need:
                raise InvalidInputError(f"load-back of node {node.id} needs {need} {name} slots")
            continue
        slots = as_slots(given[name], f"{name} device slots")
        if len(slots) != need:
            raise InvalidInputError(
                f"load-back of node {node.id} needs {need} {name} device slots, got {len(slots)}"
            )
        stored[name] = frozen(slots)
    extra = set(given) - set(parts)
    if extra:
        raise InvalidInputError(f"the tree has no component {sorted(extra)} to load")
    op_id = next(tree._op_ids)
    tree._pending[op_id] = _PendingOp(
        "load", list(frags), {name: {n.id for n in nodes} for name, nodes in parts.items()}
    )
    host: dict[str, list[np.ndarray]] = {}
    full = stored.get("full", EMPTY_SLOTS)
    pos = 0
    for f in parts["full"]:
        assert f.host_value is not None
        f.value = full[pos : pos + f.ntok]
        pos += f.ntok
        host.setdefault("full", []).append(f.host_value)
        assert f.parent is not None
        f.parent.dchildren += 1
    pairs: tuple[np.ndarray, np.ndarray] | None = None
    for c in tree._aux:
        nodes = parts[c.name]
        if not nodes:
            continue
        slots = stored[c.name]
        pos = 0
        fulls = []
        for f in nodes:
            aux = f.aux
            assert aux[c.at + HOST] is not None and f.value is not None
            if c.name == "mamba":
                aux[c.at] = slots[pos : pos + 1]
                pos += 1
            else:  # SWA names its FULL slots; the caller pairs them with ``slots``
                aux[c.at] = f.value
                fulls.append(f.value)
            host.setdefault(c.name, []).append(aux[c.at + HOST])
        if c.name == "swa":
            pairs = (_concat(fulls), slots)
    for f in frags:
        f.pending = op_id
    tree._inc(node)
    assert frags[0].parent is not None
    tree._refresh(frags[0].parent)
    for f in frags:
        tree._refresh(f)
        refresh_aux(tree, f)
    if tree._arc is not None:
        for f in parts["full"]:
            tree._arc.admit(f)
    return LoadBackTicket(
        op_id=op_id,
        node_ids=tuple(f.id for f in frags),
        host_slots=_concat(host.get("full", [])),
        device_slots=full,
        component_host_slots={c.name: _concat(host[c.name]) for c in tree._aux if c.name in host},
        component_device_slots={c.name: stored[c.name] for c in tree._aux if parts[c.name]},
        swa_pairs=pairs,
    )


def commit_load_back(tree: HostTier, op: _PendingOp) -> None:
    loaded = (op.aux or {}).get("full", set())
    for f in op.fragments:
        f.pending = 0
        if f.id in loaded:
            tree._emit_stored(f, Medium.GPU)
    tree._dec(op.fragments[-1])
    for f in op.fragments:
        tree._refresh(f)
        refresh_aux(tree, f)
    if tree._write_back:
        tree._note_loaded_dups(op)


def abort_load_back(tree: HostTier, op: _PendingOp) -> list[np.ndarray]:
    """Undo a load: the loaded values go (FULL-loaded nodes back to host only). Returns the
    FULL device slots; the component device slots are the ticket's, the caller's again."""
    parts = op.aux or {}
    for f in op.fragments:
        f.pending = 0
    tree._dec(op.fragments[-1])
    frees: list[np.ndarray] = []
    for f in reversed(op.fragments):
        aux = f.aux
        for c in tree._aux:
            if f.id in parts.get(c.name, ()):
                aux[c.at] = None
        if f.id in parts.get("full", ()):
            assert not f.dchildren and not f.lock_ref and f.value is not None
            # Nothing builds on a loading node (inserts stop before it), so only what the load
            # gave it is there.
            assert all(aux[c.at] is None for c in tree._aux)
            frees.append(tree._drop_device_value(f))
    for f in op.fragments:
        tree._refresh(f)
        refresh_aux(tree, f)
    return frees
