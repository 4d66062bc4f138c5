"""The tree's state and the helpers every operation shares: construction, ownership, sizes,
accounting and eviction-queue membership, page hashes and KV events, splits and device locks."""

from __future__ import annotations

import heapq
import itertools
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from asynccache.errors import (
    ConfigError,
    InvalidInputError,
    LockError,
    OwnerError,
    UnknownNodeError,
)
from asynccache.tree import hybrid, hybrid_host
from asynccache.tree.arc import WIDTH as ARC_WIDTH
from asynccache.tree.arc import Arc, ArcQueue
from asynccache.tree.components import Component, MambaComponent, SWAComponent
from asynccache.tree.components.layout import EMPTY, QUEUES
from asynccache.tree.config import TreeConfig
from asynccache.tree.events import EventRecorder, KVEvent, Medium
from asynccache.tree.hashing import (
    chain_digests,
    event_hash,
    event_hashes,
    storage_key,
)
from asynccache.tree.keys import (
    DEFAULT_NAMESPACE,
    BigramKey,
    RadixKey,
    as_bigram_key,
    decode_pairs,
    decode_tokens,
)
from asynccache.tree.node import DLEAF, HDUP, HLEAF, BigramNode, Node, settled_dup, spared_dup
from asynccache.tree.queues import (
    USES_ACCESS,
    USES_HITS,
    USES_PRIORITY,
    NodeQueue,
    StampQueue,
    policy_key,
    sessions_last,
)
from asynccache.tree.results import (
    LockReceipt,
)


@dataclass(slots=True)
class _PendingOp:
    kind: str  # "backup" | "load"
    fragments: list[Node]  # root first; the anchor (deepest) is last
    # Hybrid trees: per part ("full", "swa", "mamba"), the ids of the fragments whose value of
    # that part this op copies (see asynccache.tree.hybrid_host); None in FULL-only trees.
    aux: dict[str, set[int]] | None = None


