"""HierarchicalCache: the async engine a scheduler uses, over L1 device and L2 host memory.

This module wires the cache's services together and owns its lifecycle; every public member is
a short delegation. The tree core decides; the engine (:mod:`asynccache.engine`) executes: it
frees slots the tree gives up, runs the copies the tree asks for and commits them when they
complete (done-callbacks on the loop, never polling, so a cancelled awaiter cannot leave a copy
half-committed). Storage (:mod:`asynccache.l3`, :mod:`asynccache.buffer`), retraction and the
request flow are services on top. See docs/cache.md for the module map.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch

from asynccache.attachment import StorageAttachment
from asynccache.buffer import BufferModePipeline
from asynccache.config import CacheConfig
from asynccache.engine import (
    AgreedCommits,
    CommitPolicy,
    HybridOps,
    ImmediateCommits,
    KVAccess,
    LoadBack,
    LoadBacks,
    Parts,
    TaskOwner,
    Tiering,
)
from asynccache.engine.sidecars import Sidecar
from asynccache.engine.slots import agreed_state_names
from asynccache.errors import ConfigError, InvalidInputError
from asynccache.l3 import PrefetchOp, StoragePolicy, StorageTier
from asynccache.metrics import CacheMetrics
from asynccache.ranks import Agreement, RankGroup, SingleRank
from asynccache.request import CacheRequest, RetractedKV
from asynccache.requests import RequestFlow
from asynccache.retraction import Retraction
from asynccache.sessions import SessionTracker, StreamingSession
from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.sidecars import SidecarSpec
from asynccache.tree import (
    BigramKey,
    InsertResult,
    KVEvent,
    LockReceipt,
    MatchResult,
    RadixKey,
)
from asynccache.tree.config import _check_count


def _quota(mem_quota: Any) -> int | None:
    """``mem_quota`` (tokens, or None: no quota), checked."""
    return None if mem_quota is None else _check_count("mem_quota", mem_quota)


class HierarchicalCache:
    """A prefix KV cache over a device pool (L1) and an optional host pool (L2).

    Use it as ``async with HierarchicalCache(config) as cache:``. The synchronous calls
    (``match_prefix``, ``insert``, ``evict``, ``lock``...) are cheap and must run on the loop's
    thread; copies are coroutines or handles.
    """

    def __init__(self, config: CacheConfig, *, metrics: CacheMetrics | None = None,
                 ranks: RankGroup | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise InvalidInputError(f"config must be a CacheConfig, got {config!r}")
        if ranks is None:
            ranks = SingleRank()
        elif not isinstance(ranks, RankGroup):
            raise InvalidInputError(f"ranks must be a RankGroup, got {ranks!r}")
        if not ranks.is_single and config.host_mode == "buffer_only":
            raise ConfigError("host_mode='buffer_only' runs on a single rank only (no agreement "
                              "of its staging and intents across ranks yet)")
        self.config = config
        self.ranks = ranks
        parts = Parts.build(config, metrics)
        self._parts = parts
        self.page_size = config.page_size
        self.shape = parts.shape
        self.device_pool = parts.device_pool
        self.host_pool = parts.host_pool
        self.tree = parts.tree
        self.hybrid = parts.hybrid
        self.metrics = parts.metrics
        commits: CommitPolicy = ImmediateCommits()
        if not ranks.is_single:
            commits = AgreedCommits(Agreement(ranks, lambda: self._storage.tier,
                                              lambda: self._tiering.agreed_state(),
                                              agreed_state_names(config)))
        self._tasks = TaskOwner()
        self._tiering = Tiering(parts, commits)
        self._loads = LoadBacks(self._tiering)
        self._hybrid = HybridOps(self._tiering)
        self._kv = KVAccess(parts.device_pool, parts.shape)
        self._storage = StorageAttachment(self._tiering, self._loads, ranks, self._tasks)
        self._retraction = Retraction(self._tiering, self._loads, self._hybrid, self._storage,
                                      self)
        self._requests = RequestFlow(self._tiering, self._loads, self._hybrid, self._storage,
                                     self._retraction, self)
        self.sessions: SessionTracker | None = self._requests.sessions
        self._close_task: asyncio.Task[None] | None = None
        self._compute_stream: Any = None  # see bind_compute_stream

    # ------------------------------------------------------------------ introspection
    @property
    def state(self) -> str:
        """``new``, ``running``, ``closing`` or ``closed``."""
        return self._parts.life.state

    @property
    def copy_engine(self) -> CopyEngine | None:
        """The KV copy engine (None without a host tier, or before ``start``)."""
        return self._tiering.copier

    @property
    def agreement(self) -> Agreement | None:
        """The agreement of the ranks (None with one rank)."""
        return self._tiering.commits.agreement

    @property
    def host_in_flight(self) -> int:
        """Host slots operations hold: backups in flight, storage writes and prefetches,
        buffer staging, retracted requests."""
        return self._tiering.ledger.host_tokens

    # ------------------------------------------------------------------ ranks
    async def sync(self) -> int:
        """One agreement tick across the ranks; returns the completions it retired.

        With one rank completions commit on their own and this returns 0 at once. With several,
        every rank must call it at the same point; the cache's own waits tick by themselves.
        """
        self._check_open()
        return await self._tiering.commits.sync()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> HierarchicalCache:
        life = self._parts.life
        if life.state != "new":
            from asynccache.errors import ClosedError

            raise ClosedError(f"cache cannot start: it is {life.state}")
        self.tree.bind_owner()
        await self._tiering.start()
        life.state = "running"
        self.bind_compute_stream(self._compute_stream)
        return self

    def bind_compute_stream(self, stream: Any) -> None:
        """Every copy the cache starts from now on waits for the work queued so far on
        ``stream`` (the stream the model's forward runs on; None: unbind). Without it, copies
        wait for the *submitting thread's current* stream only, which misses a forward on a side
        stream or another thread: a backup could read KV before the kernel wrote it. See the
        fence contract in docs/transfers.md. Applies to every copier (KV, SWA, Mamba states);
        before ``start`` it is kept and applied then."""
        for copier in self._tiering.copiers():
            copier.bind_compute_stream(stream)  # (ConfigError: not a stream of its kind)
        self._compute_stream = stream

    async def aclose(self) -> None:
        """Wait for in-flight copies, commit them, free every slot, stop the copy thread.

        Cancelling ``aclose`` does not stop the shutdown: it finishes in the background, and a
        second ``aclose`` waits for it.
        """
        life = self._parts.life
        if life.state == "new":
            life.state = "closed"
            return
        if self._close_task is None:
            if life.state == "closed":
                return
            life.state = "closing"
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        t = self._tiering
        try:
            await t.settle_all()
            await self._storage.detach()
            await self._storage.wait_detached()
            await t.stop_copiers()
        finally:
            t.release_all()
            self._parts.life.state = "closed"

    async def __aenter__(self) -> HierarchicalCache:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        self._parts.life.check_open()

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
        return len(self._tiering.copies)

    @property
    def outstanding_device_tokens(self) -> int:
        """Device slots held by callers: handed out, not yet freed or adopted by an insert."""
        return self._tiering.ledger.held_tokens

    def take_events(self) -> list[KVEvent]:
        return self.tree.take_events()

    def refresh_gauges(self) -> None:
        m = self.metrics
        m.evictable_tokens.set(self.tree.evictable_size)
        m.protected_tokens.set(self.tree.protected_size)
        m.host_used_tokens.set(self.host_pool.allocator.used_size if self.host_pool else 0)

    def sanity_check(self) -> None:
        """Tree invariants plus pool accounting: every allocated slot has exactly one owner."""
        self._tiering.check()
        self._storage.check()

    # ------------------------------------------------------------------ tree calls
    def match_prefix(self, key: RadixKey | Any, *, cow_mamba: bool = False) -> MatchResult:
        """Longest cached prefix; ``cow_mamba`` (hybrid) reports the Mamba state to copy (see
        :meth:`mamba_copy_on_write`)."""
        self._check_open()
        t = self._tiering
        return t.match_prefix(self.tree.key_of(t.key(key)), cow_mamba=cow_mamba)

    def insert(self, key: RadixKey | Any, value: Any, *, prev_prefix_len: int = 0,
               inserted_len: int = 0, priority: int = 0,
               swa_evicted_seqlen: int = 0, mamba_value: int | None = None) -> InsertResult:
        """Insert and execute: duplicate slots are freed here, write-through backups started.

        The slots of ``value`` past ``prev_prefix_len`` must come from :meth:`alloc_device`; the
        tree adopts the page-aligned part, the unaligned tail stays the caller's.

        Hybrid caches: the SWA slots are the pairs of ``value`` (the request already freed
        those of its first ``swa_evicted_seqlen`` tokens, see :meth:`free_swa`);
        ``mamba_value`` is a state from :meth:`alloc_mamba_state` after the page-aligned key.

        EAGLE caches (``CacheConfig(eagle=True)``): ``key`` of ``N + 1`` raw tokens names ``N``
        bigram positions; ``value`` gives their ``N`` slots, or ``N + 1`` (one per raw token,
        the last one staying the caller's, as an unaligned tail does). A
        :class:`~asynccache.tree.BigramKey` is taken as is (``N`` slots).
        """
        self._check_open()
        if self.config.disable:
            raise InvalidInputError("insert is not available on a disabled cache")
        t = self._tiering
        key = t.key(key)  # (raw tokens checked as given: an error names their position)
        if self.config.eagle and not isinstance(key, BigramKey):
            key = self.tree.key_of(key)
            if hasattr(value, "__len__") and len(value) == len(key) + 1:
                value = value[: len(key)]
        return t.insert(key, value, prev_prefix_len=prev_prefix_len,
                        inserted_len=inserted_len, priority=priority,
                        swa_evicted_seqlen=swa_evicted_seqlen, mamba_value=mamba_value)

    def lock(self, node_id: int, *, skip: tuple[str, ...] = ()) -> LockReceipt:
        """Pin a matched node (hybrid: also one SWA window and its Mamba state, unless
        ``skip`` names them)."""
        self._check_open()
        return self.tree.lock(node_id, skip=skip)

    def unlock(self, receipt: LockReceipt) -> int:
        self._check_open()
        return self.tree.unlock(receipt)

    # ------------------------------------------------------------------ slots
    def try_alloc_device(self, num_tokens: int) -> np.ndarray | None:
        """Allocate whole pages for ``num_tokens`` (rounded up), evicting synchronously if short.

        Returns None when even eviction cannot make room; then nothing is evicted (under
        write-back, use :meth:`alloc_device`, which waits for write-back copies).
        """
        self._check_open()
        n = _check_count("num_tokens", num_tokens)
        return self._tiering.try_alloc(self._tiering.round_up(n))

    async def alloc_device(self, num_tokens: int) -> np.ndarray:
        """Allocate whole pages for ``num_tokens``, evicting (and writing back) as needed.

        Raises :class:`PoolExhaustedError` when the pool cannot hold them even after eviction;
        nothing is evicted for an allocation that eviction cannot satisfy.
        """
        self._check_open()
        n = _check_count("num_tokens", num_tokens)
        return await self._tiering.alloc(self._tiering.round_up(n))

    def free_device(self, slots: Any) -> None:
        """Return slots obtained from :meth:`alloc_device` (whole pages). Slots the caller does
        not hold (the tree's, never handed out, already freed) are refused before anything is
        freed (:class:`InvalidInputError` naming one)."""
        self._check_open()
        self._tiering.free(slots)

    def take_host(self, num_tokens: int, *, evict: bool = True) -> np.ndarray | None:
        """Host slots an operation of the caller's owns (a staging buffer, a bounce) until
        :meth:`free_host`; ``sanity_check`` counts them (``host_in_flight``). None when the
        pool cannot provide them (``evict``: after evicting host copies)."""
        self._check_open()
        return self._tiering.take_host(_check_count("num_tokens", num_tokens), evict=evict)

    def free_host(self, slots: np.ndarray) -> None:
        """Return slots from :meth:`take_host`."""
        self._tiering.free_host(slots)

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int, *, swa_num_tokens: int = 0, mamba_num: int = 0) -> int:
        """Free at least ``num_tokens`` device tokens now if possible; returns tokens freed.

        Under write-back, un-backed victims start their write-back copy and are demoted by a
        later call (see :meth:`evict_async`). Hybrid caches also take SWA-token and Mamba-state
        targets (their slots go back to their own pools).
        """
        self._check_open()
        return self._tiering.evict(num_tokens, swa_num_tokens=swa_num_tokens, mamba_num=mamba_num)

    async def evict_async(self, num_tokens: int) -> int:
        """Like :meth:`evict`, but waits for write-back copies and demotes their nodes."""
        self._check_open()
        return await self._tiering.evict_async(_check_count("num_tokens", num_tokens))

    def evict_host(self, num_tokens: int, *, reclaim_duplicates: bool | None = None) -> int:
        """Free at least ``num_tokens`` host tokens: host-only leaves; host copies of pages
        still on device only under write-back, or when ``reclaim_duplicates=True`` (then only
        copies with no host-copied child, so host copies stay prefix-closed; see
        ``RadixTree.evict_host``).

        A no-op in buffer-only host mode: the tree holds nothing on host."""
        self._check_open()
        return self._tiering.evict_host(num_tokens, reclaim_duplicates=reclaim_duplicates)

    async def flush(self) -> None:
        """Wait until every copy started before this call has completed and been committed.

        In buffer-only host mode, first start the D->H copies of the queued storage writes."""
        self._storage.flush_writes()
        await self._tiering.settle_all()

    # ------------------------------------------------------------------ load-back (L2 -> L1)
    def begin_load_back(self, match: MatchResult, *, mem_quota: int | None = None) -> LoadBack | None:
        """Start loading ``match``'s host hit into device memory; returns None when skipped.

        Skipped when there is no host hit, when it is shorter than ``load_back_threshold``, when
        it exceeds ``mem_quota`` tokens, when it is already being loaded (``pending_loads``) or
        when the device cannot make room without waiting. The copy runs layer by layer:
        ``await lb.layer(i)`` before reading layer ``i``.
        """
        self._check_open()
        return self._loads.begin_load_back(match, mem_quota=_quota(mem_quota))

    async def load_back(self, match: MatchResult, *, mem_quota: int | None = None) -> LoadBack | None:
        """Load ``match``'s host hit and wait for it; the result holds a lock on the prefix.

        Cancelling the caller leaves no lock behind: the copy still completes and commits.
        """
        self._check_open()
        return await self._loads.load_back(match, mem_quota=_quota(mem_quota))

    def release_load(self, lb: LoadBack) -> None:
        """Release the lock a load-back took for its caller (or renounce it if still copying)."""
        if not isinstance(lb, LoadBack):
            raise InvalidInputError(f"release_load needs a LoadBack, got {lb!r}")
        self._loads.release_load(lb)

    async def wait_loads(self, op_ids: Sequence[int]) -> None:
        """Wait for the load-backs named by a match's ``pending_loads``."""
        await self._loads.wait_loads(op_ids)

    # ------------------------------------------------------------------ requests
    def admit(self, tokens: RadixKey | Any, rid: str | None = None, *,
              session_id: str | None = None, priority: int = 0) -> CacheRequest:
        """Match a new request and pin its cached prefix.

        ``session_id``: the radix session the request belongs to (needs ``enable_sessions``);
        when it finishes and is cached, its path is referenced for the session. ``priority``
        goes with every insert of the request (see the ``priority`` eviction policy).
        """
        self._check_open()
        return self._requests.admit(tokens, rid, session_id=session_id, priority=priority)

    async def load_back_request(self, req: CacheRequest, *, mem_quota: int | None = None) -> int:
        """Bring ``req``'s cached prefix onto the device before it computes anything.

        Waits for load-backs of its prefix started by other requests, then loads its own host hit
        if worth it (threshold, ``mem_quota``, room). Returns how many tokens the device prefix
        grew by; ``req.slots`` / ``req.prefix_len`` follow. The host hit stays pinned until then.
        """
        self._check_open()
        return await self._requests.load_back_request(req, _quota(mem_quota))

    def begin_load_back_request(self, req: CacheRequest, *,
                                mem_quota: int | None = None) -> LoadBack | None:
        """Start loading ``req``'s host hit without waiting for it, so a forward can start
        layer ``i`` once ``await lb.layer(i)`` returns while later layers still copy.

        Returns None when nothing is loaded (no host hit, under ``load_back_threshold`` or
        over ``mem_quota``, a load of the prefix already running, or no device room): compute
        instead. Otherwise ``req.slots`` / ``req.prefix_len`` already cover the loaded prefix;
        call :meth:`finish_load_back_request` before the request goes on (``extend`` first
        raises :class:`InvalidInputError` there; keep the new KV until then)."""
        self._check_open()
        return self._requests.begin_load_back_request(req, _quota(mem_quota))

    async def finish_load_back_request(self, req: CacheRequest, lb: LoadBack) -> None:
        """Wait until ``lb`` (from :meth:`begin_load_back_request`) committed and pin the loaded
        prefix for ``req``. If the load failed (:class:`TransferError`) or the wait is
        cancelled, ``req`` goes back to the prefix the tree holds (``prefix_len`` may shrink;
        the KV of the failed part must be computed) and the error propagates."""
        self._check_open()
        await self._requests.finish_load_back_request(req, lb)

    async def extend(self, req: CacheRequest, num_tokens: int) -> np.ndarray:
        """Reserve device slots for the next ``num_tokens`` tokens of ``req``; returns them.

        The caller writes the KV of those tokens into the returned slots.
        """
        self._check_open()
        return await self._requests.extend(req, num_tokens)

    def cache_unfinished_req(self, req: CacheRequest) -> None:
        """Cache what ``req`` computed so far and keep running: its slots now point at the tree's."""
        self._check_open()
        self._requests.cache_unfinished_req(req)

    def cache_finished_req(self, req: CacheRequest, *, insert: bool = True) -> None:
        """Cache ``req``'s KV (unless ``insert=False``, e.g. on abort), free the rest, unlock."""
        self._check_open()
        self._requests.cache_finished_req(req, insert=insert)

    def abort_req(self, req: CacheRequest) -> None:
        """Drop a request without caching its KV."""
        self.cache_finished_req(req, insert=False)

    def release_swa_window(self, req: CacheRequest) -> int:
        """Hybrid: free the SWA slots of ``req``'s own tokens that slid out of the window,
        keeping a cushion of window + one page; returns how many were freed."""
        self._check_open()
        return self._requests.release_swa_window(req)

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str) -> int:
        """Start a new generation of a radix session; returns its generation number."""
        self._check_open()
        return self._requests.session_tracker().open(session_id)

    def release_session(self, session_id: str) -> int:
        """Close a radix session: its paths become ordinary eviction candidates again."""
        self._check_open()
        return self._requests.session_tracker().release(session_id)

    def stream(self, session_id: str) -> StreamingSession:
        """Open a streaming session: one request whose KV stays pinned across turns."""
        self._check_open()
        return self._requests.stream(session_id)

    @property
    def streaming_held_tokens(self) -> int:
        """Device tokens held by open streaming sessions (not evictable while they are open)."""
        return self._requests.streaming_held_tokens

    # ------------------------------------------------------------------ retraction
    async def retract(self, req: CacheRequest) -> RetractedKV:
        """Copy ``req``'s KV to host and free its device slots and locks.

        Hybrid caches also copy the SWA KV of its last window and its own Mamba state, and free
        them on the device. Raises :class:`PoolExhaustedError` naming every host pool that
        cannot hold its part even after evicting host-only leaves (the request is then
        unchanged: all or nothing).
        """
        self._check_open()
        return await self._retraction.retract(req)

    async def restore(self, req: CacheRequest) -> None:
        """Copy ``req``'s retracted KV into fresh device slots; the request continues from there.

        The restored slots all belong to the request (a later ``cache_finished_req`` inserts
        them and frees duplicates of what the tree meanwhile holds). Hybrid caches: the tokens
        from the backup's ``swa_from`` get FULL+SWA pairs with their SWA KV, those below it
        FULL slots only (``req.swa_evicted`` becomes ``swa_from``), and the request gets a fresh
        Mamba state holding its backed-up one.
        """
        self._check_open()
        await self._retraction.restore(req)

    def discard_retracted(self, req: CacheRequest) -> None:
        """Drop ``req``'s retracted KV (the request will recompute or is being aborted)."""
        self._retraction.discard(req)

    # ------------------------------------------------------------------ storage (L3)
    def storage_layout(self, *, tp_rank: int | None = None, tp_size: int | None = None,
                       kv_replicated: bool | None = None) -> Any:
        """The :class:`storage.StorageLayout` naming this cache's pages in a backend.

        TP / PP rank and size default to the cache's rank group, ``kv_replicated`` to the
        config's (replicated KV, as with MLA: the TP ranks share one object per page).
        """
        return self._storage.layout(tp_rank=tp_rank, tp_size=tp_size, kv_replicated=kv_replicated)

    @property
    def storage(self) -> StorageTier | BufferModePipeline | None:
        """The attached L3 tier: a :class:`StorageTier`, or in buffer-only host mode the
        :class:`~asynccache.buffer.BufferModePipeline` (both have ``drain()``)."""
        return self._storage.storage

    def attach_storage(self, backend: Any, policy: StoragePolicy | None = None) -> None:
        """Use ``backend`` (a started :class:`storage.StorageBackend`) as the L3 tier.

        Pages backed up to host from now on are written to it; requests can prefetch from it.
        The caller keeps ownership of the backend (close it after the cache).
        """
        self._check_open()
        self._storage.attach(backend, policy)

    async def detach_storage(self) -> bool:
        """Stop using storage: abort prefetches, wait for writes, release their pins.

        Never raises for a storage fault: it is logged and ``False`` is returned (the tier is
        detached either way). Requests waiting on the tier see no storage from now on.
        Cancelling the call does not stop the detach: it finishes in the background, and
        ``aclose`` waits for it before freeing anything.
        """
        return await self._storage.detach()

    async def clear_storage(self) -> int | None:
        """Remove this cache's pages from the attached backend and forget which pages were
        believed stored; returns how many were removed, or None if the backend failed (logged)."""
        self._check_open()
        return await self._storage.clear()

    def start_prefetch(self, key: RadixKey | Any, match: MatchResult) -> PrefetchOp | None:
        """Start fetching the pages after ``match``'s cached prefix from storage."""
        self._check_open()
        return self._storage.start_prefetch(self.tree.key_of(key), match)

    def begin_prefetch(self, req: CacheRequest) -> bool:
        """Start fetching ``req``'s uncached pages from storage now (when it arrives), so that
        :meth:`prefetch_request` at scheduling time stops the fetch per its policy and takes
        what arrived meanwhile (``best_effort`` then means something). Returns whether a fetch
        is running. Cache host mode on one rank only (else False: use ``prefetch_request``)."""
        self._check_open()
        return self._storage.begin_prefetch(self._requests.check(req))

    async def prefetch_request(self, req: CacheRequest, *, policy: str | None = None) -> int:
        """Fetch ``req``'s uncached pages from storage into host memory (before it computes).

        ``policy``: the stop policy (default: the attached :class:`StoragePolicy`'s). Returns
        the tokens it added to host memory (pages another request cached meanwhile are given
        back and not counted, as SGLang's ``loaded_from_storage``); ``req`` is matched again,
        so ``req.host_hit_length`` takes them in (load them back next).
        """
        self._check_open()
        return await self._storage.prefetch_request(self._requests.check_active(req), policy)

    # ------------------------------------------------------------------ hybrid (SWA / Mamba)
    def release_swa(self, receipt: LockReceipt) -> None:
        """Hybrid: drop the SWA / Mamba pins of a held lock once decode passed the window."""
        self._check_open()
        self._hybrid.release_swa(receipt)

    def free_swa(self, slots: Any) -> None:
        """Free a request's SWA slots that slid out of the window (pairs of its FULL slots)."""
        self._check_open()
        self._hybrid.free_swa(slots)

    def alloc_mamba_state(self) -> int | None:
        """A fresh Mamba state slot for a request (None when the pool is full after evicting
        unlocked states)."""
        self._check_open()
        return self._hybrid.alloc_mamba_state()

    def free_mamba_state(self, slot: int) -> None:
        self._check_open()
        self._hybrid.free_mamba_state(slot)

    def mamba_copy_on_write(self, slot: int) -> int | None:
        """A request-private copy of the state a match returned in ``mamba_cow_slot``."""
        self._check_open()
        return self._hybrid.mamba_copy_on_write(slot)

    # ------------------------------------------------------------------ direct KV access
    def read_kv(self, slots: Any) -> torch.Tensor:
        """A copy of the device KV of ``slots`` as (layers, 2, n, heads, head_dim)."""
        return self._kv.read_kv(slots)

    def write_kv(self, slots: Any, values: torch.Tensor) -> None:
        """Write KV (layers, 2, n, heads, head_dim) into device ``slots``."""
        self._kv.write_kv(slots, values)

    # ------------------------------------------------------------------ sidecar pools
    def register_sidecar_pool(self, spec: SidecarSpec) -> Sidecar:
        """Add a sidecar pool (a draft model's KV, an indexer's keys, any per-token buffer)
        whose slots are those of ``spec.source`` (docs/sidecars.md): its data rides every copy
        of the source (backups, write-backs, load-backs, retraction, staging) and every storage
        object (``<page key>.<name>``). Before ``start`` only. :class:`ConfigError`, with
        nothing registered, for a bad spec, a duplicate name, a source pool this cache does not
        have, or a host pool smaller than the source's host capacity."""
        if self._parts.life.state != "new":
            raise ConfigError(f"sidecar {getattr(spec, 'name', spec)!r}: register sidecar pools "
                              f"before the cache starts (it is {self._parts.life.state})")
        return self._parts.sidecars.register(spec)

    def register_draft_pools(self, *, num_layers: int, num_heads: int, head_dim: int,
                             dtype: Any = None, name: str = "draft",
                             host_slots: int | None = None) -> Sidecar:
        """A draft model's KV (speculative decoding) as a sidecar of the KV pool: per token and
        layer ``(2, num_heads, head_dim)`` of ``dtype`` (None: the cache's), needed for every
        page; its device pool's ``layer(i)[:, 0]`` / ``[:, 1]`` are layer ``i``'s K / V."""
        spec = SidecarSpec(name=name, source="kv", token_shape=(2, num_heads, head_dim),
                           dtype=self.shape.dtype if dtype is None else dtype,
                           num_layers=num_layers, hit_policy="all_pages", host_slots=host_slots)
        return self.register_sidecar_pool(spec)

    def sidecar(self, name: str) -> Sidecar:
        """The registered sidecar ``name`` (its spec and device / host pools)."""
        return self._parts.sidecars.get(name)

    @property
    def sidecars(self) -> tuple[Sidecar, ...]:
        """Every registered sidecar, in registration order."""
        return tuple(self._parts.sidecars)
