"""The read path of the buffer-only host mode: storage -> parked host bounce -> device.

A request's prefetch asks storage how many of its next pages exist and reads them into host
slots owned by the operation (a *bounce*), waiting in FIFO order when the read budget or the
pool has no room. The bounce is parked for the request; its load-back copies it to the device
layer by layer, inserts the loaded prefix into the tree like computed KV, and frees the bounce
when the copy lands. Read bounces may hold up to 90 % of the host pool minus the staging of
writes in flight (:mod:`asynccache.buffer.pipeline`).

FULL+SWA caches: the bounce also holds, in the host SWA pool, the ``.swa`` pages of the
trailing window of what was fetched (:mod:`asynccache.buffer.swa`). The prefetch is all or
nothing per window: when a window page is missing it falls back to the longest shorter prefix
whose window is whole (if still above the prefetch threshold, else a miss). The load-back
gives the whole prefix FULL slots and only the window fresh SWA slots, copies both, and
inserts with the SWA floor at the window's start (the pages before it are SWA tombstones).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np

from asynccache.buffer.swa import SWABuffer
from asynccache.engine import Tiering, stop_and_wait
from asynccache.errors import PoolExhaustedError
from asynccache.l3 import (
    StorageExistenceCache,
    StoragePolicy,
    admission,
    await_stop,
    count_finished,
    floor_pages,
    pages_to_read,
    prefetch_span,
    read_run,
    stop_policy,
    stored_prefix,
)
from asynccache.logs import get_logger
from asynccache.request import CacheRequest
from asynccache.transfers.handles import CopyHandle
from asynccache.transfers.hybrid_copies import GroupHandle
from asynccache.tree import LockReceipt, RadixKey

_log = get_logger("buffer_reads")

LOAD_SHARE: Final = 0.9  # reads may hold this share of the host pool (minus write staging)


@dataclass(eq=False, slots=True)
class BufferFetch:
    """One buffer-mode prefetch: the hit query, then a read into an operation-owned bounce."""

    key: RadixKey
    start: int
    requested_tokens: int
    keys: list[str]
    started: float
    want_pages: int = 0
    host_slots: np.ndarray | None = None
    swa_slots: np.ndarray | None = None  # host SWA slots of the window (FULL+SWA caches)
    swa_ready: bool = False  # the window's SWA pages of completed_tokens have arrived
    hit_tokens: int = 0
    completed_tokens: int = 0
    outcome: str = "issued"
    task: asyncio.Task[None] | None = None
    parked: asyncio.Future[None] | None = None
    finished: bool = False


@dataclass(eq=False, slots=True)
class _Staged:
    """A fetched span ``[start, start + len(host_slots))`` of ``key`` parked for its request."""

    key: RadixKey
    start: int
    host_slots: np.ndarray
    swa_slots: np.ndarray | None = None  # the SWA of the last len(swa_slots) tokens


class Pipeline(Protocol):
    """What the reads share with their pipeline (:mod:`asynccache.buffer.pipeline`): the
    policy (replaced when the backend is attached again), the backend and the beliefs of what
    it stores, the write staging (it shares the host budget) and the SWA side."""

    policy: StoragePolicy
    backend: Any
    existence: StorageExistenceCache
    write_staged: int
    swa: SWABuffer | None


class StagedReads:
    """Prefetches into parked host bounces and their load-backs, for one pipeline."""

    def __init__(self, pipeline: Pipeline, tiering: Tiering) -> None:
        self.pipeline = pipeline
        self._t = tiering
        self._parts = tiering.parts
        host = tiering.parts.host_pool
        assert host is not None
        self._host = host
        self._ps = tiering.page_size
        self.load_limit = int(self._host.num_slots * LOAD_SHARE)
        self.occupied = 0  # host tokens held by read bounces (fetching, parked, loading)
        self.closed = False
        self._fetches: set[BufferFetch] = set()
        self._parked: deque[BufferFetch] = deque()
        self._staged: dict[CacheRequest, _Staged] = {}
        self._loads: set[CopyHandle] = set()  # H->D copies of parked bounces
        self.swa = pipeline.swa
        self._sidecars = tiering.parts.sidecars.stored_with("kv")  # read with each page
        self._all_or_nothing = tiering.parts.sidecars.all_or_nothing("kv")

    @property
    def staged_requests(self) -> int:
        return len(self._staged)

    @property
    def staged_tokens(self) -> int:
        return sum(len(s.host_slots) for s in self._staged.values())

    @property
    def staged_swa_tokens(self) -> int:
        return sum(len(s.swa_slots) for s in self._staged.values() if s.swa_slots is not None)

    @property
    def busy(self) -> bool:
        """A fetch, a parked fetch or a load is in flight."""
        return bool(self._fetches or self._parked or self._loads)

    async def prefetch_request(self, req: CacheRequest, policy: str | None) -> int:
        """Fetch ``req``'s stored pages past its device prefix into a bounce parked for it.

        Returns the tokens fetched (parked until :meth:`load_staged`)."""
        stop = stop_policy(policy, self.pipeline.policy)
        if req in self._staged or self.closed:
            return 0
        op = self._start_fetch(req)
        if op is None:
            return 0
        task = op.task
        assert task is not None
        try:
            await await_stop(task, stop, self.pipeline.policy, op.requested_tokens, op.started)
        except BaseException:
            await self._end_fetch(op, None)
            raise
        return await self._end_fetch(op, req)

    def _start_fetch(self, req: CacheRequest) -> BufferFetch | None:
        ps = self._ps
        outcomes = self._parts.metrics.prefetch_outcomes
        start = req.prefix_len
        n = prefetch_span(len(req.key), start, ps)
        declined = admission(self.pipeline.policy, ps, n, self.occupied,
                             self.load_limit - self.pipeline.write_staged)
        if declined is not None:
            outcomes.labels(outcome=declined).inc()
            return None
        keys = self._t.tree.chain_keys(req.last_node, req.key, start)
        op = BufferFetch(key=req.key, start=start, requested_tokens=n, keys=keys,
                         started=time.perf_counter())
        self._fetches.add(op)
        outcomes.labels(outcome="issued").inc()
        op.task = asyncio.get_running_loop().create_task(self._fetch(op))
        return op

    async def _fetch(self, op: BufferFetch) -> None:
        ps = self._ps
        metrics = self._parts.metrics
        policy = self.pipeline.policy
        backend = self.pipeline.backend
        existence = self.pipeline.existence
        hit = await stored_prefix(backend, op.keys)
        # The backend's answer is evidence: believe the found pages, forget the rest.
        if hit < len(op.keys):
            existence.invalidate_beyond(op.keys, hit)
        existence.add(op.keys[:hit])
        op.hit_tokens = hit * ps
        metrics.storage_hit_tokens.inc(hit * ps)
        metrics.storage_miss_tokens.inc(op.requested_tokens - hit * ps)
        # (A hit the read budget cuts below the threshold is insufficient here.)
        want, revoked = pages_to_read(policy, ps, min(hit, self.load_limit // ps))
        min_pages = floor_pages(policy, ps)
        if revoked is None and self.swa is not None:
            want, revoked = pages_to_read(
                policy, ps, await self.swa.usable_pages(op.keys, want, min_pages))
        if revoked is not None:
            op.outcome = revoked
            return
        op.want_pages = want
        await self._staging_for(op)
        host = op.host_slots
        assert host is not None

        def landed(_first: int, good: int) -> None:
            op.completed_tokens += good * ps

        got = await read_run(backend, self._host, op.keys[:want], host, landed=landed,
                             bandwidth=metrics.prefetch_bandwidth, sidecars=self._sidecars)
        if got < want:  # missing, corrupt or unreadable from there on
            existence.invalidate_beyond(op.keys, got)
        if self.swa is not None and op.completed_tokens:
            assert op.swa_slots is not None
            pages = await self.swa.fetch_window(op.keys, op.completed_tokens // ps, min_pages,
                                                op.swa_slots)
            op.completed_tokens = pages * ps
            op.swa_ready = True
            if not pages:  # no window read whole above the threshold: a miss
                op.outcome = "revoked_insufficient"

    def _try_bounce(self, op: BufferFetch) -> bool:
        """Give ``op`` its bounce (and its SWA window's) if the budget and the pools allow."""
        num_tokens = op.want_pages * self._ps
        if self.occupied + self.pipeline.write_staged + num_tokens > self.load_limit:
            return False
        swa = None
        if self.swa is not None:
            swa = self.swa.take(min(num_tokens, self.swa.window_span), read=True)
            if swa is None:
                return False
        slots = self._t.take_host(num_tokens, evict=False)
        if slots is None:
            if self.swa is not None:
                self.swa.give(swa, read=True)
            return False
        self.occupied += num_tokens
        op.host_slots, op.swa_slots = slots, swa
        return True

    async def _staging_for(self, op: BufferFetch) -> None:
        """Give ``op`` its bounce now, or park it (FIFO) until staging frees up."""
        if not self._parked and self._try_bounce(op):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        op.parked = fut
        self._parked.append(op)
        self._parts.metrics.buffer_parked_prefetches.inc()
        _log.debug("prefetch_parked", tokens=op.want_pages * self._ps, queue=len(self._parked))
        try:
            await fut
        finally:
            if op in self._parked:  # cancelled while waiting: the next in line may fit now
                self._parked.remove(op)
                self.wake_parked()

    def wake_parked(self) -> None:
        """Hand staging to parked fetches in FIFO order while it lasts."""
        while self._parked:
            op = self._parked[0]
            fut = op.parked
            assert fut is not None
            if fut.done():  # cancelled while parked
                self._parked.popleft()
                continue
            if not self._try_bounce(op):
                return
            self._parked.popleft()
            fut.set_result(None)

    def _free_bounce(self, slots: np.ndarray) -> None:
        if len(slots):
            self._t.free_host(slots)
            self.occupied -= len(slots)
            self.wake_parked()

    def _free_swa(self, slots: np.ndarray | None) -> None:
        if self.swa is not None and slots is not None and len(slots):
            self.swa.give(slots, read=True)
            self.wake_parked()

    async def _end_fetch(self, op: BufferFetch, req: CacheRequest | None) -> int:
        """Stop ``op``; park what arrived for ``req`` (None: drop it). Cancel-safe: the release
        completes before a cancel of the caller goes through."""
        if op.finished:
            return 0
        op.finished = True
        task = op.task
        assert task is not None
        cancelled = await stop_and_wait(task, "buffer_prefetch_failed")
        self._fetches.discard(op)
        done = op.completed_tokens if req is not None and not cancelled and not req.finished \
            and not self.closed else 0
        if self.swa is not None and not op.swa_ready:
            done = 0  # stopped before its window's SWA arrived: all or nothing
        host, swa = op.host_slots, op.swa_slots
        if host is not None and done < len(host) and self._all_or_nothing:
            done = 0  # a sidecar that cannot be cut short: the whole prefix or nothing
        op.host_slots = op.swa_slots = None
        keep_swa = min(done, self.swa.window_span) if self.swa is not None else 0
        if swa is not None:
            self._free_swa(swa[keep_swa:])
        if host is not None:
            self._free_bounce(host[done:])
            if done:
                self._staged[req] = _Staged(  # type: ignore[index]
                    op.key, op.start, host[:done],
                    swa[:keep_swa] if swa is not None else None)
                req.host_hit_length += done  # type: ignore[union-attr]
        count_finished(self._parts.metrics, op, kept=req is not None and not cancelled,
                       complete=host is not None and done == len(host), tokens=done)
        if cancelled:
            raise asyncio.CancelledError
        return done

    # ------------------------------------------------------------------ load
    def release_request(self, req: CacheRequest) -> None:
        """Free the bounce parked for ``req`` (it finished or was aborted before loading)."""
        staged = self._staged.pop(req, None)
        if staged is not None:
            self._free_bounce(staged.host_slots)
            self._free_swa(staged.swa_slots)

    async def load_staged(self, req: CacheRequest, mem_quota: int | None) -> int:
        """Copy ``req``'s parked bounce onto the device and insert it after its prefix.

        ``req`` must be freshly matched (its prefix pinned). Returns the tokens inserted; 0
        when nothing was parked or the load was skipped (threshold, quota, no device room).
        Cancelling the caller never leaves the copy half-committed: it commits on completion.
        """
        staged = self._staged.pop(req, None)
        if staged is None:
            return 0
        bounce: np.ndarray | None = None
        swa: np.ndarray | None = staged.swa_slots
        t = self._t
        try:
            bounce = staged.host_slots
            skip = req.prefix_len - staged.start  # grown meanwhile: those pages are cached
            n = len(bounce) - skip
            if skip < 0 or n <= 0 or n < self._parts.config.load_back_threshold or (
                    mem_quota is not None and n > mem_quota):
                return 0
            self._free_bounce(bounce[:skip])
            bounce = bounce[skip:]
            w = 0  # tokens at the end with SWA (the window of the loaded end)
            if self.swa is not None:
                assert swa is not None
                w = min(n, self.swa.window_span)
                self._free_swa(swa[: len(swa) - w])
                swa = swa[len(swa) - w :]
            prefix = req.slots[: req.prefix_len]
            pin = t.tree.lock(req.last_node)
            try:
                self._parts.life.check_open()
                # FULL slots for all; FULL+SWA: fresh SWA pairs for the window only
                slots = await t.alloc(n, w if self.swa is not None else None)
            except PoolExhaustedError:
                t.tree.unlock(pin)
                return 0
            except BaseException:
                t.tree.unlock(pin)
                raise
            handle: CopyHandle = t.submit_h2d(bounce, slots)
            if self.swa is not None and w:
                assert swa is not None
                swa_dev = self.swa.device_slots(slots[n - w :])
                handle = GroupHandle([handle, self.swa.submit_h2d(swa, swa_dev)])
            owned, bounce = bounce, None  # the completion callback frees them from here on
            owned_swa, swa = swa, None
            self._loads.add(handle)
            outcome: list[int] = []
            key = req.key[: req.prefix_len + n]
            floor = req.prefix_len + n - w
            handle.add_done_callback(
                lambda h: self._loaded(h, key, prefix, slots, owned, owned_swa, floor, pin,
                                       outcome))
            await handle.done()
            return outcome[0] if outcome else 0
        finally:
            if bounce is not None:
                self._free_bounce(bounce)
            self._free_swa(swa)

    def _loaded(self, handle: CopyHandle, key: RadixKey, prefix: np.ndarray, slots: np.ndarray,
                bounce: np.ndarray, swa: np.ndarray | None, floor: int, pin: LockReceipt,
                outcome: list[int]) -> None:
        t = self._t
        self._loads.discard(handle)
        try:
            result = handle.result()
        except Exception as exc:
            _log.warning("buffer_load_failed", tokens=len(slots), error=repr(exc))
            t.free(slots)
            outcome.append(0)
        else:
            if self._parts.life.running:
                # (FULL-only caches: no SWA floor, the engine ignores it)
                t.insert(key, np.concatenate([prefix, slots]), prev_prefix_len=len(prefix),
                         swa_evicted_seqlen=floor if self.swa is not None else 0)
                outcome.append(len(slots))
            else:  # closing: nothing may join the tree any more
                t.free(slots)
                outcome.append(0)
            m = self._parts.metrics
            m.load_back_tokens.inc(result.num_tokens)
            m.load_back_bytes.inc(result.num_bytes)
            m.load_back_duration.observe(result.duration_s)
        finally:
            t.tree.unlock(pin)
            self._free_bounce(bounce)
            self._free_swa(swa)

    async def close(self) -> None:
        """Drop every fetch and every parked bounce."""
        self.closed = True
        for op in list(self._fetches):
            await self._end_fetch(op, None)
        for req in list(self._staged):
            self.release_request(req)
