"""Request-level calls of the cache facade: admit, load back, extend, cache (un)finished
requests, abort; radix and streaming sessions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from asynccache.errors import ConfigError, InvalidInputError, PoolExhaustedError
from asynccache.retraction import RetractedKV
from asynccache.sessions import SessionTracker, StreamingSession
from asynccache.tree import LockReceipt, MatchResult, RadixKey, as_key
from asynccache.tree.results import EMPTY_SLOTS

if TYPE_CHECKING:
    from asynccache.cache import HierarchicalCache
    from asynccache.l3 import PrefetchOp


@dataclass(eq=False)
class CacheRequest:
    """A request's view of the cache.

    ``slots[i]`` is the device slot holding the KV of token ``i`` for the ``computed`` tokens so
    far; the first ``prefix_len`` slots belong to the tree (cached prefix, kept alive by
    ``receipt``), the rest to the request. ``spare`` holds allocated, not yet used slots of the
    request's last page. While ``pending_loads`` is not empty, wait for them
    (:meth:`HierarchicalCache.wait_loads`) before reading the prefix KV.
    """

    rid: str
    key: RadixKey
    slots: np.ndarray
    prefix_len: int
    last_node: int
    best_node: int
    host_hit_length: int
    receipt: LockReceipt | None
    host_receipt: LockReceipt | None = None  # pins the host hit until it is loaded or dropped
    pending_loads: tuple[int, ...] = ()
    spare: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)
    inserted_len: int = 0
    finished: bool = False
    priority: int = 0  # passed to every insert of this request (the "priority" policy uses it)
    session_id: str | None = None
    session_generation: int | None = None
    retracted: RetractedKV | None = None  # KV parked in host memory by HierarchicalCache.retract
    mamba_state: int | None = None  # hybrid: the request's own Mamba state slot
    swa_evicted: int = 0  # hybrid: SWA slots of tokens below this were freed (out of window)
    prefetch: PrefetchOp | None = None  # started by HierarchicalCache.begin_prefetch
    # The cache that admitted it: every request call checks it (another cache's request would
    # free and insert slots of the wrong pools).
    owner: Any = field(default=None, repr=False, compare=False)

    @property
    def computed(self) -> int:
        return len(self.slots)


class RequestsMixin:
    """Request helpers and sessions of :class:`~asynccache.HierarchicalCache`."""

    # ------------------------------------------------------------------ sessions
    def _session_tracker(self: HierarchicalCache) -> SessionTracker:
        self._check_open()
        if self.sessions is None:
            raise ConfigError("radix sessions need CacheConfig(enable_sessions=True)")
        return self.sessions

    def open_session(self: HierarchicalCache, session_id: str) -> int:
        """Start a new generation of a radix session; returns its generation number."""
        return self._session_tracker().open(session_id)

    def release_session(self: HierarchicalCache, session_id: str) -> int:
        """Close a radix session: its paths become ordinary eviction candidates again."""
        return self._session_tracker().release(session_id)

    def stream(self: HierarchicalCache, session_id: str) -> StreamingSession:
        """Open a streaming session: one request whose KV stays pinned across turns."""
        self._check_open()
        if session_id in self._streams:
            raise InvalidInputError(f"streaming session {session_id!r} is already open")
        s = StreamingSession(self, session_id, lambda s: self._forget_stream(s.session_id))
        self._streams[session_id] = s
        return s

    def _forget_stream(self: HierarchicalCache, session_id: str) -> None:
        self._streams.pop(session_id, None)

    @property
    def streaming_held_tokens(self: HierarchicalCache) -> int:
        """Device tokens held by open streaming sessions (not evictable while they are open)."""
        return sum(s.held_tokens for s in self._streams.values())

    # ------------------------------------------------------------------ request helpers
    def admit(self: HierarchicalCache, tokens: RadixKey | Any, rid: str | None = None, *,
              session_id: str | None = None, priority: int = 0) -> CacheRequest:
        """Match a new request and pin its cached prefix.

        ``session_id``: the radix session the request belongs to (needs ``enable_sessions``);
        when it finishes and is cached, its path is referenced for the session. ``priority``
        goes with every insert of the request (see the ``priority`` eviction policy).
        """
        self._check_open()
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidInputError(f"priority must be an int, got {priority!r}")
        gen = None
        if session_id is not None:
            if self.sessions is None:
                raise ConfigError("session_id needs CacheConfig(enable_sessions=True)")
            gen = self.sessions.ensure(session_id)
        key = as_key(tokens)
        mamba = self.hybrid is not None and self.hybrid.mamba_pool is not None
        m = self.match_prefix(key, cow_mamba=True) if mamba else self.match_prefix(key)
        if rid is None:
            self._next_rid += 1
            rid = f"req-{self._next_rid}"
        receipt = None if self.config.disable else self.tree.lock(m.last_device_node)
        host = self.tree.lock_host(m.best_node) if m.host_hit_length else None
        state = None
        if mamba:  # the request's own state: a copy of the matched one, or a fresh one
            cow = m.mamba_cow_slot
            state = self.mamba_copy_on_write(cow) if cow is not None else self.alloc_mamba_state()
            if state is None:
                if receipt is not None:
                    self.tree.unlock(receipt)
                raise PoolExhaustedError(
                    f"request {rid}: no Mamba state slot is free (all {self.config.mamba_states} "
                    f"are held by requests or locked nodes)"
                )
        return CacheRequest(
            rid=rid, key=key, slots=m.device_indices, prefix_len=m.device_prefix_len,
            last_node=m.last_device_node, best_node=m.best_node,
            host_hit_length=m.host_hit_length, receipt=receipt, host_receipt=host,
            pending_loads=m.pending_loads, priority=priority, session_id=session_id,
            session_generation=gen, mamba_state=state, owner=self,
        )

    def _rematch(self: HierarchicalCache, req: CacheRequest) -> None:
        """Refresh ``req`` from the tree's current state, moving its pins to the new match."""
        m = self.tree.match_prefix(req.key)
        dev = self.tree.lock(m.last_device_node)
        host = self.tree.lock_host(m.best_node) if m.host_hit_length else None
        self._release_pins(req)
        req.receipt, req.host_receipt = dev, host
        req.slots = m.device_indices
        req.prefix_len = m.device_prefix_len
        req.last_node = m.last_device_node
        req.best_node = m.best_node
        req.host_hit_length = m.host_hit_length
        req.pending_loads = m.pending_loads

    def _check_request(self: HierarchicalCache, req: Any) -> None:
        """``req`` is a request this cache admitted (else InvalidInputError naming it)."""
        if not isinstance(req, CacheRequest):
            raise InvalidInputError(
                f"expected a CacheRequest (from admit), got {type(req).__name__}: {req!r}"
            )
        if req.owner is not self:
            raise InvalidInputError(
                f"request {req.rid} was admitted by another cache; it can only be used there"
            )

    def _check_active(self: HierarchicalCache, req: CacheRequest) -> None:
        self._check_request(req)
        if req.finished:
            raise InvalidInputError(f"request {req.rid} is already finished")
        if req.retracted is not None:
            raise InvalidInputError(f"request {req.rid} is retracted: restore it first")

    def _release_pins(self: HierarchicalCache, req: CacheRequest) -> None:
        if req.receipt is not None:
            self.tree.unlock(req.receipt)
            req.receipt = None
        if req.host_receipt is not None:
            self.tree.unlock_host(req.host_receipt)
            req.host_receipt = None

    async def load_back_request(self: HierarchicalCache, req: CacheRequest, *, mem_quota: int | None = None) -> int:
        """Bring ``req``'s cached prefix onto the device before it computes anything.

        Waits for load-backs of its prefix started by other requests, then loads its own host hit
        if worth it (threshold, ``mem_quota``, room). Returns how many tokens the device prefix
        grew by; ``req.slots`` / ``req.prefix_len`` follow. The host hit stays pinned until then.
        """
        self._check_open()
        self._check_active(req)
        if req.computed != req.prefix_len:
            raise InvalidInputError(
                f"request {req.rid}: load_back_request must come before it computes tokens"
            )
        before = req.prefix_len
        if self._buffer is not None:  # buffer-only host: load the bounce parked for req
            self._rematch(req)
            if await self._buffer.load_staged(req, mem_quota):
                self._rematch(req)
            return req.prefix_len - before
        try:
            for _ in range(16):
                if req.pending_loads:
                    await self.wait_loads(req.pending_loads)
                    self._rematch(req)
                    continue
                if not self._load_size(self._match_of(req), mem_quota):
                    break
                state = (req.prefix_len, req.host_hit_length)
                lb = await self.load_back(self._match_of(req), mem_quota=mem_quota)
                if lb is not None:
                    old = req.receipt
                    req.receipt, lb.receipt = lb.receipt, None
                    if old is not None:
                        self.tree.unlock(old)
                    req.slots = lb.device_indices
                    req.prefix_len = len(lb.device_indices)
                    req.last_node = req.best_node = lb.node_id
                    req.host_hit_length = 0
                    break
                self._rematch(req)
                if not req.pending_loads and (req.prefix_len, req.host_hit_length) == state:
                    break  # skipped (no room): compute instead
        finally:
            if req.host_receipt is not None:
                self.tree.unlock_host(req.host_receipt)
                req.host_receipt = None
        return req.prefix_len - before

    @staticmethod
    def _match_of(req: CacheRequest) -> MatchResult:
        return MatchResult(req.slots, req.prefix_len, req.last_node, req.best_node,
                           req.host_hit_length, req.pending_loads)

    async def extend(self: HierarchicalCache, req: CacheRequest, num_tokens: int) -> np.ndarray:
        """Reserve device slots for the next ``num_tokens`` tokens of ``req``; returns them.

        The caller writes the KV of those tokens into the returned slots.
        """
        self._check_open()
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer) or (
            num_tokens < 0
        ):
            raise InvalidInputError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        num_tokens = int(num_tokens)
        self._check_active(req)
        spare = req.spare
        if num_tokens <= len(spare):
            new, req.spare = spare[:num_tokens], spare[num_tokens:]
        else:
            pages = await self.alloc_device(num_tokens - len(spare))
            both = np.concatenate([spare, pages])
            new, req.spare = both[:num_tokens], both[num_tokens:]
        req.slots = np.concatenate([req.slots, new])
        return new

    def cache_unfinished_req(self: HierarchicalCache, req: CacheRequest) -> None:
        """Cache what ``req`` computed so far and keep running: its slots now point at the tree's."""
        self._check_open()
        self._check_active(req)
        if self.config.disable or req.computed == req.prefix_len:
            return
        key = req.key[: req.computed]
        if self.hybrid is not None:
            self._cache_unfinished_hybrid(req, key)
            return
        res = self.insert(key, req.slots, prev_prefix_len=req.prefix_len,
                          inserted_len=req.inserted_len, priority=req.priority)
        cached = res.cached_len
        m = self.tree.match_prefix(key)
        assert m.device_prefix_len == cached, (m.device_prefix_len, cached)
        req.slots = np.concatenate([m.device_indices, req.slots[cached:]])
        req.pending_loads = m.pending_loads
        receipt = self.tree.lock(res.last_node)
        if req.receipt is not None:
            self.tree.unlock(req.receipt)
        req.receipt = receipt
        req.prefix_len = cached
        req.inserted_len = cached
        req.last_node = res.last_node

    def _cache_unfinished_hybrid(self: HierarchicalCache, req: CacheRequest, key: RadixKey) -> None:
        """Hybrid ``cache_unfinished_req``: a checkpoint copy of the request's Mamba state goes
        to the tree when the cached length is the computed length; the request keeps its own."""
        hy = self.hybrid
        assert hy is not None
        if self.config.swa_free_out_of_window and self.config.sliding_window:
            self.release_swa_window(req)
        checkpoint = None
        if req.mamba_state is not None and req.computed % self.page_size == 0:
            checkpoint = hy.copy_on_write(req.mamba_state)  # None when the pool is full: skip
        res = self.insert(key, req.slots, prev_prefix_len=req.prefix_len,
                          inserted_len=req.inserted_len, priority=req.priority,
                          swa_evicted_seqlen=min(req.swa_evicted, req.computed),
                          mamba_value=checkpoint)
        cached = res.cached_len
        tree_slots = self.tree.tail_slots(res.last_node, cached) if cached else EMPTY_SLOTS
        assert tree_slots is not None and len(tree_slots) == cached
        req.slots = np.concatenate([tree_slots, req.slots[cached:]])
        # The request keeps its own state: no need to pin the tree's.
        receipt = self.tree.lock(res.last_node, skip=("mamba",) if hy.mamba_pool else ())
        if req.receipt is not None:
            self.tree.unlock(req.receipt)
        req.receipt = receipt
        req.prefix_len = req.inserted_len = cached
        req.last_node = res.last_node

    def release_swa_window(self: HierarchicalCache, req: CacheRequest) -> int:
        """Hybrid: free the SWA slots of ``req``'s own tokens that slid out of the window,
        keeping a cushion of window + one page; returns how many were freed."""
        self._check_open()
        self._check_request(req)
        hy = self._hybrid_slots()
        window = self.config.sliding_window
        if not window:
            raise InvalidInputError("release_swa_window: the cache has no SWA component")
        ps = self.page_size
        upto = (req.computed - window - ps) // ps * ps
        start = max(req.swa_evicted, req.prefix_len)
        if upto <= start:
            return 0
        assert hy.swa_map is not None
        hy.free_swa(hy.swa_map.translate(req.slots[start:upto]))
        req.swa_evicted = upto
        return upto - start

    def cache_finished_req(self: HierarchicalCache, req: CacheRequest, *, insert: bool = True) -> None:
        """Cache ``req``'s KV (unless ``insert=False``, e.g. on abort), free the rest, unlock."""
        self._check_open()
        self._check_request(req)
        if req.finished:
            raise InvalidInputError(f"request {req.rid} is already finished")
        self.discard_retracted(req)
        self._drop_prefetch(req)
        own_from = req.prefix_len
        if insert and not self.config.disable and req.computed > 0:
            extra: dict[str, Any] = {}
            if self.hybrid is not None:
                extra["swa_evicted_seqlen"] = min(req.swa_evicted, req.computed)
                if req.mamba_state is not None and req.computed % self.page_size == 0:
                    extra["mamba_value"], req.mamba_state = req.mamba_state, None  # to the tree
            res = self.insert(req.key[: req.computed], req.slots, prev_prefix_len=req.prefix_len,
                              inserted_len=req.inserted_len, priority=req.priority, **extra)
            own_from = max(own_from, res.cached_len)
            if req.session_id is not None and self.sessions is not None:
                self.sessions.register(req.session_id, req.session_generation, res.last_node)
        self.free_device(np.concatenate([req.slots[own_from:], req.spare]))
        if req.mamba_state is not None:
            self.free_mamba_state(req.mamba_state)
            req.mamba_state = None
        self._release_pins(req)
        if self._buffer is not None:
            self._buffer.release_request(req)
        req.spare = EMPTY_SLOTS
        req.finished = True

    def abort_req(self: HierarchicalCache, req: CacheRequest) -> None:
        """Drop a request without caching its KV."""
        self.cache_finished_req(req, insert=False)
