"""Load-back (L2 -> L1): host hits copied to device layer by layer.

A load-back pins the device prefix and the host hit while it makes room, hands the new device
slots to the tree (``start_load_back``), submits a layer-wise H->D copy and commits it in the
copy's done-callback (or at an agreed tick with several ranks). ``await lb.layer(i)`` lets a
forward pass start layer ``i`` while later layers are still copying.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asynccache.engine.copies import copy_error
from asynccache.engine.tiering import Tiering
from asynccache.errors import InvalidInputError, PoolExhaustedError, TransferError
from asynccache.logs import get_logger
from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.handles import (
    CopyHandle,
    LayeredGroup,
    LayerwiseGroup,
    LayerwiseHandle,
)
from asynccache.transfers.hybrid_copies import GroupHandle
from asynccache.tree import LoadBackTicket, LockReceipt, MatchResult

_log = get_logger("cache")


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
    handle: CopyHandle
    receipt: LockReceipt | None = None
    error: BaseException | None = None
    abandoned: bool = False
    committed: Any = None  # multi-rank: a coroutine function that ticks until it is committed
    # Hybrid caches: the FULL, SWA and Mamba copies together, a LayeredGroup when FULL is
    # loaded or ``CacheConfig.layer_components`` is set (``layer(i)``: see there).
    group: CopyHandle | None = None
    # The layer-wise loads of the KV pool's sidecars, by name (they ride the KV copy).
    sidecars: dict[str, LayerwiseHandle] = field(default_factory=dict)
    # The model's layers (``layer_components`` when given, else the KV's): what ``layer(i)``
    # accepts, whatever this load copies.
    num_layers: int | None = None

    def _check(self, i: int) -> None:
        n = self.num_layers
        if n is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n):
            raise InvalidInputError(f"layer {i!r} out of range [0, {n})")

    def layer(self, i: int) -> Any:
        """An awaitable for layer ``i`` in place. A hybrid load with
        ``CacheConfig.layer_components``: model layer ``i``'s own layer of the FULL or SWA
        load, or the whole Mamba state copy; without it: the KV's layer ``i`` and the SWA /
        Mamba copies whole (a load of components only: the whole load)."""
        self._check(i)
        if isinstance(self.group, LayeredGroup):
            return self.group.layer(i)
        if self.group is not None or not isinstance(self.handle, LayerwiseHandle):
            return (self.group or self.handle).done()
        return self.handle.layer(i)

    def wait_layer(self, i: int, stream: Any = None, *, timeout: float | None = None) -> None:
        """From the forward's thread: make ``stream`` (default: the current stream) wait *on
        the device* until layer ``i`` is in place (with layer ``i`` of each KV sidecar that
        has one; a hybrid load: what :meth:`layer` waits for), blocking this thread only
        until the layer's copy is queued. CPU pools: returns once it is in place. A failed
        copy raises :class:`TransferError`; coroutines ``await layer(i)`` instead."""
        self._check(i)
        target = self.group if self.group is not None else self.handle
        if isinstance(target, LayerwiseHandle | LayeredGroup):
            target.wait_layer(i, stream, timeout=timeout)
        else:  # loaded whole (a hybrid load of SWA / Mamba copies only): all of it
            target.wait_device(stream, timeout=timeout)

    def sidecar_layer(self, name: str, i: int) -> Any:
        """An awaitable for layer ``i`` of sidecar ``name`` (a draft model's layer ``i``);
        a sidecar of the SWA or Mamba pool (loaded whole, with its source): the whole load."""
        h = self.sidecars.get(name)
        if h is None:
            return (self.group or self.handle).done()
        return h.layer(i)

    def wait_sidecar_layer(self, name: str, i: int, stream: Any = None, *,
                           timeout: float | None = None) -> None:
        """Device-side :meth:`sidecar_layer`: ``stream`` waits for layer ``i`` of sidecar
        ``name`` (a sidecar of the SWA or Mamba pool, or one this load does not copy: the
        whole load), blocking this thread only until its copy is queued."""
        h = self.sidecars.get(name)
        if h is None:
            target = self.group if self.group is not None else self.handle
            target.wait_device(stream, timeout=timeout)
            return
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < h.num_layers:
            raise InvalidInputError(f"sidecar {name!r}: layer {i!r} out of range "
                                    f"[0, {h.num_layers})")
        h.wait_layer(i, stream, timeout=timeout)

    async def wait(self) -> None:
        if self.committed is not None:
            # Several ranks: tick until the copy is retired everywhere, even if it failed here
            # (raising at once would let this rank run ahead of its peers' ticks); the error
            # agreed for it (local, or a peer's) is in ``error`` then.
            await self.committed()
        else:
            await (self.group if self.group is not None else self.handle)
        if self.error is not None:
            raise TransferError(f"load-back {self.op_id} failed: {self.error}") from self.error


class LoadBacks:
    """Load-backs of one cache."""

    def __init__(self, tiering: Tiering) -> None:
        self._t = tiering
        self._p = tiering.parts
        self.tree = tiering.tree
        self._tier = tiering.parts.hybrid_tier  # hybrid: SWA / Mamba parts load with the KV

    def _copier(self) -> CopyEngine:
        assert self._t.copier is not None
        return self._t.copier

    def load_size(self, match: MatchResult, mem_quota: int | None) -> int:
        """Tokens a load-back of ``match`` would copy, or 0 when it should be skipped."""
        n = match.host_hit_length
        if n == 0 or self._t.copier is None or match.pending_loads:
            return 0
        if mem_quota is not None and n > mem_quota:
            return 0
        if n < self._p.config.load_back_threshold and not self._loads_components(match):
            return 0  # short enough to recompute (unless SWA / Mamba parts must come back)
        return n

    def _loads_components(self, match: MatchResult) -> bool:
        """Hybrid: would a load-back of ``match`` copy SWA or Mamba parts?"""
        if self._p.hybrid is None:
            return False
        try:
            sizes = self.tree.load_back_sizes(match.best_node)
        except InvalidInputError:
            return False
        return any(v for k, v in sizes.items() if k != "full")

    def _pin(self, match: MatchResult) -> tuple[LockReceipt, LockReceipt]:
        """Pin the device prefix and the host hit of ``match`` while making room for a load."""
        return self.tree.lock(match.last_device_node), self.tree.lock_host(match.best_node)

    def _unpin(self, pins: tuple[LockReceipt, LockReceipt]) -> None:
        self.tree.unlock(pins[0])
        self.tree.unlock_host(pins[1])

    def begin_load_back(self, match: MatchResult, *, mem_quota: int | None = None) -> LoadBack | None:
        """Start loading ``match``'s host hit into device memory; returns None when skipped."""
        n = self.load_size(match, mem_quota)
        if not n:
            return None
        if self._p.hybrid is not None:
            return self._begin_hybrid_load(match)
        pins = self._pin(match)
        try:
            slots = self._t.try_alloc(self._t.round_up(n))
        finally:
            self._unpin(pins)
        return None if slots is None else self._start_load(match, slots)

    def _begin_hybrid_load(self, match: MatchResult) -> LoadBack | None:
        """Allocate every part of a hybrid load-back (FULL, SWA, Mamba; evicting if short) and
        start it; all or nothing: when any pool falls short, nothing is taken."""
        tier = self._tier
        assert tier is not None
        try:
            sizes = self.tree.load_back_sizes(match.best_node)
        except InvalidInputError:
            return None  # a backup or load on the path is in flight
        pins = self._pin(match)
        try:
            alloc = self._p.device_pool.allocator
            need = sizes.get("full", 0)
            full = alloc.alloc(need)
            if full is None:
                self._t.evict(need - alloc.available_size)
                full = alloc.alloc(need)
            parts = tier.alloc_load(sizes) if full is not None else None
            if full is not None and parts is None:
                short_swa = sizes.get("swa", 0)
                short_mamba = sizes.get("mamba", 0)
                self._t.evict(0, swa_num_tokens=short_swa, mamba_num=short_mamba)
                parts = tier.alloc_load(sizes)
        finally:
            self._unpin(pins)
        if full is None or parts is None:
            if full is not None:
                alloc.free(full)
            self._p.metrics.hybrid_skipped.labels(op="load_back").inc()
            _log.info("load_back_skipped", node=match.best_node, sizes=sizes,
                      reason="pool_short")
            return None
        self._t.ledger.hand_out(full)
        return self._start_load(match, full, parts)

    def _start_load(self, match: MatchResult, slots: np.ndarray,
                    parts: dict[str, np.ndarray] | None = None) -> LoadBack | None:
        try:
            ticket = self.tree.start_load_back(match.best_node, slots, parts)
        except InvalidInputError:
            # The host hit changed while room was made (loaded or recomputed by another request).
            if parts is not None:
                assert self._tier is not None
                self._tier.free_load_parts(parts)
                self._t.ledger.release(slots)
                self._p.device_pool.allocator.free(slots)
            else:
                self._t.free(slots)
            return None
        self._t.ledger.release(slots)  # the tree owns them from here on
        handle: CopyHandle
        group = None
        cfg = self._p.config
        if parts is None:
            handle = self._copier().submit_h2d_layerwise(ticket.host_slots, ticket.device_slots)
            indices = np.concatenate([match.device_indices, ticket.device_slots])
        else:
            tier = self._tier
            assert tier is not None
            tier.pair(ticket)
            named = tier.submit_h2d(ticket)
            if len(ticket.device_slots):
                named = {"full": self._copier().submit_h2d_layerwise(ticket.host_slots,
                                                                     ticket.device_slots),
                         **named}
            layers = cfg.layer_components
            copies = list(named.values())
            group = (LayeredGroup(named, layers) if layers is not None or "full" in named
                     else GroupHandle(copies))
            handle = copies[0]
            total = match.device_prefix_len + match.host_hit_length
            tail = self.tree.tail_slots(match.best_node, total) if total else None
            indices = tail if tail is not None else match.device_indices
        kv_load = handle if parts is None else named.get("full")
        riders = {}
        if isinstance(kv_load, LayerwiseGroup):
            names = [s.name for s in self._p.sidecars.of("kv") if s.engine is not None]
            riders = dict(zip(names, kv_load.parts[1:], strict=True))
        lb = LoadBack(
            num_layers=len(cfg.layer_components) if cfg.layer_components else cfg.num_layers,
            sidecars=riders,
            op_id=ticket.op_id,
            node_id=match.best_node,
            num_tokens=ticket.num_tokens,
            device_indices=indices,
            handle=handle,
            group=group,
        )
        if group is not None:
            handle = group
        self._t.copies.add(ticket.op_id, handle)
        final = handle
        self._t.commits.on_done(final, lambda err: self._load_done(ticket, lb, final, err))
        lb.committed = self._t.commits.committed(final)
        return lb

    def _load_done(self, ticket: LoadBackTicket, lb: LoadBack,
                   handle: CopyHandle, peer_error: BaseException | None = None) -> None:
        """Commit (or abort) a finished load-back; ``peer_error``: multi-rank, the copy failed
        on another rank, so it is aborted here as well."""
        self._t.copies.discard(ticket.op_id)
        error = copy_error(handle) or peer_error
        if error is not None:
            lb.error = error
            frees = self.tree.abort_load_back(ticket.op_id)
            if self._tier is not None:
                self._tier.abort_load(ticket, frees)
            else:
                for slots in frees:
                    self._p.device_pool.allocator.free(slots)
            _log.warning("load_back_failed", node=lb.node_id, error=repr(error))
            return
        self.tree.commit_load_back(ticket.op_id)
        if not lb.abandoned:
            lb.receipt = self.tree.lock(lb.node_id)
        result = handle.result()
        self._p.metrics.load_back_tokens.inc(result.num_tokens)
        self._p.metrics.load_back_bytes.inc(result.num_bytes)
        self._p.metrics.load_back_duration.observe(result.duration_s)

    async def load_back(self, match: MatchResult, *, mem_quota: int | None = None) -> LoadBack | None:
        """Load ``match``'s host hit and wait for it; the result holds a lock on the prefix."""
        n = self.load_size(match, mem_quota)
        if not n:
            return None
        if self._p.hybrid is not None:
            lb = self._begin_hybrid_load(match)
        else:
            pins = self._pin(match)
            try:
                slots = await self._t.alloc(self._t.round_up(n))
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

    def release_load(self, lb: LoadBack) -> None:
        """Release the lock a load-back took for its caller (or renounce it if still copying)."""
        if lb.receipt is not None:
            self.tree.unlock(lb.receipt)
            lb.receipt = None
        lb.abandoned = True

    async def wait_loads(self, op_ids: Sequence[int]) -> None:
        """Wait for the load-backs named by a match's ``pending_loads``."""
        await self._t.commits.settle(self._t.copies.of(op_ids))
