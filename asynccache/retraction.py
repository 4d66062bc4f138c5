"""Retraction backup: park a preempted request's KV in host memory and bring it back.

When a scheduler preempts (retracts) a running request to free device memory, ``retract``
copies the request's KV (every computed token, in whole pages) to host slots and releases its
device slots and locks. ``restore`` later copies it into fresh device slots, bit-exact, and the
request carries on; ``discard`` drops it. Part of :class:`~asynccache.HierarchicalCache`
(a mixin, so the facade stays one object with one set of pools and one copy engine).

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
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from asynccache.errors import ConfigError, InvalidInputError, PoolExhaustedError, TransferError
from asynccache.loadback import copy_error
from asynccache.logs import get_logger
from asynccache.transfers.handles import CopyHandle
from asynccache.transfers.hybrid_copies import GroupHandle
from asynccache.tree.results import EMPTY_SLOTS

if TYPE_CHECKING:
    from asynccache.cache import HierarchicalCache
    from asynccache.requests import CacheRequest

_log = get_logger("retraction")


@dataclass(eq=False)
class RetractedKV:
    """A request's KV parked in host memory: ``num_tokens`` tokens in ``host_slots``.

    Hybrid caches: ``swa_host_slots`` hold the SWA KV of the tokens from ``swa_from`` on (to the
    end of ``host_slots``), ``mamba_host_slot`` the request's Mamba state (None: none).
    """

    rid: str
    num_tokens: int
    host_slots: np.ndarray
    state: str = "held"  # held | restoring | restored | discarded
    swa_from: int = 0
    swa_host_slots: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)
    mamba_host_slot: int | None = None

    @property
    def component_host_slots(self) -> dict[str, np.ndarray]:
        """The hybrid components' host slots (only the components the backup has)."""
        out: dict[str, np.ndarray] = {}
        if len(self.swa_host_slots):
            out["swa"] = self.swa_host_slots
        if self.mamba_host_slot is not None:
            out["mamba"] = np.array([self.mamba_host_slot], dtype=np.int64)
        return out


