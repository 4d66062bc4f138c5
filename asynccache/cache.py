"""HierarchicalCache: the async engine a scheduler uses, over L1 device and L2 host memory.

The tree core decides; this facade executes: it frees slots the tree gives up, runs the copies
the tree asks for on the copy engine, and commits them when they complete. Completions are
handled by done-callbacks on the loop (in submission order), never by polling, so a cancelled
awaiter cannot leave a copy half-committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from types import TracebackType
from typing import Any

import numpy as np
import torch

from asynccache.agreement import Agreement
from asynccache.attachment import StorageAttachmentMixin
from asynccache.buffer_mode import BufferModePipeline
from asynccache.config import CacheConfig
from asynccache.errors import (
    ClosedError,
    ConfigError,
    InvalidInputError,
    PoolExhaustedError,
)
from asynccache.hybrid_api import HybridMixin
from asynccache.hybrid_slots import HybridSlots
from asynccache.kvaccess import KVAccessMixin
from asynccache.l3 import StorageTier
from asynccache.ledger import SlotLedger
from asynccache.loadback import LoadBackMixin, copy_error
from asynccache.logs import get_logger
from asynccache.metrics import CacheMetrics
from asynccache.ranks import RankGroup, SingleRank
from asynccache.requests import RequestsMixin
from asynccache.retraction import RetractionMixin
from asynccache.sessions import SessionTracker, StreamingSession
from asynccache.transfers.handles import CopyHandle, LayerwiseHandle
from asynccache.transfers.hybrid_copies import GroupHandle
from asynccache.transfers.pools import DevicePool, HostPool, KVShape
from asynccache.tree import (
    BackupRequest,
    EvictResult,
    InsertResult,
    KVEvent,
    LockReceipt,
    MatchResult,
    RadixKey,
    RadixTree,
    TreeConfig,
    as_key,
    as_slots,
)
from asynccache.tree.results import EMPTY_SLOTS

_log = get_logger("cache")


class HierarchicalCache(RequestsMixin, LoadBackMixin, StorageAttachmentMixin, RetractionMixin,
                        KVAccessMixin, HybridMixin):
    """A prefix KV cache over a device pool (L1) and an optional host pool (L2).

    Use it as ``async with HierarchicalCache(config) as cache:``. The synchronous calls
    (``match_prefix``, ``insert``, ``evict``, ``lock``...) are cheap and must run on the loop's
    thread; copies are coroutines or handles.
    """

    def __init__(self, config: CacheConfig, *, metrics: CacheMetrics | None = None,
                 ranks: RankGroup | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise InvalidInputError(f"config must be a CacheConfig, got {config!r}")
        self.ranks, self._agree = self._rank_agreement(ranks, config)
        if self._agree is not None and config.host_mode == "buffer_only":
            raise ConfigError("host_mode='buffer_only' runs on a single rank only (no agreement "
                              "of its staging and intents across ranks yet)")
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
        if (config.retraction_backup and self.host_pool is not None
                and self.host_pool.num_slots < self.device_pool.num_slots):
            raise ConfigError(
                f"retraction_backup needs host capacity >= device capacity: "
                f"{self.host_pool.num_slots} host slots < {self.device_pool.num_slots} device slots"
            )
        self.tree = RadixTree(TreeConfig(
            page_size=config.page_size,
            eviction_policy=config.eviction_policy,
            host_enabled=config.host_tier,
            write_policy=config.write_policy,
            enable_kv_events=config.enable_kv_events,
            enable_page_hashes=config.enable_page_hashes,
            enable_sessions=config.enable_sessions,
            sliding_window=config.sliding_window,
            mamba=config.mamba_states > 0,
        ))
        self.sessions = SessionTracker(self.tree) if config.enable_sessions else None
        self._streams: dict[str, StreamingSession] = {}
        # Hybrid models: the SWA pool and slot map, the Mamba state pool (None: FULL only).
        self.hybrid = HybridSlots(config, self.device_pool) if config.hybrid else None
        if self.hybrid is not None and self.host_pool is not None:
            from asynccache.hybrid_tier import HybridTier

            self.hybrid.tier = HybridTier(config, self.hybrid, self.host_pool.num_slots,
                                          pin=self.host_pool.kv.is_pinned())
            if config.retraction_backup:
                self.hybrid.tier.check_retraction_capacity()
        self.metrics = metrics if metrics is not None else CacheMetrics()
        if self.host_pool is not None:
            self.metrics.host_total_tokens.set(self.host_pool.num_slots)
        self._engine: Any = None
        self._state = "new"
        self._inflight: dict[int, CopyHandle] = {}
        # Which device pages callers hold (handed out, not yet freed or adopted by the tree).
        self._ledger = SlotLedger(self.device_pool.allocator)
        self._host_inflight = 0  # host slots owned by operations: backups in flight, staging, retracted KV
        self._evicted_total = 0
        self._matched = 0
        self._hits = 0
        self._next_rid = 0
        self._close_task: asyncio.Task[None] | None = None
        # Detaches of storage tiers still closing (a cancelled detach_storage keeps going);
        # aclose waits for them before it frees anything.
        self._detaching: set[asyncio.Task[bool]] = set()
        self._compute_stream: Any = None  # see bind_compute_stream
        self._storage: StorageTier | None = None
        self._buffer: BufferModePipeline | None = None  # buffer-only host mode with storage
        self._copy_keys = itertools.count(-1, -1)  # _inflight keys of copies without a tree op

    # ------------------------------------------------------------------ ranks
    def _rank_agreement(self, ranks: RankGroup | None,
                        config: CacheConfig) -> tuple[RankGroup, Agreement | None]:
        """The rank group, and the agreement of deferred completions when it has several ranks."""
        if ranks is None:
            return SingleRank(), None
        if not isinstance(ranks, RankGroup):
            raise InvalidInputError(f"ranks must be a RankGroup, got {ranks!r}")
        if ranks.is_single:
            return ranks, None
        return ranks, Agreement(ranks, lambda: self._storage, self._agreed_state,
                                self._agreed_state_names(config))

    @staticmethod
    def _agreed_state_names(config: CacheConfig) -> tuple[str, ...]:
        names = ["tree nodes", "device tokens", "host tokens"]
        if config.sliding_window:
            names += ["swa device tokens", "swa device pool used", "swa host pool used"]
        if config.mamba_states:
            names += ["mamba device states", "mamba device pool used", "mamba host pool used"]
        return tuple(names)

    def _agreed_state(self) -> list[int]:
        """What every rank's tree and pools must share at a tick (see
        :meth:`_agreed_state_names`): hybrid caches add, per component, the units the tree
        holds on device and the usage of its device and host pools (those take every
        all-or-nothing allocation, so ranks whose pools drifted apart fail at the next tick
        instead of skipping different operations later)."""
        tree = self.tree
        out = [tree.node_count, tree.device_size, tree.host_size]
        hy = self.hybrid
        if hy is None:
            return out
        tier = hy.tier
        if hy.swa_map is not None:
            out += [sum(tree.component_sizes("swa")), hy.swa_map.swa.used_size,
                    tier.swa_host.allocator.used_size
                    if tier is not None and tier.swa_host is not None else 0]
        if hy.mamba_pool is not None:
            out += [sum(tree.component_sizes("mamba")), hy.mamba_pool.used_size,
                    tier.mamba_host.used_size
                    if tier is not None and tier.mamba_host is not None else 0]
        return out

    async def sync(self) -> int:
        """One agreement tick across the ranks; returns the completions it retired.

        With one rank completions commit on their own and this returns 0 at once. With several,
        every rank must call it at the same point; the cache's own waits tick by themselves.
        """
        self._check_open()
        return 0 if self._agree is None else await self._agree.sync()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> HierarchicalCache:
        if self._state != "new":
            raise ClosedError(f"cache cannot start: it is {self._state}")
        self.tree.bind_owner()
        if self.host_pool is not None:
            from asynccache.transfers.engine import CopyEngine

            self._engine = CopyEngine(self.device_pool, self.host_pool, name="asynccache-copy")
            await self._engine.start()
            if self.hybrid is not None and self.hybrid.tier is not None:
                await self.hybrid.tier.start()
        self._state = "running"
        if self._compute_stream is not None:
            self.bind_compute_stream(self._compute_stream)
        return self

    def bind_compute_stream(self, stream: Any) -> None:
        """Every copy the cache starts from now on waits for the work queued so far on
        ``stream`` (the stream the model's forward runs on; None: unbind). Without it, copies
        wait for the *submitting thread's current* stream only, which misses a forward on a side
        stream or another thread: a backup could read KV before the kernel wrote it. See the
        fence contract in docs/transfers.md. Applies to every copier (KV, SWA, Mamba states);
        before ``start`` it is kept and applied then."""
        engines = [self._engine]
        tier = self.hybrid.tier if self.hybrid is not None else None
        if tier is not None:
            engines += [tier.swa_engine, tier.states.engine if tier.states is not None else None]
        for engine in engines:
            if engine is not None:
                engine.bind_compute_stream(stream)  # (ConfigError: not a stream of its kind)
        self._compute_stream = stream

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
            await self.detach_storage()
            while self._detaching:
                await asyncio.gather(*list(self._detaching), return_exceptions=True)
            if self._engine is not None:
                await self._engine.aclose()
            if self.hybrid is not None and self.hybrid.tier is not None:
                await self.hybrid.tier.aclose()
        finally:
            if self.hybrid is not None:
                left = self.hybrid.release_tree(self.tree)
                if self.host_pool is not None:
                    for slots in left:
                        self.host_pool.allocator.free(slots)
            device, host = self.tree.reset() if not self.tree.pending_ops else ([], [])
            for slots in device:
                self.device_pool.allocator.free(slots)
            held = self._ledger.take_all()  # requests the close interrupted
            if len(held):
                if self.hybrid is not None:
                    self.hybrid.free_full(held)
                else:
                    self.device_pool.allocator.free(held)
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
        held = self._ledger.held_tokens
        if dev_used != self.tree.device_size + held:
            raise AssertionError(
                f"device accounting: allocator uses {dev_used} slots, tree holds "
                f"{self.tree.device_size} and callers {held}"
            )
        if self.host_pool is not None:
            host_used = self.host_pool.allocator.used_size
            want = self.tree.host_size + self._host_inflight
            if host_used != want:
                raise AssertionError(
                    f"host accounting: allocator uses {host_used} slots, tree holds "
                    f"{self.tree.host_size} and operations (backups in flight, staging, "
                    f"retracted requests) {self._host_inflight}"
                )
        if self._buffer is not None:
            self._buffer.check()
        if self.hybrid is not None:
            self.hybrid.check(self.tree)

    # ------------------------------------------------------------------ tree calls
    def _key(self, key: RadixKey | Any) -> RadixKey:
        """``key`` as a RadixKey, its token ids checked against ``max_token_id``."""
        key = as_key(key)
        bound = self.config.max_token_id
        if bound is not None and key.data:
            ids = np.frombuffer(key.data, dtype="<u4")
            if int(ids.max()) > bound:
                pos = int(np.argmax(ids > bound))
                raise InvalidInputError(
                    f"token id {int(ids[pos])} at position {pos} exceeds max_token_id {bound} "
                    "(CacheConfig: the model's largest token id)"
                )
        return key

    def match_prefix(self, key: RadixKey | Any, *, cow_mamba: bool = False) -> MatchResult:
        """Longest cached prefix; ``cow_mamba`` (hybrid) reports the Mamba state to copy (see
        :meth:`mamba_copy_on_write`)."""
        self._check_open()
        key = self._key(key)
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
        key = self._key(key)
        value, held = self._check_insert_slots(key, value, prev_prefix_len)
        if self.hybrid is not None:
            return self._insert_hybrid(key, value, prev_prefix_len, inserted_len, priority,
                                       swa_evicted_seqlen, mamba_value, held)
        res = self.tree.insert(key, value, prev_prefix_len=prev_prefix_len,
                               inserted_len=inserted_len, priority=priority)
        self._release_inserted(held, res.cached_len)
        for slots in res.device_frees:
            self.device_pool.allocator.free(slots)
        if res.backups:
            self._start_backups(res.backups)
        if res.intents and self._buffer is not None:
            self._buffer.enqueue(res.intents)
        return res

    def _check_insert_slots(self, key: RadixKey, value: Any,
                            prev_prefix_len: Any) -> tuple[np.ndarray, tuple[int, np.ndarray]]:
        """``value`` as slots, checked before the tree sees them: from the page of
        ``prev_prefix_len`` to the key's last whole page (what the tree adopts or gives back as
        duplicates) they must be whole pages the caller holds. Returns the slots and (that
        start, those pages) for :meth:`_release_inserted`. (Malformed arguments are left to the
        tree's own checks, which name them.)"""
        slots = as_slots(value, "value")
        ps = self.page_size
        end = len(key) - len(key) % ps
        if (isinstance(prev_prefix_len, bool) or not isinstance(prev_prefix_len, int)
                or not 0 <= prev_prefix_len <= len(slots) or len(slots) != len(key)):
            return slots, (end, EMPTY_SLOTS)
        lo = prev_prefix_len - prev_prefix_len % ps
        pages = self._ledger.check(slots[lo:end], "value") if end > lo else EMPTY_SLOTS
        return slots, (lo, pages)

    def _release_inserted(self, held: tuple[int, np.ndarray], cached_len: int) -> None:
        """The caller's pages up to the insert's cached length are the tree's now (adopted, or
        freed as duplicates); those past it stay the caller's."""
        lo, pages = held
        n = max(0, cached_len - lo) // self.page_size
        if n:
            self._ledger.release_pages(pages[:n])

    @property
    def outstanding_device_tokens(self) -> int:
        """Device slots held by callers: handed out, not yet freed or adopted by an insert."""
        return self._ledger.held_tokens

    def lock(self, node_id: int, *, skip: tuple[str, ...] = ()) -> LockReceipt:
        """Pin a matched node (hybrid: also one SWA window and its Mamba state, unless
        ``skip`` names them)."""
        self._check_open()
        return self.tree.lock(node_id, skip=skip)

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
                self._ledger.hand_out(slots)
            return slots
        alloc = self.device_pool.allocator
        slots = alloc.alloc(need)
        if slots is None:
            self.evict(need - alloc.available_size)
            slots = alloc.alloc(need)
        if slots is not None:
            self._ledger.hand_out(slots)
        return slots

    async def alloc_device(self, num_tokens: int) -> np.ndarray:
        """Allocate whole pages for ``num_tokens``, evicting (and writing back) as needed.

        Raises :class:`PoolExhaustedError` when the pool cannot hold them even after eviction.
        """
        self._check_open()
        need = self._round_up(num_tokens)
        if self.hybrid is not None:
            hy = self.hybrid

            async def attempt() -> np.ndarray | None:
                return self.try_alloc_device(need)

            return await self._alloc_waiting(
                attempt,
                lambda: f"cannot allocate {need} device slots (FULL, SWA free: "
                        f"{hy.available()}), {self.tree.protected_size} locked",
            )
        alloc = self.device_pool.allocator

        async def attempt_full() -> np.ndarray | None:
            slots: np.ndarray | None = alloc.alloc(need)
            if slots is None:
                await self.evict_async(need - alloc.available_size)  # writes back if needed
                slots = alloc.alloc(need)
            if slots is not None:
                self._ledger.hand_out(slots)
            return slots

        return await self._alloc_waiting(
            attempt_full,
            lambda: f"cannot allocate {need} device slots: {alloc.available_size} free, "
                    f"{self.tree.evictable_size} evictable, {self.tree.protected_size} locked, "
                    f"{self._ledger.held_tokens} held by requests",
        )

    async def _alloc_waiting(self, attempt: Callable[[], Awaitable[np.ndarray | None]],
                             error: Callable[[], str]) -> np.ndarray:
        """Await ``attempt`` (an allocation that evicts as needed) until it gives slots.
        Between tries it waits for copies in flight, which pin their victims until they land
        (write-back and write-through), and, for at most ``alloc_wait_s``, for storage writes
        when their host pins are what protects device pages (``tree.host_pinned_size``): a
        storage write can free nothing else, and a dead store must not stall the scheduler.
        Raises :class:`PoolExhaustedError` with ``error()`` when nothing is left to wait for."""
        deadline: float | None = None
        for _ in range(64):
            got = await attempt()
            if got is not None:
                return got
            in_flight = list(self._inflight.values())
            if in_flight:
                await self._settle(in_flight)
                continue
            storage = self._storage
            if storage is None or not storage.writes_pending or not self.tree.host_pinned_size:
                break
            if self._agree is not None:
                # Several ranks must take the same decision: no local deadline (the drain
                # retires writes at agreed ticks).
                await storage.drain()
                continue
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.config.alloc_wait_s
            left = deadline - loop.time()
            if left <= 0:
                raise PoolExhaustedError(
                    f"{error()}; {self.tree.host_pinned_size} device tokens wait for storage "
                    f"writes that did not finish within alloc_wait_s={self.config.alloc_wait_s}"
                )
            # (drain() shields the writes: the timeout only stops this wait.)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(storage.drain(), left)
        raise PoolExhaustedError(error())

    def free_device(self, slots: Any) -> None:
        """Return slots obtained from :meth:`alloc_device` (whole pages). Slots the caller does
        not hold (the tree's, never handed out, already freed) are refused before anything is
        freed (:class:`InvalidInputError` naming one)."""
        self._check_open()
        arr = as_slots(slots, "slots")
        if len(arr):
            pages = self._ledger.release(arr)
            if self.hybrid is not None:
                self.hybrid.free_full(arr)
            else:
                self.device_pool.allocator.free_pages(pages)

    def _alloc_host(self, num_tokens: int) -> np.ndarray | None:
        assert self.host_pool is not None
        alloc = self.host_pool.allocator
        slots = alloc.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens - alloc.available_size)
            slots = alloc.alloc(num_tokens)
        return slots

    # ------------------------------------------------------------------ internal: operation-owned
    # host slots and untracked copies (used by the buffer-only pipeline)
    def take_host(self, num_tokens: int, *, evict: bool = True) -> np.ndarray | None:
        """Host slots owned by an operation (staging, a bounce) until :meth:`free_host`;
        ``sanity_check`` counts them. None when the pool cannot provide them."""
        if self.host_pool is None:
            return None
        slots = self._alloc_host(num_tokens) if evict else self.host_pool.allocator.alloc(num_tokens)
        if slots is not None:
            self._host_inflight += len(slots)
        return slots

    def free_host(self, slots: np.ndarray) -> None:
        """Return slots from :meth:`take_host`."""
        assert self.host_pool is not None
        if len(slots):
            self.host_pool.allocator.free(slots)
            self._host_inflight -= len(slots)

    def _track_copy(self, handle: CopyHandle) -> CopyHandle:
        key = next(self._copy_keys)
        self._inflight[key] = handle
        handle.add_done_callback(lambda _h: self._inflight.pop(key, None))
        return handle

    def engine_submit_d2h(self, device_slots: np.ndarray, host_slots: np.ndarray) -> CopyHandle:
        """A D->H copy that :meth:`flush`, ``alloc_device`` and ``aclose`` wait for."""
        return self._track_copy(self._engine.submit_d2h(device_slots, host_slots))

    def engine_submit_h2d(self, host_slots: np.ndarray, device_slots: np.ndarray) -> LayerwiseHandle:
        """A layer-wise H->D copy that :meth:`flush`, ``alloc_device`` and ``aclose`` wait for."""
        handle: LayerwiseHandle = self._engine.submit_h2d_layerwise(host_slots, device_slots)
        self._track_copy(handle)
        return handle

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

    def evict_host(self, num_tokens: int, *, reclaim_duplicates: bool | None = None) -> int:
        """Free at least ``num_tokens`` host tokens: host-only leaves; host copies of pages
        still on device only under write-back, or when ``reclaim_duplicates=True`` (then only
        copies with no host-copied child, so host copies stay prefix-closed; see
        ``RadixTree.evict_host``).

        A no-op in buffer-only host mode: the tree holds nothing on host."""
        self._check_open()
        if not self.config.host_tier:
            return 0
        res = self.tree.evict_host(num_tokens, reclaim_duplicates=reclaim_duplicates)
        if res.host_frees:
            assert self.host_pool is not None
            for slots in res.host_frees:
                self.host_pool.allocator.free(slots)
        if res.component_host_frees and self.hybrid is not None and self.hybrid.tier is not None:
            self.hybrid.tier.free_host(res.component_host_frees)
        return res.num_evicted

    # ------------------------------------------------------------------ backups (D -> H)
    def _start_backups(self, reqs: Sequence[BackupRequest]) -> list[CopyHandle]:
        """Submit the D->H copies of ``reqs`` (a root-first chain); commits happen on completion."""
        handles: list[CopyHandle] = []
        failed = [False]  # shared by the chain: a failed ancestor aborts its descendants
        tier = self.hybrid.tier if self.hybrid is not None else None
        for i, req in enumerate(reqs):
            host = self._alloc_host(req.num_tokens) if self._engine is not None else None
            parts: dict[str, np.ndarray] = {}
            if host is not None and req.component_slots:
                assert tier is not None
                got = tier.alloc_backup(req, self.evict_host)
                if got is None:  # all or nothing: a component pool is short
                    self.host_pool.allocator.free(host)  # type: ignore[union-attr]
                    self.metrics.hybrid_skipped.labels(op="backup").inc()
                    host = None
                else:
                    parts = got
            if host is None:
                for rest in reqs[i:]:
                    self._backup_failed(rest, "host_pressure")
                break
            self._host_inflight += len(host)
            handle = self._engine.submit_d2h(req.device_slots, host)
            if parts:
                assert tier is not None
                handle = GroupHandle([handle, *tier.submit_d2h(req, parts)])
            self._inflight[req.op_id] = handle
            if self._agree is not None:  # multi-rank: commit at the tick all ranks agree on
                self._agree.defer_copy(handle, partial(self._backup_done, req, host, handle,
                                                       failed, parts))
                handles.append(handle)
                continue
            handle.add_done_callback(
                lambda h, req=req, host=host, parts=parts: self._backup_done(req, host, h, failed,
                                                                             parts))
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
                     failed: list[bool], parts: dict[str, np.ndarray] | None = None,
                     peer_error: BaseException | None = None) -> None:
        """Commit (or undo) a finished backup; ``peer_error``: multi-rank, the copy failed on
        another rank, so it is undone here as well."""
        self._inflight.pop(req.op_id, None)
        self._host_inflight -= len(host)
        assert self.host_pool is not None
        error = copy_error(handle) or peer_error
        if parts:
            assert self.hybrid is not None and self.hybrid.tier is not None
            self.hybrid.tier.release_backup(parts, free=error is not None or failed[0])
        if error is not None or failed[0]:
            failed[0] = True
            self.host_pool.allocator.free(host)
            if error is not None:
                _log.warning("backup_failed", node=req.node_id, error=repr(error))
            self._backup_failed(req, "backup_failed")
            return
        ids = self.tree.commit_backup(req.op_id, host, parts)
        if self._storage is not None:
            self._storage.backup_nodes(ids)
        result = handle.result()
        self.metrics.backup_tokens.inc(result.num_tokens)
        self.metrics.backup_bytes.inc(result.num_bytes)
        self.metrics.backup_duration.observe(result.duration_s)

    async def flush(self) -> None:
        """Wait until every copy started before this call has completed and been committed.

        In buffer-only host mode, first start the D->H copies of the queued storage writes."""
        if self._buffer is not None:
            self._buffer.launch_writes()
        await self._settle(list(self._inflight.values()))

    async def _settle(self, handles: Sequence[CopyHandle]) -> None:
        """Wait for copies to finish (success or failure); their callbacks have run by then."""
        if self._agree is not None:
            await self._agree.settle(handles)
        elif handles:
            await asyncio.gather(*(h.done() for h in handles), return_exceptions=True)
