"""The host (L2) tier of the tree: host inserts, backups (D->H), load-backs (H->D), demotion,
subtree deletion and host eviction."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from asynccache.errors import (
    InvalidInputError,
    LockError,
)
from asynccache.tree import host_insert, hybrid, hybrid_host, hybrid_prefetch
from asynccache.tree.base import TreeBase, _PendingOp
from asynccache.tree.config import _check_count, as_slots
from asynccache.tree.events import Medium
from asynccache.tree.hashing import chain_digests, storage_key
from asynccache.tree.keys import RadixKey
from asynccache.tree.node import DLEAF, HDUP, HLEAF, Node, backed, frozen
from asynccache.tree.results import (
    BackupRequest,
    EvictResult,
    HostEvictResult,
    InsertResult,
    LoadBackTicket,
    LockReceipt,
)


class HostTier(TreeBase):
    """Host-tier operations of the tree (mixed into :class:`~asynccache.tree.tree.RadixTree`)."""

    def insert_host(
        self,
        key: RadixKey | Any,
        start: int,
        host_slots: Any,
        *,
        swa_host_slots: Any = None,
        mamba_host_slot: int | None = None,
    ) -> InsertResult:
        """Record host copies (e.g. pages prefetched from storage) of ``key[start:]``.

        ``host_slots`` holds one host slot per token of ``key[start:start + len(host_slots)]``
        (whole pages); the node ending at ``start`` is the *anchor* (the match's ``best_node``
        a prefetch started from). As the reference's host insert (behavior.md 1.16) does:

        * the anchor and every node the span walks are touched (access stamps, top first);
        * slots the tree does not take come back in ``InsertResult.device_frees`` (they are
          *host* slots here): pages it already has on host; under write-back every page it
          already has, on device too (a device node is backed up when it is evicted); under
          the write-through policies a device node without a host copy takes the slots as its
          backup (a refill), unless a node above it, from the anchor on, has no host copy;
        * the rest becomes a host-only node, with no hits and its parent's priority (below the
          root: the highest priority an insert gave). Under the write-through policies it is
          dropped (its slots come back) when its parent is neither the root nor backed up (nor
          being backed up): the host copies stay prefix-closed.

        ``prefix_len``: tokens of the key the tree held (from the root) before the new node;
        ``cached_len``: tokens it holds now (``start + len(host_slots)``, or ``prefix_len``
        when the rest was dropped); ``last_node``: the node ending there.

        Hybrid trees (see :mod:`asynccache.tree.hybrid_prefetch`): ``swa_host_slots`` gives one
        SWA host slot per token of the span, -1 where none was fetched (the fetched ones a
        page-aligned suffix); ``mamba_host_slot`` the state after the span. Duplicates come
        back in ``component_frees``.
        """
        self._check_owner()
        if (swa_host_slots is not None and self._swa is None) or (
            mamba_host_slot is not None and self._mamba is None
        ):
            raise InvalidInputError(
                f"component host slots given, but the tree's components are {self.components}"
            )
        key = self.key_of(key)
        slots = as_slots(host_slots, "host_slots")
        start = _check_count("start", start)
        end_tok = start + len(slots)
        if start % self.page_size or len(slots) % self.page_size or end_tok > len(key):
            raise InvalidInputError(
                f"host span [{start}, {end_tok}) must be whole pages within the key of "
                f"{len(key)} tokens (page_size={self.page_size})"
            )
        sh = self._sh
        end = end_tok << sh
        swa = None
        if swa_host_slots is not None:
            swa = as_slots(swa_host_slots, "swa_host_slots")
            live = np.flatnonzero(swa >= 0)
            if len(swa) != len(slots) or (
                len(live) and (live[-1] != len(swa) - 1 or len(live) != len(swa) - live[0]
                               or live[0] % self.page_size)
            ):
                raise InvalidInputError(
                    f"swa_host_slots must give {len(slots)} slots, -1 before a page-aligned "
                    "suffix of fetched ones"
                )
        if mamba_host_slot is not None:
            mamba_host_slot = _check_count("mamba_host_slot", mamba_host_slot)
            if not len(slots):
                raise InvalidInputError("mamba_host_slot needs a non-empty span")
        if self._cached_bytes(key, end) < start << sh:
            raise InvalidInputError(
                f"the tree holds only {self._cached_bytes(key, end) >> sh} tokens of the key; a "
                f"host span starting at {start} would leave a gap"
            )
        if self._aux:
            return hybrid_prefetch.insert_host(self, key, start, slots, swa, mamba_host_slot)
        result = InsertResult(prefix_len=0, cached_len=end_tok, last_node=0)
        node, a, dropped = host_insert.walk(self, key, start, slots, result)
        if a < end_tok and not dropped:
            node = host_insert.new_leaf(self, node, key, a, end_tok, start, slots)
        result.last_node = node.id
        return result

    def keeps_host_inserts_below(self, node_id: int) -> bool:
        """Whether a host insert starting at the end of ``node_id`` (a prefetch anchored
        there) keeps what it adds: always under write-back; under the write-through policies
        only below the root or a node backed up (or being backed up), else :meth:`insert_host`
        drops it (the host copies stay prefix-closed)."""
        n = self._node(node_id)
        return self._write_back or n is self._root or backed(n)

    def _host_insert_hit_count(self) -> int:
        """Hits of a node a host insert makes: none (no request inserted it; the reference's
        host insert counts none either). Under write-back, where no hits are counted and every
        node keeps the one its insert gave it, one, so that it ranks as the others do."""
        return 1 if self._write_back else 0

    def host_slots_of(self, node_id: int) -> np.ndarray | None:
        """The host slots of ``node_id`` (None when it has no host copy); read-only."""
        return self._node(node_id).host_value

    def component_host_slots_of(self, node_id: int, name: str) -> np.ndarray | None:
        """The host copy of component ``name``'s value on ``node_id`` (None: none); read-only."""
        return self._component(name).host_value(self._node(node_id))

    def _cached_bytes(self, key: RadixKey, end: int) -> int:
        """Bytes of ``key.data[:end]`` the tree holds (whole pages), without changing anything."""
        data = key.data
        pb = self._pb
        ns = key.namespace
        node = self._root
        off = 0
        while off < end:
            page = data[off : off + pb]
            child = node.children.get(self._child_key(node, page, ns))
            if child is None:
                break
            nb = self._match_bytes(child.key, data, off, end)
            off += nb
            if nb < len(child.key):
                break
            node = child
        return off

    def node_page_keys(self, node_id: int) -> list[str]:
        """Storage keys of the pages of ``node_id`` itself (not its ancestors)."""
        return [storage_key(d) for d in self._digests(self._node(node_id))]

    def chain_keys(self, node_id: int, key: RadixKey | Any, start: int) -> list[str]:
        """Storage keys of the whole pages of ``key[start:]``, continuing the chain of ``node_id``.

        ``node_id`` must end at token ``start`` of ``key`` (e.g. a match's ``best_node``).
        """
        key = self.key_of(key)
        n = self._node(node_id)
        prev = None if n is self._root else self._digests(n)[-1]
        data = key.data[start << self._sh :]
        data = data[: len(data) - len(data) % self._pb]
        return [storage_key(d) for d in chain_digests(key.namespace, prev, data, self._pb)]

    def tail_slots(self, node_id: int, num_tokens: int) -> np.ndarray | None:
        """Device slots of the last ``num_tokens`` tokens of the path ending at ``node_id``.

        A node keeps its id and its end when a prefix is split off it, so a span recorded as
        (node, length) stays valid across splits: it is gathered from the fragments here. None
        when the node is gone (evicted), is not on device, or the path holds fewer tokens.
        """
        n = self._nodes.get(node_id)
        if n is None or n is self._root:
            return None
        parts: list[np.ndarray] = []
        need = num_tokens
        while need > 0:
            if n is self._root or n.value is None:
                return None
            v = n.value
            parts.append(v if len(v) <= need else v[len(v) - need :])
            need -= len(parts[-1])
            assert n.parent is not None
            n = n.parent
        parts.reverse()
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _unevict(self, n: Node, slots: np.ndarray) -> None:
        """Give a host-only node device slots again (the caller recomputed its KV)."""
        parent = n.parent
        assert parent is not None and n.lock_ref == 0
        n.value = frozen(slots)
        parent.dchildren += 1
        self._emit_stored(n, Medium.GPU)
        self._refresh(parent)
        self._refresh(n)
        if self._write_back:
            self._note_dup(n)
        if self._arc is not None:
            self._arc.admit(n)

    def _host_inc(self, node: Node) -> int:
        delta = 0
        n = node
        while n is not self._root:
            if n.host_lock_ref == 0:
                delta += n.ntok
            n.host_lock_ref += 1
            self._refresh(n)
            assert n.parent is not None
            n = n.parent
        return delta

    def _host_dec(self, node: Node) -> int:
        delta = 0
        n = node
        while n is not self._root:
            if n.host_lock_ref <= 0:
                raise LockError(f"node {n.id} is not host-locked")
            n.host_lock_ref -= 1
            if n.host_lock_ref == 0:
                delta += n.ntok
            self._refresh(n)
            assert n.parent is not None
            n = n.parent
        return delta

    def lock_host(self, node_id: int) -> LockReceipt:
        """Pin the host copies of ``node_id`` and its ancestors against host eviction."""
        self._check_owner()
        node = self._node(node_id)
        token = next(self._receipt_ids)
        delta = self._host_inc(node)
        self._receipts[token] = (node, True)
        return LockReceipt(token=token, node_id=node.id, delta=delta, host=True)

    def unlock_host(self, receipt: LockReceipt) -> int:
        self._check_owner()
        node = self._take_receipt(receipt, host=True)
        return self._host_dec(node)

    def _backup_chain(self, node: Node, out: list[BackupRequest]) -> None:
        chain = []
        n = node
        while n is not self._root and n.host_value is None and n.pending == 0:
            chain.append(n)
            assert n.parent is not None
            n = n.parent
        for c in reversed(chain):
            out.append(self._begin_backup(c, write_back=False))

    def _begin_backup(self, n: Node, *, write_back: bool,
                      after_children: bool = False) -> BackupRequest:
        assert n.value is not None and n.pending == 0
        op_id = next(self._op_ids)
        self._pending[op_id] = _PendingOp("backup", [n])
        n.pending = op_id
        self._inc(n)
        self._refresh(n)
        if self._aux:
            parts = hybrid_host.backup_parts(self, n, self._pending[op_id])
            return BackupRequest(op_id=op_id, node_id=n.id, device_slots=n.value,
                                 write_back=write_back, component_slots=parts,
                                 after_children=after_children)
        return BackupRequest(op_id=op_id, node_id=n.id, device_slots=n.value, write_back=write_back,
                             after_children=after_children)

    def _pop_op(self, op_id: int, kind: str) -> _PendingOp:
        op = self._pending.get(op_id)
        if op is None or op.kind != kind:
            raise InvalidInputError(f"no {kind} in flight with id {op_id!r}")
        del self._pending[op_id]
        return op

    def commit_backup(
        self, op_id: int, host_slots: Any, component_host_slots: Mapping[str, Any] | None = None
    ) -> list[int]:
        """The D->H copy of backup ``op_id`` landed in ``host_slots``: record the host copy.

        Returns the ids of the nodes now backed up: the original node and any prefix fragments
        split off it while the copy was in flight, root first. Hybrid trees: the request's
        ``component_slots`` landed in ``component_host_slots`` (same keys and lengths).
        """
        self._check_owner()
        op = self._pending.get(op_id)
        if op is None or op.kind != "backup":
            raise InvalidInputError(f"no backup in flight with id {op_id!r}")
        slots = as_slots(host_slots, "host_slots")
        need = sum(f.ntok for f in op.fragments)
        if len(slots) != need:
            raise InvalidInputError(f"backup {op_id} needs {need} host slots, got {len(slots)}")
        aux_stored = None
        if op.aux is not None:
            aux_stored = hybrid_host.check_backup_slots(op, component_host_slots)
        elif component_host_slots:
            raise InvalidInputError("component_host_slots given for a FULL-only backup")
        del self._pending[op_id]
        stored = frozen(slots)
        pos = 0
        for f in op.fragments:
            k = f.ntok
            f.host_value = stored[pos : pos + k]
            pos += k
            f.pending = 0
            self._host_size += k
            self._emit_stored(f, Medium.CPU_PINNED)
        if aux_stored is not None:
            hybrid_host.attach_backup(self, op, aux_stored)
        self._dec(op.fragments[-1])
        for f in op.fragments:
            self._refresh(f)
        if self._write_back:  # (the reference registers them at the copy's ack, root first)
            for f in op.fragments:
                self._note_dup(f)
        return [f.id for f in op.fragments]

    def abort_backup(self, op_id: int) -> None:
        """The copy for ``op_id`` failed or was dropped: unpin the node, keep it un-backed."""
        self._check_owner()
        op = self._pop_op(op_id, "backup")
        for f in op.fragments:
            f.pending = 0
        self._dec(op.fragments[-1])
        for f in op.fragments:
            self._refresh(f)
        if op.aux is not None:
            for f in op.fragments:
                hybrid.refresh_aux(self, f)

    def host_chain(self, node_id: int) -> list[int]:
        """Ids of the host-only nodes from below the last device ancestor down to ``node_id``."""
        n = self._node(node_id)
        chain = []
        while n is not self._root and n.value is None:
            chain.append(n.id)
            assert n.parent is not None
            n = n.parent
        return chain[::-1]

    def load_back_sizes(self, node_id: int) -> dict[str, int]:
        """Device slots a load-back anchored at ``node_id`` needs, per part: ``"full"`` tokens
        and, in hybrid trees, ``"swa"`` tokens and ``"mamba"`` states."""
        node = self._node(node_id)
        if self._aux:
            return hybrid_host.load_back_sizes(self, node)
        need = 0
        while node is not self._root and node.value is None:
            need += node.ntok
            assert node.parent is not None
            node = node.parent
        return {"full": need}

    def start_load_back(
        self, node_id: int, device_slots: Any, component_slots: Mapping[str, Any] | None = None
    ) -> LoadBackTicket:
        """Give the host-only path ending at ``node_id`` the device slots ``device_slots``.

        The nodes count as on device at once (marked pending and pinned); copy the ticket's
        ``host_slots`` to its ``device_slots``, then ``commit_load_back``.

        Hybrid trees load what makes ``node_id`` device-valid: FULL KV of the host-only
        nodes, SWA of the nodes below the last device-valid ancestor whose SWA is only on host,
        and the anchor's Mamba state; ``component_slots`` gives the device slots of each
        component (sizes from :meth:`load_back_sizes`).
        """
        self._check_owner()
        node = self._node(node_id)
        if self._aux:
            return hybrid_host.start_load_back(self, node, device_slots, component_slots)
        if component_slots:
            raise InvalidInputError("component_slots given to a FULL-only tree")
        chain: list[Node] = []
        n = node
        while n is not self._root and n.value is None:
            if n.pending:
                raise InvalidInputError(f"node {n.id} is already being loaded")
            chain.append(n)
            assert n.parent is not None
            n = n.parent
        if not chain:
            raise InvalidInputError(f"node {node_id} has nothing to load: it is on device")
        if n.pending and self._pending[n.pending].kind == "load":
            raise InvalidInputError(
                f"node {n.id} is already being loaded (load {n.pending}, above node {node_id})"
            )
        chain.reverse()
        slots = as_slots(device_slots, "device_slots")
        need = sum(c.ntok for c in chain)
        if len(slots) != need:
            raise InvalidInputError(f"load-back of node {node_id} needs {need} device slots, got {len(slots)}")
        stored = frozen(slots)
        op_id = next(self._op_ids)
        self._pending[op_id] = _PendingOp("load", chain)
        host_parts = []
        pos = 0
        for c in chain:
            assert c.host_value is not None
            k = c.ntok
            c.value = stored[pos : pos + k]
            pos += k
            c.pending = op_id
            host_parts.append(c.host_value)
            assert c.parent is not None
            c.parent.dchildren += 1
        self._inc(node)
        self._refresh(n)
        for c in chain:
            self._refresh(c)
        if self._arc is not None:
            for c in chain:
                self._arc.admit(c)
        return LoadBackTicket(
            op_id=op_id,
            node_ids=tuple(c.id for c in chain),
            host_slots=np.concatenate(host_parts) if len(host_parts) > 1 else host_parts[0],
            device_slots=stored,
        )

    def commit_load_back(self, op_id: int) -> None:
        """The H->D copy of ``op_id`` completed: the KV may be read; release its pins."""
        self._check_owner()
        op = self._pop_op(op_id, "load")
        if op.aux is not None:
            hybrid_host.commit_load_back(self, op)
            return
        for f in op.fragments:
            f.pending = 0
            self._emit_stored(f, Medium.GPU)
        self._dec(op.fragments[-1])
        for f in op.fragments:
            self._refresh(f)
        if self._write_back:
            self._note_loaded_dups(op)

    def _note_loaded_dups(self, op: _PendingOp) -> None:
        """A committed load-back's nodes are duplicates now; the reference registers them
        when the load's ack walks from the anchor up to the root: deepest first."""
        for f in reversed(op.fragments):
            self._note_dup(f)

    def abort_load_back(self, op_id: int) -> list[np.ndarray]:
        """The H->D copy of ``op_id`` failed: the nodes go back to host only.

        Returns the device slots to free. Nothing can have built on the nodes meanwhile: while
        a load is in flight, matches report its nodes as host hits, inserts stop before them and
        locks on them are refused, so every fragment goes back to host only.
        """
        self._check_owner()
        op = self._pop_op(op_id, "load")
        if op.aux is not None:
            return hybrid_host.abort_load_back(self, op)
        for f in op.fragments:
            f.pending = 0
        self._dec(op.fragments[-1])
        frees: list[np.ndarray] = []
        for f in reversed(op.fragments):
            assert not f.dchildren and not f.lock_ref and f.value is not None
            frees.append(self._drop_device_value(f))
        for f in op.fragments:
            self._refresh(f)
        return frees

    def _drop_device_value(self, n: Node) -> np.ndarray:
        value = n.value
        assert value is not None and n.lock_ref == 0
        n.value = None
        self._account(n)
        parent = n.parent
        assert parent is not None
        parent.dchildren -= 1
        self._refresh(parent)
        return value

    def drop(self, node_id: int) -> EvictResult:
        """Delete an unlocked device leaf and its host-only subtree without a backup.

        Used when a write-back copy cannot get host memory. A node that is locked, in flight,
        has device children or pins host-locked descendants is kept (empty result).
        """
        self._check_owner()
        n = self._node(node_id)
        res = EvictResult()
        if (
            n is self._root
            or n.value is None
            or n.lock_ref
            or n.pending
            or n.dchildren
            or n.host_lock_ref
        ):
            return res
        if self._aux:
            return hybrid_host.drop(self, n)
        self._delete_subtree(n, res)
        return res

    def _demote(self, n: Node, res: EvictResult) -> None:
        res.device_frees.append(self._drop_device_value(n))
        res.num_evicted += n.ntok
        self._emit_removed(n, Medium.GPU)
        self._refresh(n)

    def _evict_write_back(
        self, num_tokens: int, res: EvictResult, demote: Callable[[Node, EvictResult], None]
    ) -> EvictResult:
        """Write-back eviction, in the reference's victim order without waiting for copies.

        The reference backs a victim up, demotes it and then lets its parent, now a device
        leaf, compete with the other leaves. Here the copies run after this call, so a victim
        waiting for its copy is counted (``pending_tokens``) and its parent becomes a
        candidate as soon as every device child of it waits in this call: the parent is queued
        by its own key (a parent with a host copy is only counted: it is demoted by a later
        call, after its children). The parent's backup (``after_children``) does not drop it
        if it fails: it stays on device. ``demote`` demotes a backed-up leaf (FULL-only or
        hybrid: a hybrid victim's device component values go with its FULL KV).

        Hybrid trees take the same victims: the reference's FULL walk ranks device leaves by
        FULL alone (a node whose children hold no FULL KV on device is a leaf whatever its SWA
        or Mamba data), and a component lock always comes with a FULL lock on the same node.
        The component data of a victim is copied with it (``BackupRequest.component_slots``)."""
        dq = self._queues[DLEAF]
        root = self._root
        self._pay_owed(res, demote)
        locks: dict[int, int] = {}  # node id -> locks this call's backups put on it
        waiting: set[int] = set()  # victims whose demotion waits for a copy (this call's)
        offered: set[int] = set()  # parents queued as candidates by this call

        def offer(p: Node | None) -> None:
            """Queue ``p`` once every device child of it waits in this call."""
            assert p is not None
            if p is root or p.value is None or p.pending or p.id in offered:
                return
            if p.lock_ref != locks.get(p.id, 0):  # pinned by something else
                return
            kids = p.children.values()
            if any(c.id in waiting for c in kids) and all(
                    c.value is None or c.id in waiting for c in kids):
                offered.add(p.id)
                dq.push(p)

        while res.num_evicted + res.pending_tokens < num_tokens:
            n = dq.pop()
            if n is None:
                break
            if n.id not in offered and n.host_value is not None:
                demote(n, res)  # (a parent left with waiting children only: offered)
            else:
                if n.host_value is None:
                    res.backups.append(self._begin_backup(
                        n, write_back=True, after_children=n.id in offered))
                    self._count_locks(n, locks)
                # (an offered parent with a host copy is demoted by a later call)
                waiting.add(n.id)
                self._owed.append(n.id)
                res.pending_tokens += n.ntok
            offer(n.parent)
        for node_id in offered:  # still queued: not a leaf until its children are demoted
            node = self._nodes.get(node_id)
            if node is not None:
                dq.discard(node)
        return res

    def _pay_owed(self, res: EvictResult, demote: Callable[[Node, EvictResult], None]) -> None:
        """Demote, first and in the order they were taken, the victims earlier calls counted
        while they waited for their copies (the reference demotes each right after its copy,
        before it takes the next victim: a leaf one of them exposed must not go before them).
        One still copying stays owed; one that is gone, not backed up (its copy failed),
        pinned again or no longer a device leaf is let go (the policy decides on it)."""
        owed, self._owed = self._owed, []
        dq = self._queues[DLEAF]
        for node_id in owed:
            n = self._nodes.get(node_id)
            if n is None or n.value is None:
                continue
            if n.pending:
                self._owed.append(node_id)
            elif n.host_value is not None and n.lock_ref == 0 and n.dchildren == 0:
                dq.discard(n)
                demote(n, res)

    def _count_locks(self, n: Node, locks: dict[int, int]) -> None:
        """Count the lock a backup of ``n`` put on it and each ancestor (as ``_inc`` does)."""
        root = self._root
        while n is not root:
            locks[n.id] = locks.get(n.id, 0) + 1
            assert n.parent is not None
            n = n.parent

    def _delete_subtree(self, top: Node, res: EvictResult) -> None:
        """Delete ``top`` (a device leaf) and its host-only descendants."""
        parent = top.parent
        assert parent is not None
        top_on_device = top.value is not None
        stack = [top]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for q in self._queues:
                q.discard(n)
            if n.value is not None:
                self._emit_removed(n, Medium.GPU)
                res.device_frees.append(n.value)
                res.num_evicted += n.ntok
                n.value = None
                self._account(n)
            if n.host_value is not None:
                self._emit_removed(n, Medium.CPU_PINNED)
                res.host_frees.append(n.host_value)
                self._host_size -= n.ntok
                if n is not top:
                    res.dropped_host_tokens += n.ntok
            if n.anchors:
                self._move_anchors(n, parent)
            del self._nodes[n.id]
            self._dup_forget(n.id)
        self._detach(top)
        if top_on_device:
            parent.dchildren -= 1
        self._refresh(parent)

    def evict_host(
        self, num_tokens: int, *, reclaim_duplicates: bool | None = None
    ) -> HostEvictResult:
        """Free at least ``num_tokens`` host tokens.

        Host-only leaves go, in eviction-policy order. Host copies of nodes still on device
        (duplicates) are reclaimed only under write-back, and first there, in the reference
        system's order (SGLang's HiCache; see :meth:`_reclaim_write_back_dups`): under
        write-through a device node without a host copy is deleted at eviction with its
        host-only subtree, so taking a parent's copy would lose its host-only children.
        ``reclaim_duplicates``: None follows the write policy; False never touches duplicates;
        True reclaims them under write-through too, in policy order after the host leaves, but
        only those none of whose children holds a host copy, so the host copies stay
        prefix-closed (a parent's goes after its children's, within the same call if needed).
        True under write-through is a deliberate difference from the reference
        (docs/differences.md).
        """
        self._check_owner()
        num_tokens = _check_count("num_tokens", num_tokens)
        res = HostEvictResult()
        use_dups = self._write_back if reclaim_duplicates is None else bool(reclaim_duplicates)
        if self._write_back:
            if use_dups:
                self._reclaim_write_back_dups(num_tokens, res)
            order: tuple[int, ...] = (HLEAF,)
        else:
            order = (HLEAF, HDUP) if use_dups else (HLEAF,)
        for slot in order:
            q = self._queues[slot]
            held: dict[int, Node] = {}  # duplicates skipped for a host-copied child
            while res.num_evicted < num_tokens:
                n = q.pop()
                if n is None:
                    break
                if slot == HDUP and any(c.host_value is not None for c in n.children.values()):
                    held[n.id] = n
                    continue
                self._free_host_copy(n, res)
                parent = n.parent
                assert parent is not None
                if slot == HLEAF:
                    for other in self._queues:
                        other.discard(n)
                    self._detach(n)
                    if n.anchors:
                        self._move_anchors(n, parent)
                    del self._nodes[n.id]
                    self._dup_forget(n.id)
                    self._refresh(parent)
                else:
                    self._refresh(n)
                    if held.pop(parent.id, None) is not None:
                        self._refresh(parent)  # may be its last host-copied child
            for n in held.values():
                self._refresh(n)
        return res

    def _free_host_copy(self, n: Node, res: HostEvictResult) -> None:
        """Give back ``n``'s host copy (and, in hybrid trees, its components' host copies)."""
        host = n.host_value
        assert host is not None
        self._emit_removed(n, Medium.CPU_PINNED)
        res.host_frees.append(host)
        res.num_evicted += n.ntok
        self._host_size -= n.ntok
        n.host_value = None
        if self._aux:
            hybrid_host.drop_host_parts(n, self._aux, res.component_host_frees)

    def _reclaim_write_back_dups(self, num_tokens: int, res: HostEvictResult) -> None:
        """Reclaim host duplicates as SGLang 0.5.23 does under write-back: in the order they
        became duplicates (``_dup_order``, see :meth:`_note_dup`), in two passes. The first
        spares the evictable device leaves (a device eviction would demote them next and need
        their host copy); the second takes them too. A host-pinned copy or a node with a copy in
        flight is skipped; an entry whose node is no longer a duplicate is dropped when a pass
        reaches it. The walk stops as soon as ``num_tokens`` are free, so entries beyond that
        point stay as they are. Neither the eviction policy nor the host copies of the
        children matter here (write-back keeps no prefix closure of host copies)."""
        # First pass: the entries that are not evictable device leaves, in order (the heap
        # holds every one of them, so the pass never walks the leaves it spares).
        heap, queued, place, order = (self._dup_heap, self._dup_queued, self._dup_place,
                                      self._dup_order)
        kept: list[Node] = []
        while heap and res.num_evicted < num_tokens:
            at, node_id = heapq.heappop(heap)
            if place.get(node_id) != at:
                continue  # stale: its entry was dropped (and maybe made again)
            queued.discard(node_id)
            n = order[node_id]
            if n.value is None or n.host_value is None:
                self._dup_forget(node_id)
            elif n.pending or n.host_lock_ref:
                kept.append(n)
            elif n.lock_ref or n.dchildren:
                self._free_host_copy(n, res)
                self._dup_forget(node_id)
                self._refresh(n)
            # else: an evictable device leaf by now; queued again when it stops being one
        for n in kept:
            self._dup_watch(n)
        if res.num_evicted >= num_tokens:
            return
        # Second pass: every entry, in order.
        gone: list[int] = []
        for n in order.values():
            if res.num_evicted >= num_tokens:
                break
            if n.value is None or n.host_value is None:
                gone.append(n.id)
            elif not (n.pending or n.host_lock_ref):
                self._free_host_copy(n, res)
                gone.append(n.id)
        for node_id in gone:
            n = order[node_id]
            self._dup_forget(node_id)
            self._refresh(n)
