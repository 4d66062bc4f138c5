"""Request flow: admit, load back, extend, cache (un)finished requests, abort; radix and
streaming sessions. A request is a :class:`~asynccache.request.CacheRequest`."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from asynccache.attachment import StorageAttachment
from asynccache.engine import HybridOps, LoadBack, LoadBacks, Tiering
from asynccache.engine.ledger import CALLER
from asynccache.errors import ConfigError, InvalidInputError, PoolExhaustedError
from asynccache.request import CacheRequest, check_active, check_request, release_pins, rematch
from asynccache.retraction import Retraction
from asynccache.sessions import SessionTracker, StreamingSession
from asynccache.tree import RadixKey
from asynccache.tree.results import EMPTY_SLOTS

__all__ = ["CacheRequest", "RequestFlow"]


class RequestFlow:
    """The request calls of one cache (``owner``: the cache, stamped on every request)."""

    def __init__(self, tiering: Tiering, loads: LoadBacks, hybrid: HybridOps,
                 storage: StorageAttachment, retraction: Retraction, owner: Any) -> None:
        self._t = tiering
        self._p = tiering.parts
        self.tree = tiering.tree
        self._loads = loads
        self._hybrid = hybrid
        self._storage = storage
        self._retraction = retraction
        self._owner = owner
        config = self._p.config
        self.sessions = SessionTracker(self.tree) if config.enable_sessions else None
        self._streams: dict[str, StreamingSession] = {}
        self._next_rid = 0
        self._tags = itertools.count(CALLER + 1)  # each request's own slot-ledger tag

    # ------------------------------------------------------------------ sessions
    def session_tracker(self) -> SessionTracker:
        if self.sessions is None:
            raise ConfigError("radix sessions need CacheConfig(enable_sessions=True)")
        return self.sessions

    def stream(self, session_id: str) -> StreamingSession:
        if session_id in self._streams:
            raise InvalidInputError(f"streaming session {session_id!r} is already open")
        s = StreamingSession(self._owner, session_id, self._forget_stream, self._t.key)
        self._streams[session_id] = s
        return s

    def _forget_stream(self, s: StreamingSession) -> None:
        self._streams.pop(s.session_id, None)

    @property
    def streaming_held_tokens(self) -> int:
        return sum(s.held_tokens for s in self._streams.values())

    # ------------------------------------------------------------------ requests
    def admit(self, tokens: RadixKey | Any, rid: str | None = None, *,
              session_id: str | None = None, priority: int = 0) -> CacheRequest:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidInputError(f"priority must be an int, got {priority!r}")
        sessions = self.sessions
        if session_id is not None:
            if sessions is None:
                raise ConfigError("session_id needs CacheConfig(enable_sessions=True)")
            sessions.generation(session_id)  # checks the id; the session opens on success
        t = self._t
        key = self.tree.key_of(t.key(tokens))  # (EAGLE: the bigram view, built once)
        hy = self._p.hybrid
        mamba = hy is not None and hy.mamba_pool is not None
        m = t.match_prefix(key, cow_mamba=mamba)
        if rid is None:
            self._next_rid += 1
            rid = f"req-{self._next_rid}"
        receipt = None if self._p.config.disable else self.tree.lock(m.last_device_node)
        host = self.tree.lock_host(m.best_node) if m.host_hit_length else None
        state = None
        if mamba:  # the request's own state: a copy of the matched one, or a fresh one
            cow = m.mamba_cow_slot
            ops = self._hybrid
            state = ops.mamba_copy_on_write(cow) if cow is not None else ops.alloc_mamba_state()
            if state is None:  # nothing may stay locked: admission failed
                if receipt is not None:
                    self.tree.unlock(receipt)
                if host is not None:
                    self.tree.unlock_host(host)
                raise PoolExhaustedError(
                    f"request {rid}: no Mamba state slot is free (all "
                    f"{self._p.config.mamba_states} are held by requests or locked nodes)"
                )
        gen = sessions.ensure(session_id) if session_id is not None and sessions else None
        return CacheRequest(
            rid=rid, key=key, slots=m.device_indices, prefix_len=m.device_prefix_len,
            last_node=m.last_device_node, best_node=m.best_node,
            host_hit_length=m.host_hit_length, receipt=receipt, host_receipt=host,
            pending_loads=m.pending_loads, priority=priority, session_id=session_id,
            session_generation=gen, mamba_state=state, owner=self._owner,
            tag=next(self._tags),
        )

    def check(self, req: Any) -> CacheRequest:
        return check_request(req, self._owner)

    def check_active(self, req: Any) -> CacheRequest:
        return check_active(req, self._owner)

    async def load_back_request(self, req: CacheRequest, mem_quota: int | None) -> int:
        self.check_active(req)
        if req.computed != req.prefix_len:
            raise InvalidInputError(
                f"request {req.rid}: load_back_request must come before it computes tokens"
            )
        staged = await self._storage.load_staged(req, mem_quota)
        if staged is not None:  # buffer-only host: the bounce parked for req
            return staged
        before = req.prefix_len
        loads = self._loads
        try:
            for _ in range(16):
                if req.pending_loads:
                    await loads.wait_loads(req.pending_loads)
                    rematch(self.tree, req)
                    continue
                if not loads.load_size(req.match(), mem_quota):
                    break
                state = (req.prefix_len, req.host_hit_length)
                lb = await loads.load_back(req.match(), mem_quota=mem_quota)
                if lb is not None:
                    self._take_load(req, lb)
                    break
                rematch(self.tree, req)
                if not req.pending_loads and (req.prefix_len, req.host_hit_length) == state:
                    break  # skipped (no room): compute instead
        finally:
            if req.host_receipt is not None:
                self.tree.unlock_host(req.host_receipt)
                req.host_receipt = None
        return req.prefix_len - before

    def begin_load_back_request(self, req: CacheRequest,
                                mem_quota: int | None) -> LoadBack | None:
        self.check_active(req)
        if req.computed != req.prefix_len:
            raise InvalidInputError(
                f"request {req.rid}: begin_load_back_request must come before it computes tokens"
            )
        if req.pending_loads or not self._loads.load_size(req.match(), mem_quota):
            return None
        lb = self._loads.begin_load_back(req.match(), mem_quota=mem_quota)
        if lb is None:
            return None
        # The request's prefix is the load's device slots from now on: the tree owns them and
        # the load protects them until it commits; finish_load_back_request moves the pins.
        req.slots = lb.device_indices
        req.prefix_len = len(lb.device_indices)
        if req.host_receipt is not None:  # the load pins its host copy itself
            self.tree.unlock_host(req.host_receipt)
            req.host_receipt = None
        return lb

    async def finish_load_back_request(self, req: CacheRequest, lb: LoadBack) -> None:
        self.check_active(req)
        if req.computed != req.prefix_len or len(req.spare):
            raise InvalidInputError(
                f"request {req.rid}: finish_load_back_request must come before extend"
            )
        try:
            await lb.wait()
        except BaseException:
            # Failed or cancelled: the load gives its lock up (a failed one its slots too);
            # the request goes back to what the tree holds now.
            self._loads.release_load(lb)
            rematch(self.tree, req)
            raise
        self._take_load(req, lb)

    def _take_load(self, req: CacheRequest, lb: LoadBack) -> None:
        """A committed load-back of ``req``'s host hit: its prefix is the loaded one, pinned
        by the load's lock (which replaces the request's)."""
        old, req.receipt, lb.receipt = req.receipt, lb.receipt, None
        if old is not None:
            self.tree.unlock(old)
        req.slots = lb.device_indices
        req.prefix_len = len(lb.device_indices)
        req.last_node = req.best_node = lb.node_id
        req.host_hit_length = 0

    async def extend(self, req: CacheRequest, num_tokens: Any) -> np.ndarray:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer) or (
            num_tokens < 0
        ):
            raise InvalidInputError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        num_tokens = int(num_tokens)
        self.check_active(req)
        spare = req.spare
        if num_tokens <= len(spare):
            new, req.spare = spare[:num_tokens], spare[num_tokens:]
        else:
            pages = await self._t.alloc(self._t.round_up(num_tokens - len(spare)),
                                        owner=req.tag)
            both = np.concatenate([spare, pages])
            new, req.spare = both[:num_tokens], both[num_tokens:]
        req.slots = np.concatenate([req.slots, new])
        return new

    def _insert(self, req: CacheRequest, **extra: Any) -> Any:
        key = self._t.key(req.key[: req.computed])  # (a streaming turn's tokens are new)
        slots = req.slots
        if key.is_bigram and len(key) < len(slots):
            # EAGLE: computed positions past the key's last bigram (the last raw token's
            # position, whose bigram needs the next token) stay the request's.
            slots = slots[: len(key)]
        return self._t.insert(key, slots, prev_prefix_len=req.prefix_len,
                              inserted_len=req.inserted_len, priority=req.priority,
                              owner=req.tag, **extra)

    def _state_fits(self, req: CacheRequest) -> bool:
        """The request's Mamba state (after its ``computed`` tokens) belongs on the insert's
        last node: the insert covers exactly ``computed`` positions. (An EAGLE key never does:
        it holds one bigram fewer than the positions computed.)"""
        n = req.computed
        return n % self._p.page_size == 0 and (not req.key.is_bigram or len(req.key) >= n)

    def cache_unfinished_req(self, req: CacheRequest) -> None:
        self.check_active(req)
        if self._p.config.disable or req.computed == req.prefix_len:
            return
        hy = self._p.hybrid
        extra: dict[str, Any] = {}
        skip: tuple[str, ...] = ()
        if hy is not None:
            # A checkpoint copy of the request's Mamba state goes to the tree when the cached
            # length is the computed length; the request keeps its own (so the lock skips it).
            config = self._p.config
            if config.swa_free_out_of_window and config.sliding_window:
                self.release_swa_window(req)
            checkpoint = None
            if req.mamba_state is not None and self._state_fits(req):
                checkpoint = hy.copy_on_write(req.mamba_state)  # None when the pool is full
            extra = {"swa_evicted_seqlen": min(req.swa_evicted, req.computed),
                     "mamba_value": checkpoint}
            skip = ("mamba",) if hy.mamba_pool else ()
        res = self._insert(req, **extra)
        cached = res.cached_len
        if hy is None:
            m = self.tree.match_prefix(req.key[: req.computed])
            assert m.device_prefix_len == cached, (m.device_prefix_len, cached)
            tree_slots, req.pending_loads = m.device_indices, m.pending_loads
        else:
            got = self.tree.tail_slots(res.last_node, cached) if cached else EMPTY_SLOTS
            assert got is not None and len(got) == cached
            tree_slots = got
        req.slots = np.concatenate([tree_slots, req.slots[cached:]])
        receipt = self.tree.lock(res.last_node, skip=skip)
        if req.receipt is not None:
            self.tree.unlock(req.receipt)
        req.receipt = receipt
        req.prefix_len = req.inserted_len = cached
        req.last_node = res.last_node

    def release_swa_window(self, req: CacheRequest) -> int:
        self.check(req)
        hy = self._hybrid.slots()
        window = self._p.config.sliding_window
        if not window:
            raise InvalidInputError("release_swa_window: the cache has no SWA component")
        ps = self._p.page_size
        upto = (req.computed - window - ps) // ps * ps
        start = max(req.swa_evicted, req.prefix_len)
        if upto <= start:
            return 0
        assert hy.swa_map is not None
        hy.free_swa(hy.swa_map.translate(req.slots[start:upto]))
        req.swa_evicted = upto
        return upto - start

    def cache_finished_req(self, req: CacheRequest, *, insert: bool = True) -> None:
        self.check(req)
        if req.finished:
            raise InvalidInputError(f"request {req.rid} is already finished")
        own = np.concatenate([req.slots[req.prefix_len :], req.spare])
        pages = self._t.ledger.check(own, f"request {req.rid}'s slots", req.tag)  # before any change
        self._retraction.discard(req)
        self._storage.drop_prefetch(req)
        own_from = req.prefix_len
        if insert and not self._p.config.disable and req.computed > 0:
            extra: dict[str, Any] = {}
            if self._p.hybrid is not None:
                extra["swa_evicted_seqlen"] = min(req.swa_evicted, req.computed)
                if req.mamba_state is not None and self._state_fits(req):
                    extra["mamba_value"], req.mamba_state = req.mamba_state, None  # to the tree
            try:
                res = self._insert(req, **extra)
            except BaseException:
                req.mamba_state = extra.get("mamba_value", req.mamba_state)  # still the request's
                raise
            own_from = max(own_from, res.cached_len)
            if req.session_id is not None and self.sessions is not None:
                self.sessions.register(req.session_id, req.session_generation, res.last_node)
        cut = own_from - req.prefix_len  # (whole pages) the insert adopted own[:cut]
        self._t.free_checked(own[cut:], pages[cut // self._p.page_size :])
        if req.mamba_state is not None:
            self._hybrid.free_mamba_state(req.mamba_state)
            req.mamba_state = None
        release_pins(self.tree, req)
        self._storage.release_request(req)
        req.spare = EMPTY_SLOTS
        req.finished = True