class TreeBase:
    """State and shared helpers of :class:`~asynccache.tree.tree.RadixTree` (see there)."""

    def __init__(self, config: TreeConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = TreeConfig(**kwargs)
        elif kwargs:
            raise ConfigError("pass either a TreeConfig or keyword settings, not both")
        self.config = config
        self.page_size = config.page_size
        # EAGLE trees key by bigrams (8 bytes a unit, BigramKey); others by tokens (4 bytes).
        self._eagle = config.eagle
        self._sh = 3 if config.eagle else 2  # log2 of the bytes of one key unit
        self._pb = config.page_size << self._sh  # bytes of one page of key
        self._node_cls: type[Node] = BigramNode if config.eagle else Node
        self._key_type: type[RadixKey] = BigramKey if config.eagle else RadixKey
        self._host = config.host_enabled
        self._write_back = config.host_enabled and config.write_policy == "write_back"
        self._write_through = config.host_enabled and not self._write_back
        # Write-back backs up at eviction only and counts no hits, as the reference (SGLang's
        # HiCache) does.
        self._count_hits = not self._write_back
        self._threshold = config.write_through_threshold
        self._intents = False  # buffer-only host mode with storage: report, do not back up
        policy = config.eviction_policy
        self._touch_requeues = policy in USES_ACCESS
        self._hit_requeues = policy in USES_HITS
        self._prio_requeues = policy in USES_PRIORITY
        key = policy_key(policy)
        if config.enable_sessions:
            key = sessions_last(key)
        # One node map for the tree's lifetime (a reset empties it): the queues find their
        # entries' nodes in it.
        self._nodes: dict[int, Node] = {}
        nodes = self._nodes
        self._queues: tuple[NodeQueue | StampQueue | ArcQueue, ...]
        if policy == "arc":
            self._queues = (ArcQueue(DLEAF, key, nodes), NodeQueue(HLEAF, key, nodes),
                            NodeQueue(HDUP, key, nodes))
        elif policy in ("lru", "mru") and not config.enable_sessions:
            newest = policy == "mru"  # ordered by the access stamp alone: no orphans
            self._queues = tuple(StampQueue(s, nodes, newest_first=newest)
                                 for s in (DLEAF, HLEAF, HDUP))
        else:
            self._queues = (NodeQueue(DLEAF, key, nodes), NodeQueue(HLEAF, key, nodes),
                            NodeQueue(HDUP, key, nodes))
        self._events = EventRecorder() if config.enable_kv_events else None
        self._eager_hashes = config.enable_page_hashes
        self._owner = threading.get_ident()
        self._ids = itertools.count(1)
        self._op_ids = itertools.count(1)
        self._receipt_ids = itertools.count(1)
        comps: list[Component] = []
        self._swa: SWAComponent | None = None
        self._mamba: MambaComponent | None = None
        if config.sliding_window:
            self._swa = SWAComponent(len(comps), config.page_size, nodes, config.sliding_window)
            comps.append(self._swa)
        if config.mamba:
            self._mamba = MambaComponent(
                len(comps), config.page_size, nodes,
                config.mamba_track_interval or config.page_size,
            )
            comps.append(self._mamba)
        self._aux: tuple[Component, ...] = tuple(comps)  # highest eviction priority first
        self._aux_low_first = self._aux[::-1]
        self._aux_names = frozenset(c.name for c in comps)
        # Node.aux of a new node (copied): not queued; the components' entries empty.
        self._aux_empty: list[Any] = [None] * QUEUES + list(EMPTY) * len(comps)
        # The arc policy (asynccache/tree/arc.py): its entries of Node.aux come last.
        self._arc: Arc | None = None
        if policy == "arc":
            self._arc = Arc(self, len(self._aux_empty), config.device_tokens // config.page_size)
            self._aux_empty += [0, None][:ARC_WIDTH]
            dq = self._queues[DLEAF]
            assert isinstance(dq, ArcQueue)
            dq.arc = self._arc
        self._mamba_interval = config.mamba_track_interval or config.page_size
        self._reset_state()

    def _reset_state(self) -> None:
        for q in self._queues:
            q.clear()
        for c in self._aux:
            c.reset()
        if self._arc is not None:
            self._arc.reset()
        self._nodes.clear()  # (after the queues: they find their entries' nodes in it)
        self._root = self._node_cls(0, None, b"", DEFAULT_NAMESPACE, self._aux_empty[:])
        self._root.lock_ref = 1  # the root is never evicted
        # (inserts raise it: _note_priority; the reference's root starts this low too)
        self._root.priority = -sys.maxsize
        self._nodes[0] = self._root
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._host_pinned = 0  # of _protected: tokens only host pins protect (class 3)
        self._host_size = 0
        # Write-back trees: the order in which evict_host reclaims host duplicates (see
        # _note_dup and HostTier.evict_host): each entry's place, and a heap of the places of
        # the entries a first reclaim pass must visit (every entry that is not an evictable
        # device leaf; items of dropped entries go stale), so that a pass never walks the
        # leaves it spares.
        self._dup_order: dict[int, Node] = {}
        self._dup_place: dict[int, int] = {}
        self._dup_heap: list[tuple[int, int]] = []
        self._dup_queued: set[int] = set()
        self._dup_places = itertools.count()
        # Write-back trees: victims an evict counted while they waited for their copies (and
        # parents it counted after them), in the order it took them: the next evict demotes
        # them first, as the reference demotes each victim right after its copy.
        self._owed: list[int] = []
        self._pending: dict[int, _PendingOp] = {}
        self._receipts: dict[int, tuple[Node, bool]] = {}
        old = getattr(self, "_srefs", {})
        self._srefs: dict[int, Node] = dict.fromkeys(old, self._root)  # refs survive a reset
        # Hybrid trees: per device receipt, each component's lock extent (0: not held).
        self._aux_locks: dict[int, list[int]] = {}
        self._swa_released: set[int] = set()

    def enable_page_hashes(self) -> None:
        """Compute page hashes eagerly from now on (storage attached); existing nodes get theirs
        on demand, continuing their parents' chains."""
        self._eager_hashes = True

    # ------------------------------------------------------------------ ownership
    def bind_owner(self, thread_ident: int | None = None) -> None:
        """Make ``thread_ident`` (default: the calling thread) the only one allowed to mutate."""
        self._owner = threading.get_ident() if thread_ident is None else thread_ident

    def _check_owner(self) -> None:
        if threading.get_ident() != self._owner:
            raise OwnerError(
                f"tree is owned by thread {self._owner}; called from {threading.get_ident()}"
            )

    def key_of(self, key: Any) -> RadixKey:
        """``key`` as this tree's kind of key: token ids or a RadixKey as a BigramKey in an
        EAGLE tree (the bigram view, built once here; pass a BigramKey to skip it); a
        BigramKey in any other tree is refused (it holds bigrams, not tokens)."""
        if type(key) is self._key_type:
            return key
        if self._eagle:
            return as_bigram_key(key)
        if isinstance(key, BigramKey):
            raise InvalidInputError(
                f"{key!r} is an EAGLE bigram key; this tree keys by tokens "
                "(TreeConfig(eagle=False))"
            )
        return key if isinstance(key, RadixKey) else RadixKey(key)

    # ------------------------------------------------------------------ sizes
    @property
    def root_id(self) -> int:
        return 0

    @property
    def evictable_size(self) -> int:
        """Device tokens that eviction may free (unlocked)."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Device tokens pinned by locks."""
        return self._protected

    @property
    def host_pinned_size(self) -> int:
        """Of the protected device tokens, those only host pins protect: device-only nodes
        whose host-side descendants are pinned (e.g. by storage writes or prefetches), which
        eviction may take once those pins go."""
        return self._host_pinned

    @property
    def device_size(self) -> int:
        return self._evictable + self._protected

    @property
    def host_size(self) -> int:
        """Tokens with a host copy."""
        return self._host_size

    @property
    def components(self) -> tuple[str, ...]:
        """Names of the components: ``"full"`` then the auxiliary ones (``"swa"``, ``"mamba"``)."""
        return ("full", *(c.name for c in self._aux))

    def component_sizes(self, name: str) -> tuple[int, int]:
        """(evictable, protected) units of a component: tokens (full, swa) or states (mamba)."""
        if name == "full":
            return self._evictable, self._protected
        c = self._component(name)
        return c.evictable, c.protected

    def component_slots_of(self, node_id: int, name: str) -> np.ndarray | None:
        """Component ``name``'s device slots on ``node_id`` (None: a tombstone); read-only.
        SWA: the node's FULL slots (its SWA KV is at their full->SWA translation)."""
        return self._component(name).value(self._node(node_id))

    def _component(self, name: str) -> Component:
        for c in self._aux:
            if c.name == name:
                return c
        raise InvalidInputError(
            f"the tree has no auxiliary component {name!r}; its auxiliary components are "
            f"{[c.name for c in self._aux]} (FULL's slots are the node's own)"
        )

    def component_slots(self, name: str) -> np.ndarray:
        """Every slot an auxiliary component (``"swa"``, ``"mamba"``) holds (e.g. before reset);
        SWA by FULL slots."""
        return hybrid.slots_of(self, name)

    def component_host_slots(self, name: str) -> np.ndarray:
        """Every host slot holding a copy of an auxiliary component's values."""
        return hybrid_host.host_slots_of(self, name)

    @property
    def node_count(self) -> int:
        """Nodes in the tree, the root excluded."""
        return len(self._nodes) - 1

    @property
    def pending_ops(self) -> int:
        return len(self._pending)

    @property
    def held_locks(self) -> int:
        """Outstanding lock receipts (device and host)."""
        return len(self._receipts)

    # ------------------------------------------------------------------ helpers
    def _node(self, node_id: int) -> Node:
        try:
            return self._nodes[node_id]
        except (KeyError, TypeError):
            raise UnknownNodeError(f"no node with id {node_id!r} in the tree") from None

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _note_dup(self, n: Node) -> None:
        """Write-back trees: ``n`` may have just become a host duplicate (its backup committed,
        it got device KV back, or it is the prefix split off one). A settled duplicate (on
        device and on host, no copy in flight) joins the reclaim order at its end, unless it
        still has an entry there: entries are only dropped when a reclaim walk passes a node
        that is no longer a duplicate, or when the node is deleted, so a node that was demoted
        and came back keeps its old place. Any other node loses its entry. This is the
        reference's bookkeeping (SGLang 0.5.23 registers duplicates at these same points and
        reclaims them in registration order), which host eviction must follow to take the same
        victims."""
        if settled_dup(n):
            if n.id not in self._dup_order:
                self._dup_order[n.id] = n
                self._dup_place[n.id] = next(self._dup_places)
            self._dup_watch(n)
        else:
            self._dup_forget(n.id)

    def _dup_forget(self, node_id: int) -> None:
        """Drop ``node_id``'s entry from the duplicate order (its heap item goes stale)."""
        if self._dup_order.pop(node_id, None) is not None:
            del self._dup_place[node_id]
            self._dup_queued.discard(node_id)

    def _dup_watch(self, n: Node) -> None:
        """``n`` has an entry in the duplicate order and its state may have changed: queue it
        for the first reclaim pass unless it is an evictable device leaf with a settled host
        copy (what that pass spares)."""
        if n.id in self._dup_queued or spared_dup(n):
            return
        heap = self._dup_heap
        if len(heap) > 2 * len(self._dup_queued) + 64:  # mostly stale items: rebuild
            place = self._dup_place
            heap[:] = [(place[i], i) for i in self._dup_queued]
            heapq.heapify(heap)
        heapq.heappush(heap, (self._dup_place[n.id], n.id))
        self._dup_queued.add(n.id)

    def _touch_path(self, path: list[Node]) -> None:
        """A match walked ``path`` (root first): stamp each node's access, deepest newest, and
        re-file the queued ones under access-ordered policies."""
        clock = self._clock
        requeue = self._touch_requeues
        for n in path:  # one pass: a node's re-filing reads only its own stamp
            clock += 1
            n.last_access = clock
            if requeue:
                aux = n.aux
                if aux[DLEAF] is not None or aux[HLEAF] is not None or aux[HDUP] is not None:
                    self._requeue(n)
        self._clock = clock

    def _note_priority(self, priority: int) -> None:
        """An insert with ``priority``: the root keeps the highest so far, which a node a host
        insert makes below the root takes (as in the reference, whose inserts raise the root's
        priority and whose host insert gives a new node its parent's)."""
        if priority > self._root.priority:
            self._root.priority = priority

    def _touch(self, n: Node) -> None:
        """Stamp ``n``'s access now and re-file it where the policy orders by access."""
        n.last_access = self._tick()
        if self._touch_requeues:
            aux = n.aux
            if aux[DLEAF] is not None or aux[HLEAF] is not None or aux[HDUP] is not None:
                self._requeue(n)

    def _child_key(self, parent: Node, page: bytes, ns: Any) -> Any:
        if parent is self._root and ns is not DEFAULT_NAMESPACE:
            return (ns, page)
        return page

    def _match_bytes(self, node_key: bytes, data: bytes, off: int, end: int) -> int:
        """Bytes of ``node_key`` matching ``data[off:end]``, rounded down to whole pages.

        The first page is known to match (it selected the child).
        """
        klen = len(node_key)
        avail = min(klen, end - off)
        if data[off : off + avail] == node_key[:avail]:
            return avail
        pb = self._pb
        lo, hi = 1, avail // pb
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            nb = mid * pb
            if data[off : off + nb] == node_key[:nb]:
                lo = mid
            else:
                hi = mid - 1
        return lo * pb

    def _match_child(self, child: Node, data: bytes, off: int, end: int) -> tuple[Node, int]:
        """The whole pages of ``child``'s key that ``data[off:end]`` matches, as (node, bytes):
        a partial match splits ``child`` there and returns the new prefix node. (The hot walks
        first try ``data.startswith(child.key, off)`` inline and call this only when it fails.)"""
        nb = self._match_bytes(child.key, data, off, end)
        if nb < len(child.key):
            child = self._split(child, nb)
        return child, nb

    def _account(self, n: Node) -> None:
        """Count ``n``'s device tokens as evictable or protected, per its current state.

        Protected: device-locked (class 2), or host-pinned without a host copy (class 3:
        eviction could only delete it, which the pin forbids). The sizes are therefore exactly
        what ``evict`` can free and what it cannot.
        """
        if n.value is None:
            want = 0
        elif n.lock_ref:
            want = 2
        elif n.host_value is None and n.host_lock_ref:
            want = 3
        else:
            want = 1
        have = n.acct
        if want != have:
            k = n.ntok
            if have == 1:
                self._evictable -= k
            elif have:
                self._protected -= k
                if have == 3:
                    self._host_pinned -= k
            if want == 1:
                self._evictable += k
            elif want:
                self._protected += k
                if want == 3:
                    self._host_pinned += k
            n.acct = want
            if not want and self._arc is not None:
                self._arc.lost(n)  # off the device: its pages' keys go to a ghost list

    def _refresh(self, n: Node) -> None:
        """Recount ``n`` and put it in exactly the eviction queues its state calls for."""
        if n is self._root:
            return
        self._account(n)
        free = n.pending == 0
        dq, hq, uq = self._queues
        if (
            free
            and n.value is not None
            and n.lock_ref == 0
            and n.dchildren == 0
            and not (n.host_value is None and n.host_lock_ref > 0)
        ):
            if n.aux[DLEAF] is None:
                dq.push(n)
        elif n.aux[DLEAF] is not None:
            dq.discard(n)
        if free and n.value is None and n.host_value is not None and not n.children and (
            n.host_lock_ref == 0
        ):
            if n.aux[HLEAF] is None:
                hq.push(n)
        elif n.aux[HLEAF] is not None:
            hq.discard(n)
        if free and n.value is not None and n.host_value is not None and n.host_lock_ref == 0:
            if n.aux[HDUP] is None:
                uq.push(n)
        elif n.aux[HDUP] is not None:
            uq.discard(n)
        if self._dup_order and n.id in self._dup_order:
            self._dup_watch(n)

    def _requeue(self, n: Node) -> None:
        """Re-key ``n`` in the queues it is in (its policy key changed)."""
        aux = n.aux
        dq, hq, uq = self._queues
        if aux[DLEAF] is not None:
            dq.push(n)
        if aux[HLEAF] is not None:
            hq.push(n)
        if aux[HDUP] is not None:
            uq.push(n)

    # ------------------------------------------------------------------ hashes / events
    def _digests(self, n: Node) -> list[bytes]:
        """Page digests of ``n`` (computed on demand, continuing the parent's chain)."""
        if n.digests is not None:
            return n.digests
        chain = []
        cur: Node | None = n
        while cur is not None and cur is not self._root and cur.digests is None:
            chain.append(cur)
            cur = cur.parent
        for node in reversed(chain):
            parent = node.parent
            assert parent is not None
            prev = None
            if parent is not self._root:
                assert parent.digests is not None  # (computed above: root first)
                prev = parent.digests[-1]
            node.digests = chain_digests(node.ns, prev, node.key, self._pb)
        assert n.digests is not None
        return n.digests

    def _emit_stored(self, n: Node, medium: Medium) -> None:
        ev = self._events
        if ev is None:
            return
        ns = n.ns
        hashes = event_hashes(self._digests(n), ns)
        parent = n.parent
        parent_hash = (
            None
            if parent is None or parent is self._root
            else event_hash(self._digests(parent)[-1], ns)
        )
        ev.stored(
            hashes,
            parent_hash,
            decode_pairs(n.key) if self._eagle else decode_tokens(n.key),
            self.page_size,
            medium,
            ns.extra_key,
            ns.cache_salt,
        )

    def _emit_removed(self, n: Node, medium: Medium) -> None:
        if self._events is not None:
            ns = n.ns
            self._events.removed(event_hashes(self._digests(n), ns), medium)

    def take_events(self) -> list[KVEvent]:
        """Drain the KV events recorded since the last call (empty when events are off)."""
        self._check_owner()
        return self._events.take() if self._events is not None else []

    def page_hashes(self, node_id: int) -> list[str]:
        """Storage keys (hex page digests) of every page from the root down to ``node_id``."""
        n = self._node(node_id)
        path = []
        while n is not self._root:
            path.append(n)
            assert n.parent is not None
            n = n.parent
        return [storage_key(d) for node in reversed(path) for d in self._digests(node)]

    # ------------------------------------------------------------------ split
    def _split(self, x: Node, nbytes: int) -> Node:
        """Split ``x`` after ``nbytes``; the new prefix node is returned. ``x`` keeps its id and
        its place in the queues. As in the reference, the new prefix takes a fresh stamp and
        then ``x`` another: a walk that goes on stamps the prefix again, but a hybrid match whose
        best node is above the split does not, and there the prefix must not keep ``x``'s old
        stamp (it would go before leaves stamped since)."""
        parent = x.parent
        assert parent is not None and 0 < nbytes < len(x.key) and nbytes % self._pb == 0
        m = nbytes >> self._sh
        p = self._node_cls(next(self._ids), parent, x.key[:nbytes], x.ns, self._aux_empty[:])
        self._nodes[p.id] = p
        ck = self._child_key(parent, x.key[: self._pb], x.ns)
        x.key = x.key[nbytes:]
        if x.value is not None:
            p.value = x.value[:m]
            x.value = x.value[m:]
            p.dchildren = 1
        if x.host_value is not None:
            p.host_value = x.host_value[:m]
            x.host_value = x.host_value[m:]
        if x.digests is not None:
            k = m // self.page_size
            p.digests = x.digests[:k]
            x.digests = x.digests[k:]
        p.lock_ref = x.lock_ref
        p.host_lock_ref = x.host_lock_ref
        p.acct = x.acct  # the prefix's tokens keep the class they were counted in
        p.last_access = self._tick()
        x.last_access = self._tick()
        if self._touch_requeues:
            self._requeue(x)
        p.creation = x.creation
        p.hit_count = x.hit_count
        p.priority = x.priority
        p.pending = x.pending
        p.sref = x.sref
        if self._arc is not None:
            p.aux[self._arc.at] = x.aux[self._arc.at]  # the class (the tokens stay counted)
        if x.pending:
            frags = self._pending[x.pending].fragments
            frags.insert(frags.index(x), p)
        parent.children[ck] = p
        p.children[x.key[: self._pb]] = x
        x.parent = p
        self._refresh(p)
        if self._aux:
            for c in self._aux:
                c.split(x, p, m)
            if self._host:
                hybrid_host.split_host(self, x, p, m)
            hybrid.refresh_aux(self, p)
        if self._write_back:
            self._note_dup(p)  # (the suffix keeps its id and its entry)
        return p

    # ------------------------------------------------------------------ locks
    def _inc(self, node: Node) -> int:
        delta = 0
        n = node
        root = self._root
        while n is not root:
            if n.lock_ref == 0:
                if n.acct == 1:
                    delta += n.ntok
                n.lock_ref = 1
                self._account(n)
                if n.aux[DLEAF] is not None:
                    self._queues[DLEAF].discard(n)
                if self._dup_order and n.id in self._dup_order:
                    self._dup_watch(n)
            else:
                n.lock_ref += 1
            parent = n.parent
            assert parent is not None
            n = parent
        return delta

    def _dec(self, node: Node) -> int:
        delta = 0
        n = node
        root = self._root
        while n is not root:
            if n.lock_ref <= 0:
                raise LockError(f"node {n.id} is not device-locked")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._refresh(n)
                if n.acct == 1:
                    delta += n.ntok
            parent = n.parent
            assert parent is not None
            n = parent
        return delta

    def _take_receipt(self, receipt: LockReceipt, *, host: bool) -> Node:
        if not isinstance(receipt, LockReceipt):
            raise LockError(f"expected a LockReceipt, got {receipt!r}")
        held = self._receipts.get(receipt.token)
        if held is None:
            raise LockError(f"lock receipt {receipt.token} is not held (released twice?)")
        node, is_host = held
        if is_host != host or receipt.host != host:
            kind = "host" if is_host else "device"
            raise LockError(f"receipt {receipt.token} is a {kind} lock")
        if node.id != receipt.node_id:
            raise LockError(
                f"receipt {receipt.token} is anchored at node {node.id}, not {receipt.node_id}"
            )
        del self._receipts[receipt.token]
        return node

    def _move_anchors(self, n: Node, to: Node) -> None:
        """``n`` is being deleted: its session refs now anchor at ``to`` (which already counts
        them)."""
        assert n.anchors
        for token in n.anchors:
            self._srefs[token] = to
        if to is not self._root:
            if to.anchors is None:
                to.anchors = []
            to.anchors.extend(n.anchors)
        n.anchors = None

    def _detach(self, n: Node) -> None:
        parent = n.parent
        assert parent is not None
        ck = self._child_key(parent, n.key[: self._pb], n.ns)
        del parent.children[ck]
        n.parent = None

    def iter_nodes(self) -> Iterator[Node]:
        """Every node but the root (read-only use: tests, digests, debugging)."""
        return (n for n in self._nodes.values() if n is not self._root)
