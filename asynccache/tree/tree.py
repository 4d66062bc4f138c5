"""The synchronous radix tree: the part of the cache that decides.

No I/O, no asyncio, no CUDA. The tree holds slot indices it was given, decides what to keep,
evict, back up or load, and returns the slots it gives up and the copies it wants as values
(see :mod:`asynccache.tree.results`). One thread owns it; a mutating call from another thread
raises :class:`~asynccache.errors.OwnerError`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Mapping
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
from asynccache.tree import hybrid
from asynccache.tree.components import Component, MambaComponent, SWAComponent
from asynccache.tree.config import WRITE_POLICIES as WRITE_POLICIES
from asynccache.tree.config import TreeConfig, _check_count, as_slots
from asynccache.tree.events import EventRecorder, KVEvent, Medium
from asynccache.tree.hashing import chain_digests, chain_seed, event_hash, storage_key
from asynccache.tree.keys import DEFAULT_NAMESPACE, RadixKey, as_key, decode_tokens
from asynccache.tree.node import DLEAF, HDUP, HLEAF, Node, frozen
from asynccache.tree.queues import (
    USES_ACCESS,
    USES_HITS,
    USES_PRIORITY,
    NodeQueue,
    policy_key,
)
from asynccache.tree.results import (
    EMPTY_SLOTS,
    BackupRequest,
    EvictResult,
    HostEvictResult,
    InsertResult,
    LoadBackTicket,
    LockReceipt,
    MatchResult,
)


@dataclass(slots=True)
class _PendingOp:
    kind: str  # "backup" | "load"
    fragments: list[Node]  # root first; the anchor (deepest) is last


class RadixTree:
    """A page-granular radix tree of cached KV prefixes over a device tier and a host tier."""

    def __init__(self, config: TreeConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = TreeConfig(**kwargs)
        elif kwargs:
            raise ConfigError("pass either a TreeConfig or keyword settings, not both")
        self.config = config
        self.page_size = config.page_size
        self._pb = 4 * config.page_size
        self._host = config.host_enabled
        self._write_back = config.host_enabled and config.write_policy == "write_back"
        self._write_through = config.host_enabled and not self._write_back
        self._threshold = config.write_through_threshold
        policy = config.eviction_policy
        self._touch_requeues = policy in USES_ACCESS
        self._hit_requeues = policy in USES_HITS
        self._prio_requeues = policy in USES_PRIORITY
        key = policy_key(policy)
        self._queues = (NodeQueue(DLEAF, key), NodeQueue(HLEAF, key), NodeQueue(HDUP, key))
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
            self._swa = SWAComponent(len(comps), config.page_size, config.sliding_window)
            comps.append(self._swa)
        if config.mamba:
            self._mamba = MambaComponent(
                len(comps), config.page_size, config.mamba_track_interval or config.page_size
            )
            comps.append(self._mamba)
        self._aux: tuple[Component, ...] = tuple(comps)  # highest eviction priority first
        self._aux_names = frozenset(c.name for c in comps)
        self._mamba_interval = config.mamba_track_interval or config.page_size
        self._reset_state()

    def _reset_state(self) -> None:
        self._root = Node(0, None, b"", DEFAULT_NAMESPACE)
        self._root.lock_ref = 1  # the root is never evicted
        self._nodes: dict[int, Node] = {0: self._root}
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._host_size = 0
        self._pending: dict[int, _PendingOp] = {}
        self._receipts: dict[int, tuple[Node, bool]] = {}
        for q in self._queues:
            q.clear()
        # Hybrid trees: per device receipt, each component's lock extent (0: not held).
        self._aux_locks: dict[int, list[int]] = {}
        self._swa_released: set[int] = set()
        for c in self._aux:
            c.reset()
        if self._aux:
            self._root.aux = hybrid.new_aux(self)

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
        for c in self._aux:
            if c.name == name:
                return c.evictable, c.protected
        raise InvalidInputError(f"the tree has no component {name!r}; it has {self.components}")

    def component_slots(self, name: str) -> np.ndarray:
        """Every slot an auxiliary component (``"swa"``, ``"mamba"``) holds (e.g. before reset)."""
        return hybrid.slots_of(self, name)

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

    def _account(self, n: Node) -> None:
        """Count ``n``'s device tokens as evictable or protected, per its current state.

        Protected: device-locked, or host-pinned without a host copy (eviction could only
        delete it, which the pin forbids). The sizes are therefore exactly what ``evict`` can
        free and what it cannot.
        """
        if n.value is None:
            want = 0
        elif n.lock_ref or (n.host_value is None and n.host_lock_ref):
            want = 2
        else:
            want = 1
        have = n.acct
        if want != have:
            k = n.ntok
            if have == 1:
                self._evictable -= k
            elif have == 2:
                self._protected -= k
            if want == 1:
                self._evictable += k
            elif want == 2:
                self._protected += k
            n.acct = want

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
            if n.qe[DLEAF] is None:
                dq.push(n)
        elif n.qe[DLEAF] is not None:
            dq.discard(n)
        if free and n.value is None and n.host_value is not None and not n.children and (
            n.host_lock_ref == 0
        ):
            if n.qe[HLEAF] is None:
                hq.push(n)
        elif n.qe[HLEAF] is not None:
            hq.discard(n)
        if free and n.value is not None and n.host_value is not None and n.host_lock_ref == 0:
            if n.qe[HDUP] is None:
                uq.push(n)
        elif n.qe[HDUP] is not None:
            uq.discard(n)

    def _requeue(self, n: Node) -> None:
        """Re-key ``n`` in the queues it is in (its policy key changed)."""
        for q, slot in zip(self._queues, (DLEAF, HLEAF, HDUP), strict=True):
            if n.qe[slot] is not None:
                q.push(n)

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
            prev = parent.digests[-1] if parent is not self._root and parent.digests else b""
            if parent is self._root:
                prev = chain_seed(node.ns)
            node.digests = chain_digests(prev, node.key, self._pb)
        assert n.digests is not None
        return n.digests

    def _emit_stored(self, n: Node, medium: Medium) -> None:
        ev = self._events
        if ev is None:
            return
        ns = n.ns
        hashes = [event_hash(d, ns) for d in self._digests(n)]
        parent = n.parent
        parent_hash = (
            None
            if parent is None or parent is self._root
            else event_hash(self._digests(parent)[-1], ns)
        )
        ev.stored(
            hashes,
            parent_hash,
            decode_tokens(n.key),
            self.page_size,
            medium,
            ns.extra_key,
            ns.cache_salt,
        )

    def _emit_removed(self, n: Node, medium: Medium) -> None:
        if self._events is not None:
            ns = n.ns
            self._events.removed([event_hash(d, ns) for d in self._digests(n)], medium)

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
        """Split ``x`` after ``nbytes``; the new prefix node is returned, ``x`` keeps its id."""
        parent = x.parent
        assert parent is not None and 0 < nbytes < len(x.key) and nbytes % self._pb == 0
        m = nbytes >> 2
        p = Node(next(self._ids), parent, x.key[:nbytes], x.ns)
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
        p.last_access = x.last_access
        p.creation = x.creation
        p.hit_count = x.hit_count
        p.priority = x.priority
        p.pending = x.pending
        if x.pending:
            frags = self._pending[x.pending].fragments
            frags.insert(frags.index(x), p)
        parent.children[ck] = p
        p.children[x.key[: self._pb]] = x
        x.parent = p
        self._refresh(p)
        if self._aux:
            p.aux = [c.split(x, p, m) for c in self._aux]
            hybrid.refresh_aux(self, p)
        return p

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: RadixKey | Any, *, cow_mamba: bool = False) -> MatchResult:
        """Find the longest cached prefix of ``key`` (whole pages only).

        A match may split a node where the prefix ends inside it and refreshes recency, but
        never frees anything. In a hybrid tree the prefix ends at the deepest node every
        component accepts (see :class:`MatchResult`); ``cow_mamba`` asks for the state slot
        to copy.
        """
        self._check_owner()
        key = as_key(key)
        if self._aux:
            return hybrid.match(self, key, cow_mamba)
        data = key.data
        end = len(data) - len(data) % self._pb
        root = self._root
        node = root
        off = 0
        values: list[np.ndarray] = []
        path: list[Node] = []
        last_device = root
        host_len = 0
        pending: list[int] = []
        ns = key.namespace
        pb = self._pb
        children = root.children
        while off < end:
            page = data[off : off + pb]
            child = children.get(self._child_key(node, page, ns))
            if child is None:
                break
            nb = self._match_bytes(child.key, data, off, end)
            if nb < len(child.key):
                child = self._split(child, nb)
            if child.pending and self._pending[child.pending].kind == "load":
                # Still copying in: a host hit until the load commits.
                pending.append(child.pending)
                host_len += nb >> 2
            elif child.value is not None and not pending:
                values.append(child.value)
                last_device = child
            else:
                host_len += nb >> 2
            path.append(child)
            node = child
            children = child.children
            off += nb
        if path:
            base = self._clock
            for i, n in enumerate(path):
                n.last_access = base + i + 1
            self._clock = base + len(path)
            if self._touch_requeues:
                for n in path:
                    if n.qe[0] is not None or n.qe[1] is not None or n.qe[2] is not None:
                        self._requeue(n)
        if not values:
            indices = EMPTY_SLOTS
        elif len(values) == 1:
            indices = values[0]
        else:
            indices = np.concatenate(values)
        return MatchResult(
            device_indices=indices,
            device_prefix_len=len(indices),
            last_device_node=last_device.id,
            best_node=node.id,
            host_hit_length=host_len,
            pending_loads=tuple(dict.fromkeys(pending)),
            full_kv_hit_length=off >> 2,
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
        swa_value: Any = None,
        component_evicted_seqlens: Mapping[str, int] | None = None,
        mamba_value: Any = None,
    ) -> InsertResult:
        """Cache ``value`` (one device slot per token of ``key``) for the page-aligned part of key.

        ``prev_prefix_len``: the caller's first tokens already are the tree's own slots (from
        its match), so they are never reported as duplicates. ``inserted_len``: tokens this
        request inserted before (only nodes ending past it count a hit). The tree takes
        ownership of the slots it stores; the duplicates it does not need come back in
        ``device_frees``; the unaligned tail stays the caller's.

        Hybrid trees: ``swa_value`` holds the SWA-pool slot of each token (the caller's
        full->SWA translation; entries below the SWA floor are ignored);
        ``component_evicted_seqlens={"swa": k}`` says the caller already freed the SWA slots
        of its first ``k`` tokens (those nodes are SWA tombstones from birth);
        ``mamba_value`` is the state slot after the page-aligned key, kept on its last node.
        SWA and Mamba slots the tree does not take come back in ``component_frees``.
        """
        self._check_owner()
        key = as_key(key)
        slots = as_slots(value)
        total = len(key)
        if len(slots) != total:
            raise InvalidInputError(
                f"value has {len(slots)} slots but the key has {total} tokens"
            )
        prev_prefix_len = _check_count("prev_prefix_len", prev_prefix_len)
        inserted_len = _check_count("inserted_len", inserted_len)
        if prev_prefix_len > total:
            raise InvalidInputError(
                f"prev_prefix_len {prev_prefix_len} exceeds the key length {total}"
            )
        if isinstance(priority, bool) or not isinstance(priority, int | np.integer):
            raise InvalidInputError(f"priority must be an int, got {priority!r}")
        if self._aux or swa_value is not None or mamba_value is not None or (
            component_evicted_seqlens
        ):
            swa_slots, floor, state = hybrid.check_insert_args(
                self, total, swa_value, component_evicted_seqlens, mamba_value
            )
            return hybrid.insert(
                self, key, slots, prev_prefix_len, inserted_len, int(priority), swa_slots,
                floor, state,
            )
        data = key.data
        pb = self._pb
        end = len(data) - len(data) % pb
        n_tok = end >> 2
        ns = key.namespace
        root = self._root
        node = root
        off = 0
        result = InsertResult(prefix_len=0, cached_len=n_tok, last_node=0)
        frees = result.device_frees
        while off < end:
            page = data[off : off + pb]
            child = node.children.get(self._child_key(node, page, ns))
            if child is None:
                break
            if child.pending and self._pending[child.pending].kind == "load":
                # Its KV is still being copied in: the caller keeps its own slots from here on.
                result.cached_len = off >> 2
                break
            nb = self._match_bytes(child.key, data, off, end)
            if nb < len(child.key):
                child = self._split(child, nb)
            pos = off >> 2
            m = nb >> 2
            child.last_access = self._tick()
            requeue = self._touch_requeues
            if priority > child.priority:
                child.priority = int(priority)
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
            if pos + m > inserted_len:
                child.hit_count += 1
                requeue = requeue or self._hit_requeues
                if self._write_through and child.hit_count >= self._threshold:
                    self._backup_chain(child, result.backups)
            if requeue and (child.qe[0] or child.qe[1] or child.qe[2]):
                self._requeue(child)
            node = child
            off += nb
        result.prefix_len = off >> 2
        if off < end and result.cached_len == n_tok:
            leaf = Node(next(self._ids), node, data[off:end], ns)
            self._nodes[leaf.id] = leaf
            leaf.value = frozen(slots[off >> 2 : n_tok])
            leaf.creation = leaf.last_access = self._tick()
            leaf.hit_count = 1
            leaf.priority = int(priority)
            node.children[self._child_key(node, data[off : off + pb], ns)] = leaf
            node.dchildren += 1
            if self._eager_hashes:
                self._digests(leaf)
            self._emit_stored(leaf, Medium.GPU)
            self._refresh(node)
            self._refresh(leaf)
            if self._write_through and self._threshold <= 1:
                self._backup_chain(leaf, result.backups)
            node = leaf
        result.last_node = node.id
        return result

    def insert_host(self, key: RadixKey | Any, start: int, host_slots: Any) -> InsertResult:
        """Record host copies (e.g. pages prefetched from storage) of ``key[start:]``.

        ``host_slots`` holds one host slot per token of ``key[start:start + len(host_slots)]``
        (whole pages). Spans the tree already has on host are duplicates: their slots come back
        in ``InsertResult.device_frees`` (they are *host* slots here). A device node without a
        host copy adopts the slots as its backup; the rest becomes host-only nodes. ``last_node``
        is the node ending at the end of the inserted span.
        """
        self._check_owner()
        if self._aux:
            raise InvalidInputError("insert_host: hybrid trees have no host tier")
        key = as_key(key)
        slots = as_slots(host_slots, "host_slots")
        start = _check_count("start", start)
        end_tok = start + len(slots)
        if start % self.page_size or len(slots) % self.page_size or end_tok > len(key):
            raise InvalidInputError(
                f"host span [{start}, {end_tok}) must be whole pages within the key of "
                f"{len(key)} tokens (page_size={self.page_size})"
            )
        data = key.data
        pb = self._pb
        end = end_tok * 4
        if self._cached_bytes(key, end) < start * 4:
            raise InvalidInputError(
                f"the tree holds only {self._cached_bytes(key, end) >> 2} tokens of the key; a "
                f"host span starting at {start} would leave a gap"
            )
        ns = key.namespace
        root = self._root
        node = root
        off = 0
        result = InsertResult(prefix_len=0, cached_len=end_tok, last_node=0)
        while off < end:
            page = data[off : off + pb]
            child = node.children.get(self._child_key(node, page, ns))
            if child is None:
                break
            nb = self._match_bytes(child.key, data, off, end)
            if nb < len(child.key):
                child = self._split(child, nb)
            pos = off >> 2
            m = nb >> 2
            if pos + m > start:
                lo = max(pos, start)
                span = slots[lo - start : pos + m - start]
                if child.host_value is None and child.pending == 0 and lo == pos:
                    child.host_value = frozen(span)
                    self._host_size += m
                    self._emit_stored(child, Medium.CPU_PINNED)
                    self._refresh(child)
                else:
                    result.device_frees.append(span)
            node = child
            off += nb
        result.prefix_len = off >> 2
        if off < end:
            leaf = Node(next(self._ids), node, data[off:end], ns)
            self._nodes[leaf.id] = leaf
            leaf.host_value = frozen(slots[(off >> 2) - start :])
            leaf.creation = leaf.last_access = self._tick()
            leaf.hit_count = 1
            node.children[self._child_key(node, data[off : off + pb], ns)] = leaf
            self._host_size += leaf.ntok
            if self._eager_hashes:
                self._digests(leaf)
            self._emit_stored(leaf, Medium.CPU_PINNED)
            self._refresh(node)
            self._refresh(leaf)
            node = leaf
        result.last_node = node.id
        return result

    def host_slots_of(self, node_id: int) -> np.ndarray | None:
        """The host slots of ``node_id`` (None when it has no host copy); read-only."""
        return self._node(node_id).host_value

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
        key = as_key(key)
        n = self._node(node_id)
        prev = chain_seed(key.namespace) if n is self._root else self._digests(n)[-1]
        data = key.data[start * 4 :]
        data = data[: len(data) - len(data) % self._pb]
        return [storage_key(d) for d in chain_digests(prev, data, self._pb)]

    def _unevict(self, n: Node, slots: np.ndarray) -> None:
        """Give a host-only node device slots again (the caller recomputed its KV)."""
        parent = n.parent
        assert parent is not None and n.lock_ref == 0
        n.value = frozen(slots)
        parent.dchildren += 1
        self._emit_stored(n, Medium.GPU)
        self._refresh(parent)
        self._refresh(n)

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
                if n.qe[DLEAF] is not None:
                    self._queues[DLEAF].discard(n)
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

    def lock_ref(self, node_id: int) -> tuple[int, int]:
        """(device, host) lock counts of a node."""
        n = self._node(node_id)
        return n.lock_ref, n.host_lock_ref

    # ------------------------------------------------------------------ backups (D -> H)
    def _backup_chain(self, node: Node, out: list[BackupRequest]) -> None:
        chain = []
        n = node
        while n is not self._root and n.host_value is None and n.pending == 0:
            chain.append(n)
            assert n.parent is not None
            n = n.parent
        for c in reversed(chain):
            out.append(self._begin_backup(c, write_back=False))

    def _begin_backup(self, n: Node, *, write_back: bool) -> BackupRequest:
        assert n.value is not None and n.pending == 0
        op_id = next(self._op_ids)
        self._pending[op_id] = _PendingOp("backup", [n])
        n.pending = op_id
        self._inc(n)
        self._refresh(n)
        return BackupRequest(op_id=op_id, node_id=n.id, device_slots=n.value, write_back=write_back)

    def _pop_op(self, op_id: int, kind: str) -> _PendingOp:
        op = self._pending.get(op_id)
        if op is None or op.kind != kind:
            raise InvalidInputError(f"no {kind} in flight with id {op_id!r}")
        del self._pending[op_id]
        return op

    def commit_backup(self, op_id: int, host_slots: Any) -> list[int]:
        """The D->H copy of backup ``op_id`` landed in ``host_slots``: record the host copy.

        Returns the ids of the nodes now backed up: the original node and any prefix fragments
        split off it while the copy was in flight, root first.
        """
        self._check_owner()
        op = self._pending.get(op_id)
        if op is None or op.kind != "backup":
            raise InvalidInputError(f"no backup in flight with id {op_id!r}")
        slots = as_slots(host_slots, "host_slots")
        need = sum(f.ntok for f in op.fragments)
        if len(slots) != need:
            raise InvalidInputError(f"backup {op_id} needs {need} host slots, got {len(slots)}")
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
        self._dec(op.fragments[-1])
        for f in op.fragments:
            self._refresh(f)
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

    # ------------------------------------------------------------------ load-back (H -> D)
    def host_chain(self, node_id: int) -> list[int]:
        """Ids of the host-only nodes from below the last device ancestor down to ``node_id``."""
        n = self._node(node_id)
        chain = []
        while n is not self._root and n.value is None:
            chain.append(n.id)
            assert n.parent is not None
            n = n.parent
        return chain[::-1]

    def start_load_back(self, node_id: int, device_slots: Any) -> LoadBackTicket:
        """Give the host-only path ending at ``node_id`` the device slots ``device_slots``.

        The nodes count as on device at once (marked pending and pinned); copy the ticket's
        ``host_slots`` to its ``device_slots``, then ``commit_load_back``.
        """
        self._check_owner()
        node = self._node(node_id)
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
        for f in op.fragments:
            f.pending = 0
            self._emit_stored(f, Medium.GPU)
        self._dec(op.fragments[-1])
        for f in op.fragments:
            self._refresh(f)

    def abort_load_back(self, op_id: int) -> list[np.ndarray]:
        """The H->D copy of ``op_id`` failed: the nodes go back to host only.

        Returns the device slots to free. Nothing can have built on the nodes meanwhile: while
        a load is in flight, matches report its nodes as host hits, inserts stop before them and
        locks on them are refused, so every fragment goes back to host only.
        """
        self._check_owner()
        op = self._pop_op(op_id, "load")
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
        swa_num_tokens = _check_count("swa_num_tokens", swa_num_tokens)
        mamba_num = _check_count("mamba_num", mamba_num)
        if self._aux:
            if swa_num_tokens and self._swa is None:
                raise InvalidInputError("swa_num_tokens given but the tree has no SWA component")
            if mamba_num and self._mamba is None:
                raise InvalidInputError("mamba_num given but the tree has no Mamba component")
            return hybrid.evict(self, num_tokens, swa_num_tokens, mamba_num)
        if swa_num_tokens or mamba_num:
            raise InvalidInputError(
                f"component targets (swa_num_tokens={swa_num_tokens}, mamba_num={mamba_num}) "
                "given to a FULL-only tree"
            )
        res = EvictResult()
        dq = self._queues[DLEAF]
        while res.num_evicted + res.pending_tokens < num_tokens:
            n = dq.pop()
            if n is None:
                break
            if n.host_value is not None:
                self._demote(n, res)
            elif self._write_back:
                res.backups.append(self._begin_backup(n, write_back=True))
                res.pending_tokens += n.ntok
            else:
                self._delete_subtree(n, res)
        return res

    def drop(self, node_id: int) -> EvictResult:
        """Delete an unlocked device leaf and its host-only subtree without a backup.

        Used when a write-back copy cannot get host memory. A node that is locked, in flight,
        has device children or pins host-locked descendants is kept (empty result).
        """
        self._check_owner()
        n = self._node(node_id)
        res = EvictResult()
        if self._aux:
            raise InvalidInputError("drop: hybrid trees have no write-back tier")
        if (
            n is self._root
            or n.value is None
            or n.lock_ref
            or n.pending
            or n.dchildren
            or n.host_lock_ref
        ):
            return res
        self._delete_subtree(n, res)
        return res

    def _demote(self, n: Node, res: EvictResult) -> None:
        res.device_frees.append(self._drop_device_value(n))
        res.num_evicted += n.ntok
        self._emit_removed(n, Medium.GPU)
        self._refresh(n)

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
            del self._nodes[n.id]
        self._detach(top)
        if top_on_device:
            parent.dchildren -= 1
        self._refresh(parent)

    def _detach(self, n: Node) -> None:
        parent = n.parent
        assert parent is not None
        ck = self._child_key(parent, n.key[: self._pb], n.ns)
        del parent.children[ck]
        n.parent = None

    def evict_host(self, num_tokens: int, *, reclaim_duplicates: bool | None = None) -> HostEvictResult:
        """Free at least ``num_tokens`` host tokens.

        Host-only leaves go first; then (or first, under write-back) host duplicates of nodes
        still on device lose their host copy. ``reclaim_duplicates=False`` never touches
        duplicates.
        """
        self._check_owner()
        num_tokens = _check_count("num_tokens", num_tokens)
        res = HostEvictResult()
        use_dups = True if reclaim_duplicates is None else reclaim_duplicates
        order = (HDUP, HLEAF) if self._write_back else (HLEAF, HDUP)
        for slot in order:
            if slot == HDUP and not use_dups:
                continue
            q = self._queues[slot]
            while res.num_evicted < num_tokens:
                n = q.pop()
                if n is None:
                    break
                host = n.host_value
                assert host is not None
                self._emit_removed(n, Medium.CPU_PINNED)
                res.host_frees.append(host)
                res.num_evicted += n.ntok
                self._host_size -= n.ntok
                n.host_value = None
                if slot == HLEAF:
                    parent = n.parent
                    assert parent is not None
                    for other in self._queues:
                        other.discard(n)
                    self._detach(n)
                    del self._nodes[n.id]
                    self._refresh(parent)
                else:
                    self._refresh(n)
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

    def iter_nodes(self) -> Iterator[Node]:
        """Every node but the root (read-only use: tests, digests, debugging)."""
        return (n for n in self._nodes.values() if n is not self._root)

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
        return RadixKey.from_bytes(b"".join(reversed(parts)), ns)

    def sanity_check(self) -> None:
        """Verify every invariant; raises AssertionError naming the first violation."""
        from asynccache.tree.invariants import check_tree

        check_tree(self)
        if self._aux:
            from asynccache.tree.components.invariants import check_components

            check_components(self)
