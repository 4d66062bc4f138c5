"""Load-back (L2 -> L1) of the cache facade: host hits copied to device layer by layer.

A load-back pins the device prefix and the host hit while it makes room, hands the new device
slots to the tree (``start_load_back``), submits a layer-wise H->D copy and commits it in the
copy's done-callback (or at an agreed tick with several ranks). ``await lb.layer(i)`` lets a
forward pass start layer ``i`` while later layers are still copying.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from asynccache.errors import InvalidInputError, PoolExhaustedError, TransferError
from asynccache.logs import get_logger
from asynccache.tree import LoadBackTicket, LockReceipt, MatchResult
from transfers.handles import CopyHandle, LayerwiseHandle

if TYPE_CHECKING:
    from asynccache.cache import HierarchicalCache

_log = get_logger("cache")


def copy_error(handle: CopyHandle) -> BaseException | None:
    try:
        handle.result()
    except Exception as exc:  # the copy's own error, delivered through the bridge
        return exc
    return None


@dataclass(eq=False)
class LoadBack:
    """A load-back in flight or done.

    ``device_indices``: device slots of the whole prefix (device hit + loaded part). Await
    ``layer(i)`` to start layer ``i`` of a forward pass while later layers are still copying, or
    ``wait()`` for all. Once the copy completes the cache takes a device lock on the loaded prefix
    for the caller (``receipt``); call :meth:`HierarchicalCache.release_load` when done.
    """

    op_id: int
    node_id: int
    num_tokens: int
    device_indices: np.ndarray
    handle: LayerwiseHandle
    receipt: LockReceipt | None = None
    error: BaseException | None = None
    abandoned: bool = False
    committed: Any = None  # multi-rank: a coroutine function that ticks until it is committed

    def layer(self, i: int) -> Any:
        return self.handle.layer(i)

    async def wait(self) -> None:
        await self.handle
        if self.committed is not None:
            await self.committed()
        if self.error is not None:
            raise TransferError(f"load-back {self.op_id} failed: {self.error}") from self.error


class LoadBackMixin:
    """Load-back calls of :class:`~asynccache.HierarchicalCache`."""

    def _load_size(self: HierarchicalCache, match: MatchResult, mem_quota: int | None) -> int:
        """Tokens a load-back of ``match`` would copy, or 0 when it should be skipped."""
        n = match.host_hit_length
        if n == 0 or self._engine is None or match.pending_loads:
            return 0
        if n < self.config.load_back_threshold or (mem_quota is not None and n > mem_quota):
            return 0
        return n

    def _pin(self: HierarchicalCache, match: MatchResult) -> tuple[LockReceipt, LockReceipt]:
        """Pin the device prefix and the host hit of ``match`` while making room for a load."""
        return self.tree.lock(match.last_device_node), self.tree.lock_host(match.best_node)

    def _unpin(self: HierarchicalCache, pins: tuple[LockReceipt, LockReceipt]) -> None:
        self.tree.unlock(pins[0])
        self.tree.unlock_host(pins[1])

    def begin_load_back(self: HierarchicalCache, match: MatchResult, *, mem_quota: int | None = None) -> LoadBack | None:
        """Start loading ``match``'s host hit into device memory; returns None when skipped.

        Skipped when there is no host hit, when it is shorter than ``load_back_threshold``, when
        it exceeds ``mem_quota`` tokens, when it is already being loaded (``pending_loads``) or
        when the device cannot make room without waiting. The copy runs layer by layer:
        ``await lb.layer(i)`` before reading layer ``i``.
        """
        self._check_open()
        n = self._load_size(match, mem_quota)
        if not n:
            return None
        pins = self._pin(match)
        try:
            slots = self.try_alloc_device(n)
        finally:
            self._unpin(pins)
        return None if slots is None else self._start_load(match, slots)

    def _start_load(self: HierarchicalCache, match: MatchResult, slots: np.ndarray) -> LoadBack | None:
        try:
            ticket = self.tree.start_load_back(match.best_node, slots)
        except InvalidInputError:
            # The host hit changed while room was made (loaded or recomputed by another request).
            self.free_device(slots)
            return None
        self._outstanding -= len(slots)  # the tree owns them from here on
        handle = self._engine.submit_h2d_layerwise(ticket.host_slots, ticket.device_slots)
        lb = LoadBack(
            op_id=ticket.op_id,
            node_id=match.best_node,
            num_tokens=ticket.num_tokens,
            device_indices=np.concatenate([match.device_indices, ticket.device_slots]),
            handle=handle,
        )
        self._inflight[ticket.op_id] = handle
        if self._agree is not None:  # multi-rank: commit at the tick all ranks agree on
            self._agree.defer_copy(handle, lambda: self._load_done(ticket, lb, handle))
            lb.committed = lambda: self._settle([handle])
            return lb
        handle.add_done_callback(lambda h: self._load_done(ticket, lb, h))
        return lb

    def _load_done(self: HierarchicalCache, ticket: LoadBackTicket, lb: LoadBack, handle: CopyHandle) -> None:
        self._inflight.pop(ticket.op_id, None)
        error = copy_error(handle)
        if error is not None:
            lb.error = error
            for slots in self.tree.abort_load_back(ticket.op_id):
                self.device_pool.allocator.free(slots)
            _log.warning("load_back_failed", node=lb.node_id, error=repr(error))
            return
        self.tree.commit_load_back(ticket.op_id)
        if not lb.abandoned:
            lb.receipt = self.tree.lock(lb.node_id)
        result = handle.result()
        self.metrics.load_back_tokens.inc(result.num_tokens)
        self.metrics.load_back_bytes.inc(result.num_bytes)
        self.metrics.load_back_duration.observe(result.duration_s)

    async def load_back(self: HierarchicalCache, match: MatchResult, *, mem_quota: int | None = None) -> LoadBack | None:
        """Load ``match``'s host hit and wait for it; the result holds a lock on the prefix.

        Cancelling the caller leaves no lock behind: the copy still completes and commits.
        """
        self._check_open()
        n = self._load_size(match, mem_quota)
        if not n:
            return None
        pins = self._pin(match)
        try:
            slots = await self.alloc_device(n)
        except PoolExhaustedError:
            return None
        finally:
            self._unpin(pins)
        lb = self._start_load(match, slots)
        if lb is None:
            return None
        try:
            await lb.wait()
        except BaseException:
            self.release_load(lb)
            raise
        return lb

    def release_load(self: HierarchicalCache, lb: LoadBack) -> None:
        """Release the lock a load-back took for its caller (or renounce it if still copying)."""
        if lb.receipt is not None:
            self.tree.unlock(lb.receipt)
            lb.receipt = None
        lb.abandoned = True

    async def wait_loads(self: HierarchicalCache, op_ids: Sequence[int]) -> None:
        """Wait for the load-backs named by a match's ``pending_loads``."""
        handles = [self._inflight[i] for i in op_ids if i in self._inflight]
        if self._agree is not None:
            await self._agree.settle(handles)
        elif handles:
            await asyncio.gather(*(h.done() for h in handles),
                                 return_exceptions=True)
