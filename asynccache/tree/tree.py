"""The synchronous radix tree: the part of the cache that decides.

No I/O, no asyncio, no CUDA. The tree holds slot indices it was given, decides what to keep,
evict, back up or load, and returns the slots it gives up and the copies it wants as values
(see :mod:`asynccache.tree.results`). One thread owns it; a mutating call from another thread
raises :class:`~asynccache.errors.OwnerError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from asynccache.errors import (
    ConfigError,
    InvalidInputError,
    LockError,
)
from asynccache.tree import hybrid, hybrid_host
from asynccache.tree.config import WRITE_POLICIES as WRITE_POLICIES
from asynccache.tree.config import _check_count, as_slots
from asynccache.tree.events import Medium
from asynccache.tree.host_tier import HostTier
from asynccache.tree.keys import DEFAULT_NAMESPACE, BigramKey, RadixKey
from asynccache.tree.node import DLEAF, Node, frozen, joined, state_slot
from asynccache.tree.results import (
    EMPTY_SLOTS,
    EvictResult,
    InsertResult,
    LockReceipt,
    MatchResult,
    SessionRef,
)


class RadixTree(HostTier):
    """A page-granular radix tree of cached KV prefixes over a device tier and a host tier."""

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: RadixKey | Any, *, cow_mamba: bool = False) -> MatchResult:
        """Find the longest cached prefix of ``key`` (whole pages only).

        A match may split a node where the prefix ends inside it and refreshes recency, but
        never frees anything. In a hybrid tree the prefix ends at the deepest node every
        component accepts (see :class:`MatchResult`); ``cow_mamba`` asks for the state slot
        to copy.
        """
        self._check_owner()
        if type(key) is not self._key_type:
            key = self.key_of(key)
        if self._aux:
            if self._host:
                return hybrid_host.match(self, key, cow_mamba)
            return hybrid.match(self, key, cow_mamba)
        data = key.data
        end = len(data) - len(data) % self._pb
        root = self._root
        node = root
        off = 0
        values: list[np.ndarray] = []
        path: list[Node] = []
        sh = self._sh
        last_device = root
        host_len = 0
        pending: list[int] = []
        ns = key.namespace
        pb = self._pb
        children = root.children
        ck = data[:pb] if ns is DEFAULT_NAMESPACE else (ns, data[:pb])  # (_child_key at the root)
        while off < end:
            child = children.get(ck)
            if child is None:
                break
            ckey = child.key
            nb = len(ckey)
            if nb > end - off or not data.startswith(ckey, off):  # else the whole node matches
                child, nb = self._match_child(child, data, off, end)
            if child.pending and self._pending[child.pending].kind == "load":
                # Still copying in: a host hit until the load commits.
                pending.append(child.pending)
                host_len += nb >> sh
            elif child.value is not None and not pending:
                values.append(child.value)
                last_device = child
            else:
                host_len += nb >> sh
            path.append(child)
            node = child
            children = child.children
            off += nb
            ck = data[off : off + pb]
        self._touch_path(path)
        if not values:
            indices = EMPTY_SLOTS
        elif len(values) == 1:
            indices = values[0]
        else:
            indices = joined(values)
        return MatchResult(  # positional: device_indices ... full_kv_hit_length
            indices,
            len(indices),
            last_device.id,
            node.id,
            host_len,
            tuple(dict.fromkeys(pending)) if pending else (),
            off >> sh,
        )

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        key: RadixKey | Any,
        value: Any,
        *,
        prev_prefix_len: int = 0,
        inserted_len: int = 0,
        priority: int = 0,
        component_evicted_seqlens: Mapping[str, int] | None = None,
        mamba_value: Any = None,
    ) -> InsertResult:
        """Cache ``value`` (one device slot per token of ``key``) for the page-aligned part of key.

        ``prev_prefix_len``: the caller's first tokens already are the tree's own slots (from
        its match), so they are never reported as duplicates. ``inserted_len``: tokens this
        request inserted before (only nodes ending past it count a hit). The tree takes
        ownership of the slots it stores; the duplicates it does not need come back in
        ``device_frees``; the unaligned tail stays the caller's.

        Hybrid trees: the SWA KV of each token is the caller's full->SWA translation of its
        FULL slot (the tree names SWA data by FULL slots and stores no SWA slot numbers; a
        duplicate FULL slot given back takes its SWA side along);
        ``component_evicted_seqlens={"swa": k}`` says the caller already freed the SWA side
        of its first ``k`` tokens (those nodes are SWA tombstones from birth);
        ``mamba_value`` is the state slot after the page-aligned key, kept on its last node.
        ``component_frees["swa"]`` gives the caller's FULL slots whose SWA side the tree does
        not take (a partly freed page above the floor, the out-of-window part of a cached SWA
        tombstone), ``component_frees["mamba"]`` a state it does not take.
        """
        self._check_owner()
        if type(key) is self._key_type:
            raw = False
        else:
            raw = self._eagle and type(key) is not BigramKey
            key = self.key_of(key)
        slots = as_slots(value)
        total = len(key.data) >> self._sh
        if raw and len(slots) == total + 1:
            # EAGLE, raw tokens given: N + 1 tokens (and slots) cache N bigram positions; the
            # last slot stays the caller's, as an unaligned tail does.
            slots = slots[:total]
        if len(slots) != total:
            raise InvalidInputError(
                f"value has {len(slots)} slots but the key has {total} tokens"
            )
        # Plain ints pass with one type test each; anything else takes the full checks.
        if type(prev_prefix_len) is not int or prev_prefix_len < 0:
            prev_prefix_len = _check_count("prev_prefix_len", prev_prefix_len)
        if type(inserted_len) is not int or inserted_len < 0:
            inserted_len = _check_count("inserted_len", inserted_len)
        if prev_prefix_len > total:
            raise InvalidInputError(
                f"prev_prefix_len {prev_prefix_len} exceeds the key length {total}"
            )
        if type(priority) is not int:
            if isinstance(priority, bool) or not isinstance(priority, int | np.integer):
                raise InvalidInputError(f"priority must be an int, got {priority!r}")
            priority = int(priority)
        # Every tree without a host tier takes the walk of hybrid.insert (with no components it
        # skips their branches); FULL-only trees with a host tier take the walk below, which
        # also adopts slots for host-only nodes, stops at loads and queues write-through backups.
        clock0 = self._clock
        if not self._host or self._aux or mamba_value is not None or component_evicted_seqlens:
            floor, state = 0, None
            if component_evicted_seqlens or mamba_value is not None:
                floor, state = hybrid.check_insert_args(
                    self, total, component_evicted_seqlens, mamba_value
                )
            self._note_priority(priority)
            if self._host:
                res = self._insert_hybrid_host(
                    key, slots, prev_prefix_len, inserted_len, priority, floor, state
                )
            else:
                res = hybrid.insert(
                    self, key, slots, prev_prefix_len, inserted_len, priority, floor, state
                )
            if self._arc is not None:
                self._arc.after_insert(res.last_node, inserted_len, clock0)
            return res
        data = key.data
        pb = self._pb
        sh = self._sh
        end = len(data) - len(data) % pb
        n_tok = end >> sh
        ns = key.namespace
        root = self._root
        if priority > root.priority:
            root.priority = priority  # (_note_priority, inlined)
        node = root
        off = 0
        result = InsertResult(0, n_tok, 0)  # (prefix_len, cached_len, last_node)
        frees = result.device_frees
        children = root.children
        ck = self._child_key(root, data[:pb], ns)
        while off < end:
            child = children.get(ck)
            if child is None:
                break
            if child.pending and self._pending[child.pending].kind == "load":
                # Its KV is still being copied in: the caller keeps its own slots from here on.
                result.cached_len = off >> sh
                break
            ckey = child.key
            nb = len(ckey)
            if nb > end - off or not data.startswith(ckey, off):  # else the whole node matches
                child, nb = self._match_child(child, data, off, end)
            pos = off >> sh
            m = nb >> sh
            child.last_access = self._tick()
            requeue = self._touch_requeues
            if priority > child.priority:
                child.priority = priority
                requeue = requeue or self._prio_requeues
            if child.value is None:
                self._unevict(child, slots[pos : pos + m])
            else:
                lo = max(pos, prev_prefix_len)
                hi = pos + m
                if hi > lo:
                    dup = slots[lo:hi]
                    own = child.value[lo - pos :]
                    # A caller handing back the tree's own slots is not a duplicate.
                    if dup[0] != own[0] or not np.array_equal(dup, own):
                        frees.append(dup)
            if pos + m > inserted_len and self._count_hits:
                child.hit_count += 1
                requeue = requeue or self._hit_requeues
                if self._write_through and child.hit_count >= self._threshold:
                    self._backup_chain(child, result.backups)
                elif self._intents and child.hit_count >= self._threshold:
                    result.intents.append(child.id)
            if requeue and (child.aux[0] or child.aux[1] or child.aux[2]):
                self._requeue(child)
            node = child
            children = child.children
            off += nb
            ck = data[off : off + pb]
        result.prefix_len = off >> sh
        if off < end and result.cached_len == n_tok:
            leaf = self._node_cls(next(self._ids), node, data[off:end], ns, self._aux_empty[:])
            self._nodes[leaf.id] = leaf
            leaf.value = frozen(slots[off >> sh : n_tok])
            leaf.creation = leaf.last_access = self._tick()
            leaf.hit_count = 1
            leaf.priority = priority
            node.children[self._child_key(node, data[off : off + pb], ns)] = leaf
            node.dchildren += 1
            if self._eager_hashes:
                self._digests(leaf)
            self._emit_stored(leaf, Medium.GPU)
            self._refresh(node)
            self._refresh(leaf)
            if self._write_through and self._threshold <= 1:
                self._backup_chain(leaf, result.backups)
            elif self._intents and self._threshold <= 1:
                result.intents.append(leaf.id)
            node = leaf
        result.last_node = node.id
        if self._arc is not None:
            self._arc.after_insert(node.id, inserted_len, clock0)
        return result

    def _insert_hybrid_host(
        self,
        key: RadixKey,
        slots: np.ndarray,
        prev_prefix_len: int,
        inserted_len: int,
        priority: int,
        floor: int,
        state: int | None,
    ) -> InsertResult:
        """A hybrid insert with a host tier: host-only nodes on the path adopt the caller's
        slots first; the insert stops before a node still loading (the caller's state then
        comes back in ``component_frees["mamba"]``); write-through backups follow."""
        limit, unevicted = hybrid_host.prepare_insert(self, key, slots)
        cut = limit < len(key)
        if cut:
            key = key[:limit]
            slots = slots[:limit]
            floor = min(floor, limit)
        res = hybrid.insert(
            self, key, slots, prev_prefix_len, inserted_len, priority, floor,
            None if cut else state, unevicted,
        )
        if state is not None and cut:
            res.component_frees.setdefault("mamba", []).append(state_slot(state))
        if self._write_through:
            hybrid_host.backups_after_insert(
                self, res.last_node, res.cached_len, inserted_len, res.backups
            )
        return res

    def lock(self, node_id: int, *, skip: tuple[str, ...] = ()) -> LockReceipt:
        """Pin ``node_id`` and its ancestors on device; returns the receipt for ``unlock``.

        Hybrid trees also pin one SWA window above the node and the node's Mamba state;
        ``skip`` names components not to lock (e.g. ``("mamba",)`` during decode).
        """
        self._check_owner()
        node = self._node(node_id)
        if node is not self._root and node.value is None:
            raise LockError(f"node {node_id} is not on device (host only); load it back first")
        if node.pending and self._pending[node.pending].kind == "load":
            raise LockError(f"node {node_id} is still being loaded; wait for load {node.pending}")
        if skip:
            names = self._aux_names
            for name in skip:
                if name not in names:
                    raise InvalidInputError(
                        f"cannot skip locking {name!r}: the tree's auxiliary components are "
                        f"{sorted(names)}"
                    )
        token = next(self._receipt_ids)
        delta = self._inc(node)
        self._receipts[token] = (node, False)
        if not self._aux:
            return LockReceipt(token=token, node_id=node.id, delta=delta)
        extents = hybrid.lock(self, node, tuple(skip))
        self._aux_locks[token] = extents
        swa = self._swa
        mamba = self._mamba
        return LockReceipt(
            token=token,
            node_id=node.id,
            delta=delta,
            swa_span=extents[swa.index] if swa is not None else 0,
            mamba_locked=bool(extents[mamba.index]) if mamba is not None else False,
        )

    def unlock(self, receipt: LockReceipt) -> int:
        """Release a device lock; returns the tokens that became evictable."""
        self._check_owner()
        node = self._take_receipt(receipt, host=False)
        if self._aux:
            extents = self._aux_locks.pop(receipt.token)
            self._swa_released.discard(receipt.token)
            hybrid.release(self, node, extents, 1 << 30)
        return self._dec(node)

    def release_swa(self, receipt: LockReceipt) -> None:
        """Release the SWA window (and Mamba) pins of a held lock early, once decode has moved
        past the window; the FULL path lock stays until ``unlock``."""
        self._check_owner()
        if not isinstance(receipt, LockReceipt) or receipt.host:
            raise LockError(f"expected a device LockReceipt, got {receipt!r}")
        held = self._receipts.get(receipt.token)
        if held is None or held[0].id != receipt.node_id:
            raise LockError(f"lock receipt {receipt.token} is not held")
        hybrid.release_swa(self, receipt.token)

    def lock_ref(self, node_id: int) -> tuple[int, int]:
        """(device, host) lock counts of a node."""
        n = self._node(node_id)
        return n.lock_ref, n.host_lock_ref

    # ------------------------------------------------------------------ session references
    def add_session_ref(self, node_id: int) -> SessionRef:
        """Reference ``node_id``'s path for a session: its nodes are evicted after all others."""
        self._check_owner()
        if not self.config.enable_sessions:
            raise ConfigError("session references need TreeConfig(enable_sessions=True)")
        node = self._node(node_id)
        token = next(self._receipt_ids)
        self._srefs[token] = node
        if node is not self._root:
            if node.anchors is None:
                node.anchors = []
            node.anchors.append(token)
            self._add_sref(node, 1)
        return SessionRef(token=token, node_id=node.id)

    def release_session_ref(self, ref: SessionRef) -> None:
        self._check_owner()
        if not isinstance(ref, SessionRef):
            raise InvalidInputError(f"expected a SessionRef, got {ref!r}")
        node = self._srefs.pop(ref.token, None)
        if node is None:
            raise InvalidInputError(f"session ref {ref.token} is not held (released twice?)")
        if node.anchors:
            node.anchors.remove(ref.token)
            self._add_sref(node, -1)

    @property
    def session_refs(self) -> int:
        """Session references held."""
        return len(self._srefs)

    def _add_sref(self, node: Node, delta: int) -> None:
        n = node
        while n is not self._root:
            n.sref += delta
            self._requeue(n)
            assert n.parent is not None
            n = n.parent

    # ------------------------------------------------------------------ storage intents
    def set_storage_intents(self, on: bool) -> None:
        """Report nodes reaching the write threshold in ``InsertResult.intents`` (for a
        buffer-only host, which writes them from device to storage) instead of backing them up.
        Only for a tree without a host tier."""
        self._check_owner()
        if on and self._host:
            raise ConfigError("storage intents are for a tree without a host tier")
        self._intents = bool(on)

    # ------------------------------------------------------------------ eviction
    def evict(
        self, num_tokens: int, *, swa_num_tokens: int = 0, mamba_num: int = 0
    ) -> EvictResult:
        """Free at least ``num_tokens`` device tokens if possible (whole nodes, so maybe more).

        Victims come in eviction-policy order from the evictable device leaves. A backed-up
        victim is demoted to host; an un-backed one is deleted with its host-only subtree, or
        under write-back returned as a :class:`BackupRequest` to run before a later ``evict``
        demotes it.

        Hybrid trees also take per-component targets: ``swa_num_tokens`` SWA tokens and
        ``mamba_num`` states, each freed from its own LRU (an internal or pinned node becomes a
        tombstone of that component and every lower one; an unlocked leaf is deleted whole).
        """
        self._check_owner()
        num_tokens = _check_count("num_tokens", num_tokens)
        if self._aux or swa_num_tokens != 0 or mamba_num != 0:
            swa_num_tokens = _check_count("swa_num_tokens", swa_num_tokens)
            mamba_num = _check_count("mamba_num", mamba_num)
            if not self._aux:
                raise InvalidInputError(
                    f"component targets (swa_num_tokens={swa_num_tokens}, "
                    f"mamba_num={mamba_num}) given to a FULL-only tree"
                )
            if swa_num_tokens and self._swa is None:
                raise InvalidInputError("swa_num_tokens given but the tree has no SWA component")
            if mamba_num and self._mamba is None:
                raise InvalidInputError("mamba_num given but the tree has no Mamba component")
            if self._host:
                return hybrid_host.evict(self, num_tokens, swa_num_tokens, mamba_num)
            return hybrid.evict(self, num_tokens, swa_num_tokens, mamba_num)
        res = EvictResult()
        dq = self._queues[DLEAF]
        if self._write_back:
            return self._evict_write_back(num_tokens, res, self._demote)
        while res.num_evicted + res.pending_tokens < num_tokens:
            n = dq.pop()
            if n is None:
                break
            if n.host_value is not None:
                self._demote(n, res)
            else:
                self._delete_subtree(n, res)
        return res

    # ------------------------------------------------------------------ reset / inspection
    def reset(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Drop everything; returns (device slots, host slots) to free. No op may be in flight."""
        self._check_owner()
        if self._pending:
            raise InvalidInputError(f"cannot reset with {len(self._pending)} copies in flight")
        device = [n.value for n in self._nodes.values() if n.value is not None and n is not self._root]
        host = [n.host_value for n in self._nodes.values() if n.host_value is not None]
        self._reset_state()
        if self._events is not None:
            self._events.cleared()
        return device, host

    def device_slots(self) -> np.ndarray:
        """All device slots held by the tree."""
        parts = [n.value for n in self.iter_nodes() if n.value is not None]
        return np.concatenate(parts) if parts else EMPTY_SLOTS

    def host_slots(self) -> np.ndarray:
        parts = [n.host_value for n in self.iter_nodes() if n.host_value is not None]
        return np.concatenate(parts) if parts else EMPTY_SLOTS

    def node_key(self, node_id: int) -> RadixKey:
        """The full key from the root down to ``node_id``."""
        n = self._node(node_id)
        parts = []
        ns = n.ns
        while n is not self._root:
            parts.append(n.key)
            assert n.parent is not None
            n = n.parent
        return self._key_type.from_bytes(b"".join(reversed(parts)), ns)

    def sanity_check(self) -> None:
        """Verify every invariant; raises AssertionError naming the first violation."""
        from asynccache.tree.invariants import check_tree

        check_tree(self)
        if self._aux:
            from asynccache.tree.components.invariants import check_components

            check_components(self)