class RetractionMixin:
    """``retract`` / ``restore`` / ``discard_retracted`` of the cache facade."""

    async def retract(self: HierarchicalCache, req: CacheRequest) -> RetractedKV:
        """Copy ``req``'s KV to host and free its device slots and locks.

        Hybrid caches also copy the SWA KV of its last window and its own Mamba state, and free
        them on the device. Raises :class:`PoolExhaustedError` naming every host pool that
        cannot hold its part even after evicting host-only leaves (the request is then
        unchanged: all or nothing).
        """
        self._check_retraction(req)
        if req.retracted is not None:
            raise InvalidInputError(f"request {req.rid} is already retracted")
        if req.pending_loads:
            await self.wait_loads(req.pending_loads)
        slots = np.concatenate([req.slots, req.spare])
        swa_from, swa_dev = self._swa_window(req, slots)
        state = req.mamba_state if self.hybrid is not None else None
        backup = self._take_retraction_host(req, len(slots), swa_from, len(swa_dev), state)
        tier = self.hybrid.tier if self.hybrid is not None else None
        submits: list[Callable[[], CopyHandle]] = []
        if len(slots):
            submits.append(lambda: self.engine_submit_d2h(slots, backup.host_slots))
        if len(swa_dev):
            assert tier is not None and tier.swa_engine is not None
            engine = tier.swa_engine
            submits.append(lambda: self._track_copy(
                engine.submit_d2h(swa_dev, backup.swa_host_slots)))
        if state is not None:
            assert tier is not None and tier.states is not None
            states = tier.states
            submits.append(lambda: self._track_copy(
                states.submit_d2h([state], [backup.mamba_host_slot])))
        release = partial(self._free_backup_host, backup)
        handle = self._submit_parts(submits, on_fail=release)
        if handle is not None:
            try:
                await self._copy(handle, on_cancel=release)
            except Exception:
                release()
                raise
        if self._buffer is not None:
            self._buffer.release_request(req)
        self._drop_prefetch(req)
        self._release_pins(req)
        own = np.concatenate([req.slots[req.prefix_len :], req.spare])
        self.free_device(own)  # hybrid: with the SWA slots still paired
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

    async def restore(self: HierarchicalCache, req: CacheRequest) -> None:
        """Copy ``req``'s retracted KV into fresh device slots; the request continues from there.

        The restored slots all belong to the request (a later ``cache_finished_req`` inserts
        them and frees duplicates of what the tree meanwhile holds). Hybrid caches: the tokens
        from the backup's ``swa_from`` get FULL+SWA pairs with their SWA KV, those below it
        FULL slots only (``req.swa_evicted`` becomes ``swa_from``), and the request gets a fresh
        Mamba state holding its backed-up one.
        """
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
        tier = self.hybrid.tier if self.hybrid is not None else None
        submits: list[Callable[[], CopyHandle]] = []
        if len(slots):
            submits.append(lambda: self.engine_submit_h2d(backup.host_slots, slots))
        if len(backup.swa_host_slots):
            assert tier is not None and tier.swa_engine is not None
            assert self.hybrid is not None and self.hybrid.swa_map is not None
            engine = tier.swa_engine
            swa_dev = self.hybrid.swa_map.translate(slots[backup.swa_from :])
            submits.append(lambda: self._track_copy(
                engine.submit_h2d(backup.swa_host_slots, swa_dev)))
        if state is not None:
            assert tier is not None and tier.states is not None
            states = tier.states
            submits.append(lambda: self._track_copy(
                states.submit_h2d([backup.mamba_host_slot], [state])))

        def release() -> None:
            self.free_device(slots)
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
                await self._copy(handle, on_cancel=release)
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

    def discard_retracted(self: HierarchicalCache, req: CacheRequest) -> None:
        """Drop ``req``'s retracted KV (the request will recompute or is being aborted)."""
        self._check_request(req)
        backup = req.retracted
        if backup is None:
            return
        if backup.state == "restoring":
            raise InvalidInputError(f"request {req.rid} is being restored; await it first")
        req.retracted = None
        backup.state = "discarded"
        self._free_backup_host(backup)

    # ------------------------------------------------------------------ helpers
    def _check_retraction(self: HierarchicalCache, req: CacheRequest) -> None:
        self._check_open()
        self._check_request(req)
        if not self.config.retraction_backup:
            raise ConfigError("retraction needs CacheConfig(retraction_backup=True)")
        if req.finished:
            raise InvalidInputError(f"request {req.rid} is already finished")

    def _swa_window(self: HierarchicalCache, req: CacheRequest,
                    slots: np.ndarray) -> tuple[int, np.ndarray]:
        """(``swa_from``, SWA slots of ``slots[swa_from:]``): the request's last window of
        tokens (from a page boundary), past any token whose SWA slot is no longer live."""
        hy = self.hybrid
        if hy is None or hy.swa_map is None:
            return 0, EMPTY_SLOTS
        ps = self.page_size
        lo = max(0, req.computed - self.config.sliding_window) // ps * ps
        pairs = hy.swa_map.full_to_swa[slots[lo:]]
        dead = np.flatnonzero(pairs < 0)
        if len(dead):  # freed or an SWA tombstone of the tree: start after it
            lo += -(-(int(dead[-1]) + 1) // ps) * ps
            pairs = hy.swa_map.full_to_swa[slots[lo:]]
        return lo, pairs

    def _take_retraction_host(self: HierarchicalCache, req: CacheRequest, n: int,
                              swa_from: int, swa_n: int, state: int | None) -> RetractedKV:
        """Host slots for every part of a retraction, all or nothing (evicting host-only leaves
        when short); raises :class:`PoolExhaustedError` naming each pool that falls short."""
        assert self.host_pool is not None
        tier = self.hybrid.tier if self.hybrid is not None else None
        short: list[str] = []
        host = self.take_host(n) if n else EMPTY_SLOTS
        if host is None:
            short.append(f"{n} host slots needed, "
                         f"{self.host_pool.allocator.available_size} free after host eviction")
        swa_host: np.ndarray | None = EMPTY_SLOTS
        if swa_n:
            assert tier is not None
            swa_host = tier.take_host("swa", swa_n, self.evict_host)
            if swa_host is None:
                short.append(f"{swa_n} host SWA slots needed, {tier.host_available('swa')} free "
                             "after host eviction")
        mamba_host: np.ndarray | None = None
        if state is not None:
            assert tier is not None
            mamba_host = tier.take_host("mamba", 1, self.evict_host)
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

    def _free_backup_host(self: HierarchicalCache, backup: RetractedKV) -> None:
        """Give back every host slot of ``backup`` (FULL KV, SWA KV, Mamba state)."""
        self.free_host(backup.host_slots)
        parts = backup.component_host_slots
        if parts:
            assert self.hybrid is not None and self.hybrid.tier is not None
            for name, slots in parts.items():
                self.hybrid.tier.give_host(name, slots, free=True)

    async def _alloc_restore(self: HierarchicalCache, req: CacheRequest,
                             backup: RetractedKV) -> tuple[np.ndarray, int | None]:
        """Device slots for a restore (FULL-only below ``swa_from``, FULL+SWA pairs from there)
        and a Mamba state; on any failure or cancellation nothing stays taken."""
        n = len(backup.host_slots)
        hy = self.hybrid
        lo = backup.swa_from if hy is not None and hy.swa_map is not None else 0
        below = await self._alloc_full_only(lo) if lo else EMPTY_SLOTS
        try:
            above = await self.alloc_device(n - lo) if n > lo else EMPTY_SLOTS
        except BaseException:
            self.free_device(below)
            raise
        slots = np.concatenate([below, above]) if len(below) else above
        state = None
        if backup.mamba_host_slot is not None:
            state = self.alloc_mamba_state()
            if state is None:
                self.free_device(slots)
                raise PoolExhaustedError(
                    f"cannot restore request {req.rid}: no Mamba state slot is free (all "
                    f"{self.config.mamba_states} are held by requests or locked nodes)"
                )
        return slots, state

    async def _alloc_full_only(self: HierarchicalCache, num_tokens: int) -> np.ndarray:
        """FULL slots without an SWA side (tokens below a restored request's SWA floor),
        evicting and waiting for copies in flight as :meth:`alloc_device` does."""
        alloc = self.device_pool.allocator

        async def attempt() -> np.ndarray | None:
            got: np.ndarray | None = alloc.alloc(num_tokens)
            if got is None:
                self.evict(num_tokens - alloc.available_size)
                got = alloc.alloc(num_tokens)
            if got is not None:
                self._ledger.hand_out(got)
            return got

        return await self._alloc_waiting(
            attempt,
            lambda: f"cannot allocate {num_tokens} device slots: {alloc.available_size} free, "
                    f"{self.tree.evictable_size} evictable, {self.tree.protected_size} locked",
        )

    def _submit_parts(self: HierarchicalCache, submits: list[Callable[[], CopyHandle]], *,
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
                self._track_copy(GroupHandle(handles)).add_done_callback(lambda _h: on_fail())
            else:
                on_fail()
            raise
        if not handles:
            return None
        return handles[0] if len(handles) == 1 else self._track_copy(GroupHandle(handles))

    async def _copy(self: HierarchicalCache, handle: Any, *, on_cancel: Callable[[], None]) -> None:
        """Await a copy (raising :class:`TransferError` if it failed).

        If the awaiter is cancelled, ``on_cancel`` runs once the copy has landed (never while
        the copy may still read or write the slots) and the cancellation propagates.
        Several ranks: the copy is retired at an agreed tick (see :meth:`_agreed_copy`).
        """
        if self._agree is not None:
            await self._agreed_copy(handle, on_cancel)
            return
        try:
            await handle
        except asyncio.CancelledError:
            if handle.finished:
                on_cancel()
            else:
                handle.add_done_callback(lambda _h: on_cancel())
            raise
        except Exception as exc:
            raise TransferError(f"retraction copy failed: {exc}") from exc

    async def _agreed_copy(self: HierarchicalCache, handle: Any,
                           on_cancel: Callable[[], None]) -> None:
        """:meth:`_copy` with several ranks: the copy joins the agreement's copy lane, so every
        rank learns at the same tick whether it succeeded everywhere; one that failed on any
        rank raises :class:`TransferError` on all. A cancelled awaiter's ``on_cancel`` runs when
        the copy is retired (at a tick, on every rank alike)."""
        assert self._agree is not None
        outcome: dict[str, Any] = {}

        def retire(peer_error: BaseException | None) -> None:
            outcome["error"] = copy_error(handle) or peer_error
            if outcome.get("cancelled"):
                on_cancel()

        self._agree.defer_copy(handle, retire)
        try:
            await self._agree.settle([handle])
        except asyncio.CancelledError:
            if "error" in outcome:
                on_cancel()
            else:
                outcome["cancelled"] = True
            raise
        except BaseException:
            # The ranks could not agree (a peer failed): the caller frees the slots, so the
            # copy must have landed here first.
            await asyncio.gather(handle.done(), return_exceptions=True)
            raise
        err = outcome["error"]
        if err is not None:
            raise TransferError(f"retraction copy failed: {err}") from err
