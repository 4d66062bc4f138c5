"""Retraction backup: park a preempted request's KV in host memory and bring it back.

When a scheduler preempts (retracts) a running request to free device memory, ``retract``
copies the request's KV (every computed token, in whole pages) to host slots and releases its
device slots and locks. ``restore`` later copies it into fresh device slots, bit-exact, and the
request carries on; ``discard`` drops it. (a service over the engine's pools and copy engine).

Hybrid caches (SWA / Mamba components, with their host tier): ``retract`` also copies the SWA
KV of the request's last window (the tokens from ``swa_from``, page-aligned, whose SWA slots are
live) to the host SWA pool and the request's own Mamba state to the host state pool, all or
nothing; ``restore`` allocates FULL-only slots below ``swa_from``, FULL+SWA pairs from there and
a fresh state, copies all of it back, and sets ``req.swa_evicted = swa_from`` (the SWA floor the
request's inserts pass to the tree).

Several ranks: the copies of a ``retract`` / ``restore`` (all parts as one item) are retired at
an agreed tick; one that failed on any rank raises :class:`TransferError` on every rank.

Cancellation: a cancelled ``retract`` leaves the request as it was (the host copy is freed
when the copy lands); a cancelled ``restore`` leaves the backup held (the device slots are
freed when the copy lands).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial

import numpy as np

from asynccache.attachment import StorageAttachment
from asynccache.engine import HybridOps, LoadBacks, Tiering
from asynccache.errors import ConfigError, InvalidInputError, PoolExhaustedError
from asynccache.logs import get_logger
from asynccache.request import CacheRequest, RetractedKV, check_request, release_pins
from asynccache.transfers.handles import CopyHandle
from asynccache.transfers.hybrid_copies import GroupHandle
from asynccache.tree.results import EMPTY_SLOTS

__all__ = ["RetractedKV", "Retraction"]

_log = get_logger("retraction")


class Retraction:
    """``retract`` / ``restore`` / ``discard`` of one cache's requests."""

    def __init__(self, tiering: Tiering, loads: LoadBacks, hybrid: HybridOps,
                 storage: StorageAttachment, owner: object) -> None:
        self._t = tiering
        self._p = tiering.parts
        self.tree = tiering.tree
        self._loads = loads
        self._hybrid_ops = hybrid
        self._storage = storage
        self._owner = owner
        self.hybrid = tiering.parts.hybrid
        self._tier = tiering.parts.hybrid_tier

    async def retract(self, req: CacheRequest) -> RetractedKV:
        """Copy ``req``'s KV to host and free its device slots and locks."""
        self._check_retraction(req)
        if req.retracted is not None:
            raise InvalidInputError(f"request {req.rid} is already retracted")
        if req.pending_loads:
            await self._loads.wait_loads(req.pending_loads)
        slots = np.concatenate([req.slots, req.spare])
        swa_from, swa_dev = self._swa_window(req, slots)
        state = req.mamba_state if self.hybrid is not None else None
        backup = self._take_retraction_host(req, len(slots), swa_from, len(swa_dev), state)
        tier = self._tier
        submits: list[Callable[[], CopyHandle]] = []
        if len(slots):
            submits.append(lambda: self._t.submit_d2h(slots, backup.host_slots))
        if len(swa_dev):
            assert tier is not None and tier.swa_engine is not None
            engine = tier.swa_engine
            submits.append(lambda: self._t.copies.track(
                engine.submit_d2h(swa_dev, backup.swa_host_slots)))
        if state is not None:
            assert tier is not None and tier.states is not None
            states = tier.states
            submits.append(lambda: self._t.copies.track(
                states.submit_d2h([state], [backup.mamba_host_slot])))
        release = partial(self._free_backup_host, backup)
        handle = self._submit_parts(submits, on_fail=release)
        if handle is not None:
            try:
                await self._t.commits.await_copy(handle, release)
            except Exception:
                release()
                raise
        self._storage.release_request(req)
        self._storage.drop_prefetch(req)
        release_pins(self.tree, req)
        own = np.concatenate([req.slots[req.prefix_len :], req.spare])
        self._t.free(own, req.tag)  # hybrid: with the SWA slots still paired
        if state is not None:
            assert self.hybrid is not None
            self.hybrid.free_mamba(state)
            req.mamba_state = None
        req.slots = req.spare = EMPTY_SLOTS
        req.prefix_len = req.host_hit_length = req.swa_evicted = 0
        req.last_node = req.best_node = self.tree.root_id
        req.pending_loads = ()
        req.retracted = backup
        _log.info("retracted", rid=req.rid, tokens=backup.num_tokens,
                  swa_tokens=len(backup.swa_host_slots), state=state is not None)
        return backup

    async def restore(self, req: CacheRequest) -> None:
        """Copy ``req``'s retracted KV into fresh device slots; the request continues from there."""
        self._check_retraction(req)
        backup = req.retracted
        if backup is None or backup.state != "held":
            raise InvalidInputError(f"request {req.rid} has no retracted KV to restore")
        backup.state = "restoring"
        try:
            slots, state = await self._alloc_restore(req, backup)
        except BaseException:
            backup.state = "held"
            raise
        tier = self._tier
        submits: list[Callable[[], CopyHandle]] = []
        if len(slots):
            submits.append(lambda: self._t.submit_h2d(backup.host_slots, slots))
        if len(backup.swa_host_slots):
            assert tier is not None and tier.swa_engine is not None
            assert self.hybrid is not None and self.hybrid.swa_map is not None
            engine = tier.swa_engine
            swa_dev = self.hybrid.swa_map.translate(slots[backup.swa_from :])
            submits.append(lambda: self._t.copies.track(
                engine.submit_h2d(backup.swa_host_slots, swa_dev)))
        if state is not None:
            assert tier is not None and tier.states is not None
            states = tier.states
            submits.append(lambda: self._t.copies.track(
                states.submit_h2d([backup.mamba_host_slot], [state])))

        def release() -> None:
            self._t.free(slots, req.tag)
            if state is not None:
                assert self.hybrid is not None
                self.hybrid.free_mamba(state)

        try:
            handle = self._submit_parts(submits, on_fail=release)
        except BaseException:
            backup.state = "held"
            raise
        if handle is not None:
            try:
                await self._t.commits.await_copy(handle, release)
            except BaseException as exc:
                backup.state = "held"
                if not isinstance(exc, asyncio.CancelledError):
                    release()
                raise
        self._free_backup_host(backup)
        backup.state = "restored"
        req.retracted = None
        req.slots, req.spare = slots[: backup.num_tokens], slots[backup.num_tokens :]
        req.prefix_len = 0
        req.last_node = req.best_node = self.tree.root_id
        req.mamba_state = state
        req.swa_evicted = backup.swa_from
        _log.info("restored", rid=req.rid, tokens=backup.num_tokens)

    def discard(self, req: CacheRequest) -> None:
        """Drop ``req``'s retracted KV (the request will recompute or is being aborted)."""
        check_request(req, self._owner)
        backup = req.retracted
        if backup is None:
            return
        if backup.state == "restoring":
            raise InvalidInputError(f"request {req.rid} is being restored; await it first")
        req.retracted = None
        backup.state = "discarded"
        self._free_backup_host(backup)

    # ------------------------------------------------------------------ helpers
    def _check_retraction(self, req: CacheRequest) -> None:
        check_request(req, self._owner)
        if not self._p.config.retraction_backup:
            raise ConfigError("retraction needs CacheConfig(retraction_backup=True)")
        if req.finished:
            raise InvalidInputError(f"request {req.rid} is already finished")

    def _swa_window(self, req: CacheRequest,
                    slots: np.ndarray) -> tuple[int, np.ndarray]:
        """(``swa_from``, SWA slots of ``slots[swa_from:]``): the request's last window of
        tokens (from a page boundary), past any token whose SWA slot is no longer live."""
        hy = self.hybrid
        if hy is None or hy.swa_map is None:
            return 0, EMPTY_SLOTS
        ps = self._p.page_size
        lo = max(0, req.computed - self._p.config.sliding_window) // ps * ps
        pairs = hy.swa_map.full_to_swa[slots[lo:]]
        dead = np.flatnonzero(pairs < 0)
        if len(dead):  # freed or an SWA tombstone of the tree: start after it
            lo += -(-(int(dead[-1]) + 1) // ps) * ps
            pairs = hy.swa_map.full_to_swa[slots[lo:]]
        return lo, pairs

    def _take_retraction_host(self, req: CacheRequest, n: int,
                              swa_from: int, swa_n: int, state: int | None) -> RetractedKV:
        """Host slots for every part of a retraction, all or nothing (evicting host-only leaves
        when short); raises :class:`PoolExhaustedError` naming each pool that falls short."""
        assert self._p.host_pool is not None
        tier = self._tier
        short: list[str] = []
        host = self._t.take_host(n) if n else EMPTY_SLOTS
        if host is None:
            short.append(f"{n} host slots needed, "
                         f"{self._p.host_pool.allocator.available_size} free after host eviction")
        swa_host: np.ndarray | None = EMPTY_SLOTS
        if swa_n:
            assert tier is not None
            swa_host = tier.take_host("swa", swa_n, self._t.evict_host)
            if swa_host is None:
                short.append(f"{swa_n} host SWA slots needed, {tier.host_available('swa')} free "
                             "after host eviction")
        mamba_host: np.ndarray | None = None
        if state is not None:
            assert tier is not None
            mamba_host = tier.take_host("mamba", 1, self._t.evict_host)
            if mamba_host is None:
                short.append(f"1 host Mamba state needed, {tier.host_available('mamba')} free "
                             "after host eviction")
        backup = RetractedKV(
            req.rid, req.computed, host if host is not None else EMPTY_SLOTS, swa_from=swa_from,
            swa_host_slots=swa_host if swa_host is not None else EMPTY_SLOTS,
            mamba_host_slot=int(mamba_host[0]) if mamba_host is not None else None)
        if short:
            self._free_backup_host(backup)
            raise PoolExhaustedError(f"cannot retract request {req.rid}: " + "; ".join(short))
        return backup

    def _free_backup_host(self, backup: RetractedKV) -> None:
        """Give back every host slot of ``backup`` (FULL KV, SWA KV, Mamba state)."""
        self._t.free_host(backup.host_slots)
        parts = backup.component_host_slots
        if parts:
            assert self._tier is not None
            for name, slots in parts.items():
                self._tier.give_host(name, slots, free=True)

    async def _alloc_restore(self, req: CacheRequest,
                             backup: RetractedKV) -> tuple[np.ndarray, int | None]:
        """Device slots for a restore (FULL-only below ``swa_from``, FULL+SWA pairs from there)
        and a Mamba state; on any failure or cancellation nothing stays taken."""
        n = len(backup.host_slots)
        hy = self.hybrid
        lo = backup.swa_from if hy is not None and hy.swa_map is not None else 0
        slots = await self._t.alloc(n, swa_tokens=n - lo, owner=req.tag) if n else EMPTY_SLOTS
        state = None
        if backup.mamba_host_slot is not None:
            state = self._hybrid_ops.alloc_mamba_state()
            if state is None:
                self._t.free(slots, req.tag)
                raise PoolExhaustedError(
                    f"cannot restore request {req.rid}: no Mamba state slot is free (all "
                    f"{self._p.config.mamba_states} are held by requests or locked nodes)"
                )
        return slots, state

    def _submit_parts(self, submits: list[Callable[[], CopyHandle]], *,
                      on_fail: Callable[[], None]) -> CopyHandle | None:
        """Submit the copies of one operation and join them into one handle that ``flush``
        waits for (so callbacks on it have run by then); if a submission raises, ``on_fail``
        runs once the copies already submitted have landed."""
        handles: list[CopyHandle] = []
        try:
            for submit in submits:
                handles.append(submit())
        except BaseException:
            if handles:
                self._t.copies.track(GroupHandle(handles)).add_done_callback(lambda _h: on_fail())
            else:
                on_fail()
            raise
        if not handles:
            return None
        return handles[0] if len(handles) == 1 else self._t.copies.track(GroupHandle(handles))
