"""HierarchicalCache: the async engine a scheduler uses, over L1 device and L2 host memory.

The tree core decides; this facade executes: it frees slots the tree gives up, runs the copies
the tree asks for on the copy engine, and commits them when they complete. Completions are
handled by done-callbacks on the loop (in submission order), never by polling, so a cancelled
awaiter cannot leave a copy half-committed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np
import torch

from asynccache.config import CacheConfig
from asynccache.errors import (
    ClosedError,
    ConfigError,
    InvalidInputError,
    PoolExhaustedError,
    TransferError,
)
from asynccache.hybrid_slots import HybridSlots
from asynccache.l3 import PrefetchOp, StoragePolicy, StorageTier
from asynccache.logs import get_logger
from asynccache.metrics import CacheMetrics
from asynccache.tree import (
    BackupRequest,
    EvictResult,
    InsertResult,
    KVEvent,
    LoadBackTicket,
    LockReceipt,
    MatchResult,
    RadixKey,
    RadixTree,
    TreeConfig,
    as_key,
    as_slots,
)
from asynccache.tree.results import EMPTY_SLOTS
from transfers.handles import CopyHandle, LayerwiseHandle
from transfers.pools import DevicePool, HostPool, KVShape

_log = get_logger("cache")


def _error_of(handle: CopyHandle) -> BaseException | None:
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

    def layer(self, i: int) -> Any:
        return self.handle.layer(i)

    async def wait(self) -> None:
        await self.handle
        if self.error is not None:
            raise TransferError(f"load-back {self.op_id} failed: {self.error}") from self.error


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

    @property
    def computed(self) -> int:
        return len(self.slots)


class HierarchicalCache:
    """A prefix KV cache over a device pool (L1) and an optional host pool (L2).

    Use it as ``async with HierarchicalCache(config) as cache:``. The synchronous calls
    (``match_prefix``, ``insert``, ``evict``, ``lock``...) are cheap and must run on the loop's
    thread; copies are coroutines or handles.
    """

    def __init__(self, config: CacheConfig, *, metrics: CacheMetrics | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise InvalidInputError(f"config must be a CacheConfig, got {config!r}")
        self.config = config
        self.page_size = config.page_size
        self.shape = KVShape(config.num_layers, config.num_heads, config.head_dim,
                             config.torch_dtype)
        if config.device_tokens is not None:
            self.device_pool = DevicePool.from_tokens(
                self.shape, config.device_tokens, config.page_size, device=config.device)
        else:
            assert config.device_bytes is not None
            self.device_pool = DevicePool.from_bytes(
                self.shape, config.device_bytes, config.page_size, device=config.device)
        self.host_pool: HostPool | None = None
        if config.host_enabled:
            pin = torch.cuda.is_available() and self.device_pool.device.type == "cuda"
            if config.host_tokens:
                self.host_pool = HostPool.from_tokens(
                    self.shape, config.host_tokens, config.page_size,
                    layout=config.host_layout, pin_memory=pin)
            else:
                assert config.host_bytes
                self.host_pool = HostPool.from_bytes(
                    self.shape, config.host_bytes, config.page_size,
                    layout=config.host_layout, pin_memory=pin)
        self.tree = RadixTree(TreeConfig(
            page_size=config.page_size,
            eviction_policy=config.eviction_policy,
            host_enabled=config.host_enabled,
            write_policy=config.write_policy,
            enable_kv_events=config.enable_kv_events,
            enable_page_hashes=config.enable_page_hashes,
            sliding_window=config.sliding_window,
            mamba=config.mamba_states > 0,
        ))
        # Hybrid models: the SWA pool and slot map, the Mamba state pool (None: FULL only).
        self.hybrid = HybridSlots(config, self.device_pool) if config.hybrid else None
        self.metrics = metrics if metrics is not None else CacheMetrics()
        if self.host_pool is not None:
            self.metrics.host_total_tokens.set(self.host_pool.num_slots)
        self._engine: Any = None
        self._state = "new"
        self._inflight: dict[int, CopyHandle] = {}
        self._outstanding = 0  # device slots handed to callers, not yet freed or adopted
        self._host_inflight = 0  # host slots allocated for backups not yet committed
        self._evicted_total = 0
        self._matched = 0
        self._hits = 0
        self._next_rid = 0
        self._close_task: asyncio.Task[None] | None = None
        self._storage: StorageTier | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> HierarchicalCache:
        if self._state != "new":
            raise ClosedError(f"cache cannot start: it is {self._state}")
        self.tree.bind_owner()
        if self.host_pool is not None:
            from transfers.engine import CopyEngine

            self._engine = CopyEngine(self.device_pool, self.host_pool, name="asynccache-copy")
            await self._engine.start()
        self._state = "running"
        return self

    async def aclose(self) -> None:
        """Wait for in-flight copies, commit them, free every slot, stop the copy thread.

        Cancelling ``aclose`` does not stop the shutdown: it finishes in the background, and a
        second ``aclose`` waits for it.
        """
        if self._state == "new":
            self._state = "closed"
            return
        if self._close_task is None:
            if self._state == "closed":
                return
            self._state = "closing"
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        try:
            await self._settle(list(self._inflight.values()))
            if self._storage is not None:
                await self._storage.close()
            if self._engine is not None:
                await self._engine.aclose()
        finally:
            if self.hybrid is not None:
                self.hybrid.release_tree(self.tree)
            device, host = self.tree.reset() if not self.tree.pending_ops else ([], [])
            for slots in device:
                self.device_pool.allocator.free(slots)
            if self.host_pool is not None:
                for slots in host:
                    self.host_pool.allocator.free(slots)
            self._state = "closed"

    async def __aenter__(self) -> HierarchicalCache:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        if self._state != "running":
            raise ClosedError(f"cache is {self._state}; use 'async with HierarchicalCache(...)'")

    # ------------------------------------------------------------------ sizes
    @property
    def evictable_size(self) -> int:
        return self.tree.evictable_size

    @property
    def protected_size(self) -> int:
        return self.tree.protected_size

    @property
    def host_size(self) -> int:
        return self.tree.host_size

    @property
    def device_available(self) -> int:
        """Free device slots (without evicting)."""
        return self.device_pool.allocator.available_size

    @property
    def in_flight(self) -> int:
        """Copies (backups and load-backs) not yet completed."""
        return len(self._inflight)

    def take_events(self) -> list[KVEvent]:
        return self.tree.take_events()

    def refresh_gauges(self) -> None:
        m = self.metrics
        m.evictable_tokens.set(self.tree.evictable_size)
        m.protected_tokens.set(self.tree.protected_size)
        m.host_used_tokens.set(self.host_pool.allocator.used_size if self.host_pool else 0)

    def sanity_check(self) -> None:
        """Tree invariants plus pool accounting: every allocated slot has exactly one owner."""
        self.tree.sanity_check()
        dev_used = self.device_pool.allocator.used_size
        want = self.tree.device_size + self._outstanding
        if dev_used != want:
            raise AssertionError(
                f"device accounting: allocator uses {dev_used} slots, tree holds "
                f"{self.tree.device_size} and callers {self._outstanding}"
            )
        if self.host_pool is not None:
            host_used = self.host_pool.allocator.used_size
            want = self.tree.host_size + self._host_inflight
            if host_used != want:
                raise AssertionError(
                    f"host accounting: allocator uses {host_used} slots, tree holds "
                    f"{self.tree.host_size} and in-flight backups {self._host_inflight}"
                )
        if self.hybrid is not None:
            self.hybrid.check(self.tree)

    # ------------------------------------------------------------------ tree calls
    def match_prefix(self, key: RadixKey | Any, *, cow_mamba: bool = False) -> MatchResult:
        """Longest cached prefix; ``cow_mamba`` (hybrid) reports the Mamba state to copy (see
        :meth:`mamba_copy_on_write`)."""
        self._check_open()
        key = as_key(key)
        if self.config.disable:
            return MatchResult(EMPTY_SLOTS, 0, 0, 0, 0)
        res = self.tree.match_prefix(key, cow_mamba=cow_mamba)
        m = self.metrics
        m.matched_tokens.inc(len(key))
        m.hit_tokens.inc(res.total_hit_length)
        self._matched += len(key)
        self._hits += res.total_hit_length
        if self._matched:
            m.hit_rate.set(self._hits / self._matched)
        return res

    def insert(self, key: RadixKey | Any, value: Any, *, prev_prefix_len: int = 0,
               inserted_len: int = 0, priority: int = 0,
               swa_evicted_seqlen: int = 0, mamba_value: int | None = None) -> InsertResult:
        """Insert and execute: duplicate slots are freed here, write-through backups started.

        The slots of ``value`` past ``prev_prefix_len`` must come from :meth:`alloc_device`; the
        tree adopts the page-aligned part, the unaligned tail stays the caller's.

        Hybrid caches: the SWA slots are the pairs of ``value`` (the request already freed
        those of its first ``swa_evicted_seqlen`` tokens, see :meth:`free_swa`);
        ``mamba_value`` is a state from :meth:`alloc_mamba_state` after the page-aligned key.
        """
        self._check_open()
        if self.config.disable:
            raise InvalidInputError("insert is not available on a disabled cache")
        if self.hybrid is not None:
            return self._insert_hybrid(key, value, prev_prefix_len, inserted_len, priority,
                                       swa_evicted_seqlen, mamba_value)
        res = self.tree.insert(key, value, prev_prefix_len=prev_prefix_len,
                               inserted_len=inserted_len, priority=priority)
        for slots in res.device_frees:
            self.device_pool.allocator.free(slots)
        self._outstanding -= max(0, res.cached_len - prev_prefix_len)
        if res.backups:
            self._start_backups(res.backups)
        return res

    def _insert_hybrid(self, key: RadixKey | Any, value: Any, prev_prefix_len: int,
                       inserted_len: int, priority: int, swa_evicted_seqlen: int,
                       mamba_value: int | None) -> InsertResult:
        hy = self.hybrid
        assert hy is not None
        slots = as_slots(value)
        if isinstance(swa_evicted_seqlen, bool) or not isinstance(swa_evicted_seqlen, int) or (
            not 0 <= swa_evicted_seqlen <= len(slots)
        ):
            raise InvalidInputError(
                f"swa_evicted_seqlen must be an int in [0, {len(slots)}], got {swa_evicted_seqlen!r}"
            )
        start = min(len(slots), max(swa_evicted_seqlen, prev_prefix_len))
        swa_value = hy.swa_value(slots, start)
        evicted = {"swa": swa_evicted_seqlen} if hy.swa_map is not None else None
        res = self.tree.insert(key, slots, prev_prefix_len=prev_prefix_len,
                               inserted_len=inserted_len, priority=priority, swa_value=swa_value,
                               component_evicted_seqlens=evicted, mamba_value=mamba_value)
        hy.apply_insert(res, mamba_value)
        self._outstanding -= max(0, res.cached_len - prev_prefix_len)
        return res

    def lock(self, node_id: int, *, skip: tuple[str, ...] = ()) -> LockReceipt:
        """Pin a matched node (hybrid: also one SWA window and its Mamba state, unless
        ``skip`` names them)."""
        self._check_open()
        return self.tree.lock(node_id, skip=skip)

    def release_swa(self, receipt: LockReceipt) -> None:
        """Hybrid: drop the SWA / Mamba pins of a held lock once decode passed the window."""
        self._check_open()
        self.tree.release_swa(receipt)

    def _hybrid_slots(self) -> HybridSlots:
        if self.hybrid is None:
            raise InvalidInputError("this cache has no SWA / Mamba components")
        return self.hybrid

    def free_swa(self, slots: Any) -> None:
        """Free a request's SWA slots that slid out of the window (pairs of its FULL slots)."""
        self._check_open()
        self._hybrid_slots().free_swa(slots)

    def alloc_mamba_state(self) -> int | None:
        """A fresh Mamba state slot for a request (None when the pool is full after evicting
        unlocked states)."""
        self._check_open()
        hy = self._hybrid_slots()
        got = hy.alloc_mamba()
        if got is None:
            self.evict(0, mamba_num=1)
            got = hy.alloc_mamba()
        return got

    def free_mamba_state(self, slot: int) -> None:
        self._check_open()
        self._hybrid_slots().free_mamba(slot)

    def mamba_copy_on_write(self, slot: int) -> int | None:
        """A request-private copy of the state a match returned in ``mamba_cow_slot``."""
        self._check_open()
        hy = self._hybrid_slots()
        got = hy.copy_on_write(slot)
        if got is None:
            self.evict(0, mamba_num=1)
            got = hy.copy_on_write(slot)
        return got

    def unlock(self, receipt: LockReceipt) -> int:
        self._check_open()
        return self.tree.unlock(receipt)

    # ------------------------------------------------------------------ slots
    def _round_up(self, n: int) -> int:
        ps = self.page_size
        return -(-n // ps) * ps

    def try_alloc_device(self, num_tokens: int) -> np.ndarray | None:
        """Allocate whole pages for ``num_tokens`` (rounded up), evicting synchronously if short.

        Returns None when even eviction cannot make room (under write-back, use
        :meth:`alloc_device`, which waits for write-back copies).
        """
        self._check_open()
        need = self._round_up(num_tokens)
        if self.hybrid is not None:
            hy = self.hybrid
            slots = hy.alloc(need)
            if slots is None:
                full, swa = hy.available()
                self.evict(max(0, need - full),
                           swa_num_tokens=max(0, need - swa) if hy.swa_map is not None else 0)
                slots = hy.alloc(need)
            if slots is not None:
                self._outstanding += len(slots)
            return slots
        alloc = self.device_pool.allocator
        slots = alloc.alloc(need)
        if slots is None:
            self.evict(need - alloc.available_size)
            slots = alloc.alloc(need)
        if slots is not None:
            self._outstanding += len(slots)
        return slots

    async def alloc_device(self, num_tokens: int) -> np.ndarray:
        """Allocate whole pages for ``num_tokens``, evicting (and writing back) as needed.

        Raises :class:`PoolExhaustedError` when the pool cannot hold them even after eviction.
        """
        self._check_open()
        need = self._round_up(num_tokens)
        if self.hybrid is not None:
            got = self.try_alloc_device(need)
            if got is None:
                raise PoolExhaustedError(
                    f"cannot allocate {need} device slots (FULL, SWA free: "
                    f"{self.hybrid.available()}), {self.tree.protected_size} locked"
                )
            return got
        alloc = self.device_pool.allocator
        for _ in range(64):
            slots = alloc.alloc(need)
            if slots is not None:
                self._outstanding += len(slots)
                return slots
            await self.evict_async(need - alloc.available_size)
            if alloc.available_size >= need:
                continue
            # What is left may be pinned by copies in flight (write-through backups hold their
            # nodes until they land): wait for those, then evict again.
            in_flight = list(self._inflight.values())
            if not in_flight:
                break
            await self._settle(in_flight)
        raise PoolExhaustedError(
            f"cannot allocate {need} device slots: {alloc.available_size} free, "
            f"{self.tree.evictable_size} evictable, {self.tree.protected_size} locked"
        )

    def free_device(self, slots: Any) -> None:
        """Return slots obtained from :meth:`alloc_device` (whole pages)."""
        arr = as_slots(slots, "slots")
        if len(arr):
            if self.hybrid is not None:
                self.hybrid.free_full(arr)
            else:
                self.device_pool.allocator.free(arr)
            self._outstanding -= len(arr)

    def _alloc_host(self, num_tokens: int) -> np.ndarray | None:
        assert self.host_pool is not None
        alloc = self.host_pool.allocator
        slots = alloc.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens - alloc.available_size)
            slots = alloc.alloc(num_tokens)
        return slots

    # ------------------------------------------------------------------ eviction
    def _apply_evict(self, res: EvictResult, started: float) -> None:
        if self.hybrid is not None:
            self.hybrid.apply_evict(res)
        else:
            for slots in res.device_frees:
                self.device_pool.allocator.free(slots)
        if res.host_frees:
            assert self.host_pool is not None
            for slots in res.host_frees:
                self.host_pool.allocator.free(slots)
        if res.dropped_host_tokens:
            self.metrics.dropped_tokens.labels(reason="host_pressure").inc(res.dropped_host_tokens)
        if res.num_evicted:
            self._evicted_total += res.num_evicted
            self.metrics.evicted_tokens.inc(res.num_evicted)
        self.metrics.eviction_duration.observe(time.perf_counter() - started)

    def evict(self, num_tokens: int, *, swa_num_tokens: int = 0, mamba_num: int = 0) -> int:
        """Free at least ``num_tokens`` device tokens now if possible; returns tokens freed.

        Under write-back, un-backed victims start their write-back copy and are demoted by a
        later call (see :meth:`evict_async`). Hybrid caches also take SWA-token and Mamba-state
        targets (their slots go back to their own pools).
        """
        self._check_open()
        started = time.perf_counter()
        res = self.tree.evict(num_tokens, swa_num_tokens=swa_num_tokens, mamba_num=mamba_num)
        self._apply_evict(res, started)
        if res.backups:
            self._start_backups(res.backups)
        return res.num_evicted

    async def evict_async(self, num_tokens: int) -> int:
        """Like :meth:`evict`, but waits for write-back copies and demotes their nodes."""
        self._check_open()
        before = self._evicted_total
        while self._evicted_total - before < num_tokens:
            started = time.perf_counter()
            res = self.tree.evict(num_tokens - (self._evicted_total - before))
            self._apply_evict(res, started)
            if not res.backups:
                break
            handles = self._start_backups(res.backups)
            if not handles:
                continue  # no host memory: the victims were dropped (counted above)
            await self._settle(handles)
        return self._evicted_total - before

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens (host-only leaves, then duplicates)."""
        self._check_open()
        res = self.tree.evict_host(num_tokens)
        if res.host_frees:
            assert self.host_pool is not None
            for slots in res.host_frees:
                self.host_pool.allocator.free(slots)
        return res.num_evicted

    # ------------------------------------------------------------------ backups (D -> H)
    def _start_backups(self, reqs: Sequence[BackupRequest]) -> list[CopyHandle]:
        """Submit the D->H copies of ``reqs`` (a root-first chain); commits happen on completion."""
        handles: list[CopyHandle] = []
        failed = [False]  # shared by the chain: a failed ancestor aborts its descendants
        for i, req in enumerate(reqs):
            host = self._alloc_host(req.num_tokens) if self._engine is not None else None
            if host is None:
                for rest in reqs[i:]:
                    self._backup_failed(rest, "host_pressure")
                break
            self._host_inflight += len(host)
            handle = self._engine.submit_d2h(req.device_slots, host)
            self._inflight[req.op_id] = handle
            handle.add_done_callback(
                lambda h, req=req, host=host: self._backup_done(req, host, h, failed))
            handles.append(handle)
        return handles

    def _backup_failed(self, req: BackupRequest, reason: str) -> None:
        self.tree.abort_backup(req.op_id)
        if req.write_back:
            res = self.tree.drop(req.node_id)
            self._apply_evict(res, time.perf_counter())
            self.metrics.dropped_tokens.labels(reason=reason).inc(res.num_evicted)
        _log.info("backup_skipped", node=req.node_id, tokens=req.num_tokens, reason=reason)

    def _backup_done(self, req: BackupRequest, host: np.ndarray, handle: CopyHandle,
                     failed: list[bool]) -> None:
        self._inflight.pop(req.op_id, None)
        self._host_inflight -= len(host)
        assert self.host_pool is not None
        error = _error_of(handle)
        if error is not None or failed[0]:
            failed[0] = True
            self.host_pool.allocator.free(host)
            if error is not None:
                _log.warning("backup_failed", node=req.node_id, error=repr(error))
            self._backup_failed(req, "backup_failed")
            return
        ids = self.tree.commit_backup(req.op_id, host)
        if self._storage is not None:
            self._storage.backup_nodes(ids)
        result = handle.result()
        self.metrics.backup_tokens.inc(result.num_tokens)
        self.metrics.backup_bytes.inc(result.num_bytes)
        self.metrics.backup_duration.observe(result.duration_s)

    async def flush(self) -> None:
        """Wait until every copy started before this call has completed and been committed."""
        await self._settle(list(self._inflight.values()))

    @staticmethod
    async def _settle(handles: Sequence[CopyHandle]) -> None:
        """Wait for copies to finish (success or failure); their callbacks have run by then."""
        if handles:
            await asyncio.gather(*(h.done() for h in handles), return_exceptions=True)

    # ------------------------------------------------------------------ load-back (H -> D)
    def _load_size(self, match: MatchResult, mem_quota: int | None) -> int:
        """Tokens a load-back of ``match`` would copy, or 0 when it should be skipped."""
        n = match.host_hit_length
        if n == 0 or self._engine is None or match.pending_loads:
            return 0
        if n < self.config.load_back_threshold or (mem_quota is not None and n > mem_quota):
            return 0
        return n

    def _pin(self, match: MatchResult) -> tuple[LockReceipt, LockReceipt]:
        """Pin the device prefix and the host hit of ``match`` while making room for a load."""
        return self.tree.lock(match.last_device_node), self.tree.lock_host(match.best_node)

    def _unpin(self, pins: tuple[LockReceipt, LockReceipt]) -> None:
        self.tree.unlock(pins[0])
        self.tree.unlock_host(pins[1])

    def begin_load_back(self, match: MatchResult, *, mem_quota: int | None = None) -> LoadBack | None:
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

    def _start_load(self, match: MatchResult, slots: np.ndarray) -> LoadBack | None:
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
        handle.add_done_callback(lambda h: self._load_done(ticket, lb, h))
        return lb

    def _load_done(self, ticket: LoadBackTicket, lb: LoadBack, handle: CopyHandle) -> None:
        self._inflight.pop(ticket.op_id, None)
        error = _error_of(handle)
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

    async def load_back(self, match: MatchResult, *, mem_quota: int | None = None) -> LoadBack | None:
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

    def release_load(self, lb: LoadBack) -> None:
        """Release the lock a load-back took for its caller (or renounce it if still copying)."""
        if lb.receipt is not None:
            self.tree.unlock(lb.receipt)
            lb.receipt = None
        lb.abandoned = True

    async def wait_loads(self, op_ids: Sequence[int]) -> None:
        """Wait for the load-backs named by a match's ``pending_loads``."""
        handles = [self._inflight[i] for i in op_ids if i in self._inflight]
        if handles:
            await asyncio.gather(*(h.done() for h in handles),
                                 return_exceptions=True)

    # ------------------------------------------------------------------ storage (L3)
    def storage_layout(self, *, tp_rank: int = 0, tp_size: int = 1,
                       kv_replicated: bool = False) -> Any:
        """The :class:`storage.StorageLayout` naming this cache's pages in a backend."""
        from storage.base import StorageLayout

        c = self.config
        return StorageLayout(
            model=c.model_name, page_size=c.page_size, kv_dtype=str(c.torch_dtype).split(".")[-1],
            kv_layout="page-major", tp_rank=tp_rank, tp_size=tp_size,
            kv_replicated=kv_replicated, extra=f"L{c.num_layers}H{c.num_heads}D{c.head_dim}",
        )

    @property
    def storage(self) -> StorageTier | None:
        return self._storage

    def attach_storage(self, backend: Any, policy: StoragePolicy | None = None) -> None:
        """Use ``backend`` (a started :class:`storage.StorageBackend`) as the L3 tier.

        Pages backed up to host from now on are written to it; requests can prefetch from it.
        The caller keeps ownership of the backend (close it after the cache).
        """
        self._check_open()
        if self._storage is not None:
            raise ConfigError("a storage backend is already attached; detach it first")
        layout = getattr(backend, "layout", None)
        if layout is not None and layout.page_size != self.page_size:
            raise ConfigError(
                f"backend layout page_size {layout.page_size} != cache page_size {self.page_size}"
            )
        self.tree.enable_page_hashes()
        self._storage = StorageTier(self, backend, policy or StoragePolicy())

    async def detach_storage(self) -> None:
        """Stop using storage: abort prefetches, wait for writes, release their pins."""
        tier, self._storage = self._storage, None
        if tier is not None:
            await tier.close()

    def start_prefetch(self, key: RadixKey | Any, match: MatchResult) -> PrefetchOp | None:
        """Start fetching the pages after ``match``'s cached prefix from storage."""
        self._check_open()
        if self._storage is None:
            return None
        return self._storage.start_prefetch(as_key(key), match)

    async def prefetch_request(self, req: CacheRequest, *, policy: str | None = None) -> int:
        """Fetch ``req``'s uncached pages from storage into host memory (before it computes).

        ``policy``: the stop policy (default: the attached :class:`StoragePolicy`'s). Returns
        the tokens fetched; ``req.host_hit_length`` grows by as much (load them back next).
        """
        self._check_open()
        if self._storage is None or self.config.disable:
            return 0
        if req.finished or req.computed != req.prefix_len:
            raise InvalidInputError(
                f"request {req.rid}: prefetch_request must come before it computes tokens"
            )
        if req.pending_loads:
            await self.wait_loads(req.pending_loads)
        self._rematch(req)  # other requests may have cached more of the prompt since admit
        op = self._storage.start_prefetch(req.key, self._match_of(req))
        if op is None:
            return 0
        got = await self._storage.finish_prefetch(op, policy)
        if got:
            self._rematch(req)
        return got

    # ------------------------------------------------------------------ request helpers
    def admit(self, tokens: RadixKey | Any, rid: str | None = None) -> CacheRequest:
        """Match a new request and pin its cached prefix."""
        self._check_open()
        key = as_key(tokens)
        m = self.match_prefix(key)
        if rid is None:
            self._next_rid += 1
            rid = f"req-{self._next_rid}"
        receipt = None if self.config.disable else self.tree.lock(m.last_device_node)
        host = self.tree.lock_host(m.best_node) if m.host_hit_length else None
        return CacheRequest(
            rid=rid, key=key, slots=m.device_indices, prefix_len=m.device_prefix_len,
            last_node=m.last_device_node, best_node=m.best_node,
            host_hit_length=m.host_hit_length, receipt=receipt, host_receipt=host,
            pending_loads=m.pending_loads,
        )

    def _rematch(self, req: CacheRequest) -> None:
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

    def _release_pins(self, req: CacheRequest) -> None:
        if req.receipt is not None:
            self.tree.unlock(req.receipt)
            req.receipt = None
        if req.host_receipt is not None:
            self.tree.unlock_host(req.host_receipt)
            req.host_receipt = None

    async def load_back_request(self, req: CacheRequest, *, mem_quota: int | None = None) -> int:
        """Bring ``req``'s cached prefix onto the device before it computes anything.

        Waits for load-backs of its prefix started by other requests, then loads its own host hit
        if worth it (threshold, ``mem_quota``, room). Returns how many tokens the device prefix
        grew by; ``req.slots`` / ``req.prefix_len`` follow. The host hit stays pinned until then.
        """
        self._check_open()
        if req.finished or req.computed != req.prefix_len:
            raise InvalidInputError(
                f"request {req.rid}: load_back_request must come before it computes tokens"
            )
        before = req.prefix_len
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

    async def extend(self, req: CacheRequest, num_tokens: int) -> np.ndarray:
        """Reserve device slots for the next ``num_tokens`` tokens of ``req``; returns them.

        The caller writes the KV of those tokens into the returned slots.
        """
        if num_tokens < 0:
            raise InvalidInputError(f"num_tokens must be >= 0, got {num_tokens}")
        spare = req.spare
        if num_tokens <= len(spare):
            new, req.spare = spare[:num_tokens], spare[num_tokens:]
        else:
            pages = await self.alloc_device(num_tokens - len(spare))
            both = np.concatenate([spare, pages])
            new, req.spare = both[:num_tokens], both[num_tokens:]
        req.slots = np.concatenate([req.slots, new])
        return new

    def cache_unfinished_req(self, req: CacheRequest) -> None:
        """Cache what ``req`` computed so far and keep running: its slots now point at the tree's."""
        self._check_open()
        if self.config.disable or req.computed == req.prefix_len:
            return
        key = req.key[: req.computed]
        res = self.insert(key, req.slots, prev_prefix_len=req.prefix_len,
                          inserted_len=req.inserted_len)
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

    def cache_finished_req(self, req: CacheRequest, *, insert: bool = True) -> None:
        """Cache ``req``'s KV (unless ``insert=False``, e.g. on abort), free the rest, unlock."""
        self._check_open()
        if req.finished:
            raise InvalidInputError(f"request {req.rid} is already finished")
        own_from = req.prefix_len
        if insert and not self.config.disable and req.computed > 0:
            res = self.insert(req.key[: req.computed], req.slots, prev_prefix_len=req.prefix_len,
                              inserted_len=req.inserted_len)
            own_from = max(own_from, res.cached_len)
        self.free_device(np.concatenate([req.slots[own_from:], req.spare]))
        self._release_pins(req)
        req.spare = EMPTY_SLOTS
        req.finished = True

    def abort_req(self, req: CacheRequest) -> None:
        """Drop a request without caching its KV."""
        self.cache_finished_req(req, insert=False)

    # ------------------------------------------------------------------ KV access (for tests/replay)
    def _split_pages(self, slots: np.ndarray) -> tuple[np.ndarray, int]:
        """(page ids, tokens they cover) of the leading whole pages of ``slots``."""
        ps = self.page_size
        full = len(slots) // ps
        if ps == 1:
            return slots, len(slots)
        head = slots[: full * ps].reshape(full, ps)
        firsts = head[:, 0]
        whole = (firsts % ps == 0) & (head == firsts[:, None] + np.arange(ps)).all(axis=1)
        full = full if whole.all() else int(np.argmin(whole))
        return firsts[:full] // ps, full * ps

    def read_kv(self, slots: Any) -> torch.Tensor:
        """A copy of the device KV of ``slots`` as (layers, 2, n, heads, head_dim)."""
        arr = as_slots(slots, "slots")
        pool = self.device_pool
        L, H, D = self.shape.num_layers, self.shape.num_heads, self.shape.head_dim
        pages, covered = self._split_pages(arr)
        dev = pool.device
        parts = []
        if covered:
            got = pool.page_view().index_select(2, torch.tensor(pages, device=dev))
            parts.append(got.reshape(L, 2, covered, H, D))
        if covered < len(arr):
            parts.append(pool.kv.index_select(2, torch.tensor(arr[covered:], device=dev)))
        if not parts:
            return pool.kv[:, :, :0].cpu()
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)).cpu()

    def write_kv(self, slots: Any, values: torch.Tensor) -> None:
        """Write KV (layers, 2, n, heads, head_dim) into device ``slots``."""
        arr = as_slots(slots, "slots")
        if values.dim() != 5 or values.shape[2] != len(arr):
            raise InvalidInputError(
                f"KV of shape {tuple(values.shape)} for {len(arr)} slots; expected "
                f"(layers, 2, {len(arr)}, heads, head_dim)"
            )
        pool = self.device_pool
        values = values.to(device=pool.device, dtype=pool.kv.dtype)
        pages, covered = self._split_pages(arr)
        if covered:
            view = pool.page_view()
            src = values[:, :, :covered].reshape(view.shape[0], 2, len(pages), view.shape[3])
            view.index_copy_(2, torch.tensor(pages, device=pool.device), src)
        if covered < len(arr):
            pool.kv.index_copy_(2, torch.tensor(arr[covered:], device=pool.device),
                                values[:, :, covered:])
