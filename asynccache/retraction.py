"""Retraction backup: park a preempted request's KV in host memory and bring it back.

When a scheduler preempts (retracts) a running request to free device memory, ``retract``
copies the request's KV (every computed token, in whole pages) to host slots and releases its
device slots and locks. ``restore`` later copies it into fresh device slots, bit-exact, and the
request carries on; ``discard`` drops it. Part of :class:`~asynccache.HierarchicalCache`
(a mixin, so the facade stays one object with one set of pools and one copy engine).

Cancellation: a cancelled ``retract`` leaves the request as it was (the host copy is freed
when the copy lands); a cancelled ``restore`` leaves the backup held (the device slots are
freed when the copy lands).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from asynccache.errors import ConfigError, InvalidInputError, PoolExhaustedError, TransferError
from asynccache.logs import get_logger
from asynccache.tree.results import EMPTY_SLOTS

if TYPE_CHECKING:
    from asynccache.cache import HierarchicalCache
    from asynccache.requests import CacheRequest

_log = get_logger("retraction")


@dataclass(eq=False)
class RetractedKV:
    """A request's KV parked in host memory: ``num_tokens`` tokens in ``host_slots``."""

    rid: str
    num_tokens: int
    host_slots: np.ndarray
    state: str = "held"  # held | restoring | restored | discarded


class RetractionMixin:
    """``retract`` / ``restore`` / ``discard_retracted`` of the cache facade."""

    async def retract(self: HierarchicalCache, req: CacheRequest) -> RetractedKV:
        """Copy ``req``'s KV to host and free its device slots and locks.

        Raises :class:`PoolExhaustedError` when host memory cannot hold it even after evicting
        host-only leaves (the request is then unchanged).
        """
        self._check_retraction(req)
        if req.retracted is not None:
            raise InvalidInputError(f"request {req.rid} is already retracted")
        if req.pending_loads:
            await self.wait_loads(req.pending_loads)
        slots = np.concatenate([req.slots, req.spare])
        host = self.take_host(len(slots)) if len(slots) else EMPTY_SLOTS
        if host is None:
            assert self.host_pool is not None
            raise PoolExhaustedError(
                f"cannot retract request {req.rid}: {len(slots)} host slots needed, "
                f"{self.host_pool.allocator.available_size} free after host eviction"
            )
        if len(slots):
            try:
                await self._copy(self.engine_submit_d2h(slots, host),
                                 on_cancel=lambda: self.free_host(host))
            except Exception:
                self.free_host(host)
                raise
        backup = RetractedKV(req.rid, req.computed, host)
        if self._buffer is not None:
            self._buffer.release_request(req)
        self._drop_prefetch(req)
        self._release_pins(req)
        own = np.concatenate([req.slots[req.prefix_len :], req.spare])
        self.free_device(own)
        req.slots = req.spare = EMPTY_SLOTS
        req.prefix_len = req.host_hit_length = 0
        req.last_node = req.best_node = self.tree.root_id
        req.pending_loads = ()
        req.retracted = backup
        _log.info("retracted", rid=req.rid, tokens=backup.num_tokens)
        return backup

    async def restore(self: HierarchicalCache, req: CacheRequest) -> None:
        """Copy ``req``'s retracted KV into fresh device slots; the request continues from there.

        The restored slots all belong to the request (a later ``cache_finished_req`` inserts
        them and frees duplicates of what the tree meanwhile holds).
        """
        self._check_retraction(req)
        backup = req.retracted
        if backup is None or backup.state != "held":
            raise InvalidInputError(f"request {req.rid} has no retracted KV to restore")
        backup.state = "restoring"
        n = len(backup.host_slots)
        try:
            slots = await self.alloc_device(n) if n else EMPTY_SLOTS
        except BaseException:
            backup.state = "held"
            raise
        if n:
            try:
                await self._copy(self.engine_submit_h2d(backup.host_slots, slots),
                                 on_cancel=lambda: self.free_device(slots))
            except BaseException as exc:
                backup.state = "held"
                if not isinstance(exc, asyncio.CancelledError):
                    self.free_device(slots)
                raise
        self.free_host(backup.host_slots)
        backup.state = "restored"
        req.retracted = None
        req.slots, req.spare = slots[: backup.num_tokens], slots[backup.num_tokens :]
        req.prefix_len = 0
        req.last_node = req.best_node = self.tree.root_id
        _log.info("restored", rid=req.rid, tokens=backup.num_tokens)

    def discard_retracted(self: HierarchicalCache, req: CacheRequest) -> None:
        """Drop ``req``'s retracted KV (the request will recompute or is being aborted)."""
        backup = req.retracted
        if backup is None:
            return
        if backup.state == "restoring":
            raise InvalidInputError(f"request {req.rid} is being restored; await it first")
        req.retracted = None
        backup.state = "discarded"
        self.free_host(backup.host_slots)

    # ------------------------------------------------------------------ helpers
    def _check_retraction(self: HierarchicalCache, req: CacheRequest) -> None:
        self._check_open()
        if not self.config.retraction_backup:
            raise ConfigError("retraction needs CacheConfig(retraction_backup=True)")
        if req.finished:
            raise InvalidInputError(f"request {req.rid} is already finished")

    async def _copy(self: HierarchicalCache, handle: Any, *, on_cancel: Callable[[], None]) -> None:
        """Await a copy (raising :class:`TransferError` if it failed).

        If the awaiter is cancelled, ``on_cancel`` runs once the copy has landed (never while
        the copy may still read or write the slots) and the cancellation propagates.
        """
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
