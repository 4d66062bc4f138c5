"""Buffer-only host mode: host memory as transient staging between device and storage.

With ``CacheConfig(host_mode="buffer_only")`` and a storage backend attached, the tree never
holds host copies. Host slots belong to operations only:

* **Writes.** A node reaching the write threshold becomes an *intent* (its id, length and page
  keys; nothing pinned while it waits) in a FIFO. Once per loop turn (and at every
  :meth:`~asynccache.HierarchicalCache.flush`) the queued intents that still exist and are not
  already believed stored get host staging inside the write window, their device pages are
  pinned and copied to host as **one** D->H copy; when it lands the pins are released and the
  pages are written to storage; the staging is freed when the storage write returns. An
  intent whose node was evicted meanwhile is dropped (eviction always wins); one whose node
  was split is gathered from the fragments.
* **Reads.** A request's prefetch fetches its stored pages into an operation-owned host bounce
  that is *parked* for the request. Its load-back allocates device slots, copies the bounce to
  device layer by layer, inserts the loaded prefix into the tree like computed KV and frees the
  bounce when the copy lands. A fetch that cannot get staging waits in FIFO order.

Budgets (shares of the host pool): reads may hold up to 90 % minus the write staging; writes
may hold the pool minus the read bounces minus 10 %, but never less than 20 %.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch

from asynccache.errors import ConfigError, PoolExhaustedError
from asynccache.existence import DEFAULT_MAX_ENTRIES, StorageExistenceCache
from asynccache.l3 import BATCH_PAGES, PREFETCH_POLICIES, StoragePolicy
from asynccache.logs import get_logger
from asynccache.tree import LockReceipt, RadixKey
from transfers.handles import CopyHandle
from transfers.pools import HostPool

if TYPE_CHECKING:
    from asynccache.cache import CacheRequest, HierarchicalCache

_log = get_logger("buffer_mode")

LOAD_SHARE: Final = 0.9  # reads may hold this share of the host pool (minus write staging)
WRITE_MARGIN: Final = 0.1  # writes leave this share free besides the read bounces...
WRITE_FLOOR: Final = 0.2  # ...but may always hold this share


def page_buffers(host: HostPool, slots: np.ndarray, *, fill: bool) -> list[torch.Tensor]:
    """One uint8 buffer per page of ``slots``: views into a page_first pool, else copies of
    the pages (``fill``) or empty buffers to read into and write back with ``write_page``."""
    firsts = slots[:: host.page_size].tolist()
    if host.layout == "page_first":
        return [host.page_buffer(f) for f in firsts]
    if fill:
        return [host.read_page(f) for f in firsts]
    return [torch.empty(host.page_bytes, dtype=torch.uint8) for _ in firsts]


@dataclass(slots=True)
class _Intent:
    node_id: int
    num_tokens: int
    keys: list[str]


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


class BufferModePipeline:
    """Storage writes and prefetches of a buffer-only host (one per attached backend)."""

    def __init__(self, cache: HierarchicalCache, backend: Any, policy: StoragePolicy, *,
                 existence_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        host = cache.host_pool
        if host is None:
            raise ConfigError("buffer_only host mode needs host staging: set host_tokens")
        self.cache = cache
        self.backend = backend
        self.policy = policy
        self.existence = StorageExistenceCache(existence_entries)
        self._host = host
        self._ps = cache.page_size
        pool = host.num_slots
        self.load_limit = int(pool * LOAD_SHARE)
        self._write_margin = int(pool * WRITE_MARGIN)
        self._write_floor = int(pool * WRITE_FLOOR)
        self.backlog_cap = 2 * cache.device_pool.num_slots  # tokens of queued intents
        self._intents: OrderedDict[int, _Intent] = OrderedDict()
        self._queued_tokens = 0
        self.write_staged = 0  # host tokens staged for writes (D->H or storage write running)
        self.occupied = 0  # host tokens held by read bounces (fetching, parked, loading)
        self._copies: set[CopyHandle] = set()  # D->H copies of write batches
        self._loads: set[CopyHandle] = set()  # H->D copies of parked bounces
        self._writes: set[asyncio.Task[None]] = set()
        self._fetches: set[BufferFetch] = set()
        self._parked: deque[BufferFetch] = deque()
        self._staged: dict[CacheRequest, _Staged] = {}
        self._launch_pending = False
        self._closed = False
        cache.tree.set_storage_intents(True)

    # ------------------------------------------------------------------ accounting
    @property
    def queued_intents(self) -> int:
        return len(self._intents)

    @property
    def staged_requests(self) -> int:
        return len(self._staged)

    def write_window(self) -> int:
        """Host tokens writes may hold now: the pool minus read bounces minus the margin,
        floored."""
        return max(self._host.num_slots - self.occupied - self._write_margin, self._write_floor)

    def _metric_intent(self, outcome: str, tokens: int = 0) -> None:
        self.cache.metrics.buffer_intents.labels(outcome=outcome).inc()
        if tokens and outcome in ("covered", "stale", "backlog"):
            reason = "exists" if outcome == "covered" else outcome
            self.cache.metrics.storage_backup_skipped_tokens.labels(reason=reason).inc(tokens)

    # ------------------------------------------------------------------ write path
    def enqueue(self, node_ids: Sequence[int]) -> None:
        """Record write intents for nodes that reached the write threshold (root first)."""
        if self._closed:
            return
        tree = self.cache.tree
        for nid in node_ids:
            if nid in self._intents:
                continue
            keys = tree.node_page_keys(nid)
            if self.existence.covered(keys):
                self._metric_intent("covered", len(keys) * self._ps)
                continue
            n = len(keys) * self._ps
            if self._queued_tokens + n > self.backlog_cap:
                self._sweep_stale()
                if self._queued_tokens + n > self.backlog_cap:
                    _log.warning("write_intent_dropped", node=nid, tokens=n,
                                 queued_tokens=self._queued_tokens, cap=self.backlog_cap)
                    self._metric_intent("backlog", n)
                    continue
            self._intents[nid] = _Intent(nid, n, keys)
            self._queued_tokens += n
            self._metric_intent("queued")
        if self._intents and not self._launch_pending:
            self._launch_pending = True
            asyncio.get_running_loop().call_soon(self._launch_soon)

    def _drop(self, nid: int) -> _Intent:
        intent = self._intents.pop(nid)
        self._queued_tokens -= intent.num_tokens
        return intent

    def _sweep_stale(self) -> None:
        tree = self.cache.tree
        for nid in [i.node_id for i in self._intents.values()
                    if tree.tail_slots(i.node_id, i.num_tokens) is None]:
            self._metric_intent("stale", self._drop(nid).num_tokens)

    def _launch_soon(self) -> None:
        self._launch_pending = False
        if not self._closed and self.cache._state == "running":
            self.launch_writes()

    def launch_writes(self) -> int:
        """Stage queued intents (FIFO, within the write window) and start their D->H copy as
        one batch; returns the tokens staged."""
        if self._closed or not self._intents:
            return 0
        cache = self.cache
        tree = cache.tree
        ps = self._ps
        room = self.write_window() - self.write_staged
        dev_parts: list[np.ndarray] = []
        keys: list[str] = []
        nodes: list[int] = []
        while self._intents and room >= ps:
            intent = next(iter(self._intents.values()))
            slots = tree.tail_slots(intent.node_id, intent.num_tokens)
            if slots is None:  # evicted while queued
                self._metric_intent("stale", self._drop(intent.node_id).num_tokens)
                continue
            todo = self.existence.missing(intent.keys)
            if not todo:
                self._metric_intent("covered", self._drop(intent.node_id).num_tokens)
                continue
            fit = todo[: room // ps]
            for j in fit:
                dev_parts.append(slots[j * ps : (j + 1) * ps])
                keys.append(intent.keys[j])
            self.existence.begin_write(intent.keys[j] for j in fit)
            nodes.append(intent.node_id)
            room -= len(fit) * ps
            if len(fit) == len(todo):
                self._drop(intent.node_id)
                self._metric_intent("staged")
            # else: the rest of the node waits at the head of the queue for the next window
        if not keys:
            return 0
        n = len(keys) * ps
        host = cache.take_host(n, evict=False)
        if host is None:  # the window allows it but the pool is held by reads: later
            self.existence.end_write(keys, [False] * len(keys))
            self._requeue_front(nodes)
            return 0
        receipts = [tree.lock(nid) for nid in nodes]
        self.write_staged += n
        handle = cache.engine_submit_d2h(np.concatenate(dev_parts), host)
        self._copies.add(handle)
        handle.add_done_callback(lambda h: self._copied(h, keys, host, receipts))
        return n

    def _requeue_front(self, nodes: list[int]) -> None:
        """Intents taken off the queue for a batch that could not get staging go back first."""
        tree = self.cache.tree
        for nid in reversed(nodes):
            if nid not in self._intents:
                keys = tree.node_page_keys(nid)
                self._intents[nid] = _Intent(nid, len(keys) * self._ps, keys)
                self._queued_tokens += len(keys) * self._ps
                self._intents.move_to_end(nid, last=False)

    def _copied(self, handle: CopyHandle, keys: list[str], host: np.ndarray,
                receipts: list[LockReceipt]) -> None:
        self._copies.discard(handle)
        cache = self.cache
        for r in receipts:
            cache.tree.unlock(r)
        try:
            result = handle.result()
        except Exception as exc:
            _log.warning("buffer_write_copy_failed", pages=len(keys), error=repr(exc))
            self._write_done(keys, host, [False] * len(keys))
            return
        m = cache.metrics
        m.backup_tokens.inc(result.num_tokens)
        m.backup_bytes.inc(result.num_bytes)
        m.backup_duration.observe(result.duration_s)
        task = asyncio.get_running_loop().create_task(self._store(keys, host))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _store(self, keys: list[str], host: np.ndarray) -> None:
        ps = self._ps
        ok: list[bool] = []
        metrics = self.cache.metrics
        try:
            for i in range(0, len(keys), BATCH_PAGES):
                batch = keys[i : i + BATCH_PAGES]
                bufs = page_buffers(self._host, host[i * ps : (i + len(batch)) * ps], fill=True)
                t0 = time.perf_counter()
                got = await self.backend.set_batch(batch, bufs)
                dt = time.perf_counter() - t0
                ok.extend(bool(g) for g in got)
                written = sum(got)
                if written and dt > 0:
                    metrics.storage_backup_bandwidth.observe(written * self._host.page_bytes / dt)
        except Exception as exc:  # a closed backend or a bug: the pages stay unwritten
            _log.warning("buffer_storage_write_failed", pages=len(keys), error=repr(exc))
        finally:
            ok.extend([False] * (len(keys) - len(ok)))
            self._write_done(keys, host, ok)

    def _write_done(self, keys: list[str], host: np.ndarray, ok: list[bool]) -> None:
        ps = self._ps
        written = sum(ok)
        self.existence.end_write(keys, ok)
        self.cache.free_host(host)
        self.write_staged -= len(host)
        m = self.cache.metrics
        m.storage_backup_tokens.inc(written * ps)
        if written < len(keys):
            m.storage_backup_skipped_tokens.labels(reason="failed").inc((len(keys) - written) * ps)
        self._wake_parked()
        if self._intents and not self._closed and not self._launch_pending:
            self._launch_pending = True
            asyncio.get_running_loop().call_soon(self._launch_soon)

    async def drain(self) -> None:
        """Write every queued intent and wait until every storage write has returned."""
        while True:
            self.launch_writes()
            if not self._copies and not self._writes:
                return  # nothing in flight: what is still queued cannot get staging now
            await self._wait_in_flight()

    async def _wait_in_flight(self) -> None:
        # Shielded: cancelling the waiter must never cancel a storage write (its page would
        # go unwritten, its staging still be freed by the task's own cleanup).
        await asyncio.gather(*(h.done() for h in self._copies),
                             *(asyncio.shield(t) for t in self._writes), return_exceptions=True)

    # ------------------------------------------------------------------ read path: fetch
    async def prefetch_request(self, req: CacheRequest, policy: str | None) -> int:
        """Fetch ``req``'s stored pages past its device prefix into a bounce parked for it.

        Returns the tokens fetched (parked until :meth:`load_staged`)."""
        policy = policy or self.policy.prefetch_policy
        if policy not in PREFETCH_POLICIES:
            raise ConfigError(f"unknown prefetch policy {policy!r}; choose one of "
                              f"{list(PREFETCH_POLICIES)}")
        if req in self._staged or self._closed:
            return 0
        op = self._start_fetch(req)
        if op is None:
            return 0
        task = op.task
        assert task is not None
        try:
            if policy == "wait_complete":
                await asyncio.wait({task})
            elif policy == "timeout":
                left = self.policy.timeout_s(op.requested_tokens) - (time.perf_counter() - op.started)
                if left > 0:
                    await asyncio.wait({task}, timeout=left)
        except BaseException:
            await self._end_fetch(op, None)
            raise
        return await self._end_fetch(op, req)

    def _start_fetch(self, req: CacheRequest) -> BufferFetch | None:
        cache = self.cache
        ps = self._ps
        outcomes = cache.metrics.prefetch_outcomes
        start = req.prefix_len
        n = len(req.key) - len(req.key) % ps - start
        if n <= 0 or n < max(self.policy.prefetch_threshold, ps):
            outcomes.labels(outcome="declined_too_short").inc()
            return None
        if self.occupied >= self.load_limit - self.write_staged:
            outcomes.labels(outcome="declined_rate_limited").inc()
            return None
        keys = cache.tree.chain_keys(req.last_node, req.key, start)
        op = BufferFetch(key=req.key, start=start, requested_tokens=n, keys=keys,
                         started=time.perf_counter())
        self._fetches.add(op)
        outcomes.labels(outcome="issued").inc()
        op.task = asyncio.get_running_loop().create_task(self._fetch(op))
        return op

    async def _fetch(self, op: BufferFetch) -> None:
        ps = self._ps
        metrics = self.cache.metrics
        hit = 0
        for i in range(0, len(op.keys), BATCH_PAGES):
            batch = op.keys[i : i + BATCH_PAGES]
            found = await self.backend.exists_prefix(batch)
            hit += found
            if found < len(batch):
                break
        # The backend's answer is evidence: believe the found pages, forget the rest.
        if hit < len(op.keys):
            self.existence.invalidate_beyond(op.keys, hit)
        self.existence.add(op.keys[:hit])
        op.hit_tokens = hit * ps
        metrics.storage_hit_tokens.inc(hit * ps)
        metrics.storage_miss_tokens.inc(op.requested_tokens - hit * ps)
        want = min(hit, self.load_limit // ps)
        if want * ps < max(self.policy.prefetch_threshold, ps):
            op.outcome = "revoked_insufficient"
            return
        op.want_pages = want
        await self._staging_for(op)
        host = op.host_slots
        assert host is not None
        t0 = time.perf_counter()
        for i in range(0, want, BATCH_PAGES):
            keys = op.keys[i : min(want, i + BATCH_PAGES)]
            slots = host[i * ps : (i + len(keys)) * ps]
            bufs = page_buffers(self._host, slots, fill=False)
            ok = await self.backend.get_batch(keys, bufs)
            good = next((j for j, g in enumerate(ok) if not g), len(ok))
            if self._host.layout != "page_first":
                for j, first in enumerate(slots[::ps][:good].tolist()):
                    self._host.write_page(first, bufs[j])
            op.completed_tokens += good * ps
            if good < len(keys):
                self.existence.invalidate_beyond(op.keys, i + good)
                break
        dt = time.perf_counter() - t0
        if op.completed_tokens and dt > 0:
            metrics.prefetch_bandwidth.observe(
                op.completed_tokens // ps * self._host.page_bytes / dt)

    def _try_bounce(self, num_tokens: int) -> np.ndarray | None:
        if self.occupied + self.write_staged + num_tokens > self.load_limit:
            return None
        slots = self.cache.take_host(num_tokens, evict=False)
        if slots is not None:
            self.occupied += num_tokens
        return slots

    async def _staging_for(self, op: BufferFetch) -> None:
        """Give ``op`` its bounce now, or park it (FIFO) until staging frees up."""
        if not self._parked:
            op.host_slots = self._try_bounce(op.want_pages * self._ps)
            if op.host_slots is not None:
                return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        op.parked = fut
        self._parked.append(op)
        self.cache.metrics.buffer_parked_prefetches.inc()
        _log.debug("prefetch_parked", tokens=op.want_pages * self._ps, queue=len(self._parked))
        try:
            await fut
        finally:
            if op in self._parked:
                self._parked.remove(op)

    def _wake_parked(self) -> None:
        """Hand staging to parked fetches in FIFO order while it lasts."""
        while self._parked:
            op = self._parked[0]
            fut = op.parked
            assert fut is not None
            if fut.done():  # cancelled while parked
                self._parked.popleft()
                continue
            slots = self._try_bounce(op.want_pages * self._ps)
            if slots is None:
                return
            self._parked.popleft()
            op.host_slots = slots
            fut.set_result(None)

    def _free_bounce(self, slots: np.ndarray) -> None:
        if len(slots):
            self.cache.free_host(slots)
            self.occupied -= len(slots)
            self._wake_parked()

    async def _end_fetch(self, op: BufferFetch, req: CacheRequest | None) -> int:
        """Stop ``op``; park what arrived for ``req`` (None: drop it). Cancel-safe: the release
        completes before a cancel of the caller goes through."""
        if op.finished:
            return 0
        op.finished = True
        task = op.task
        assert task is not None
        if not task.done():
            task.cancel()
        cancelled = False
        while not task.done():
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                cancelled = True
        if not task.cancelled() and task.exception() is not None:
            _log.warning("buffer_prefetch_failed", error=repr(task.exception()))
        self._fetches.discard(op)
        done = op.completed_tokens if req is not None and not cancelled and not req.finished \
            and not self._closed else 0
        host = op.host_slots
        op.host_slots = None
        if host is not None:
            self._free_bounce(host[done:])
            if done:
                self._staged[req] = _Staged(op.key, op.start, host[:done])  # type: ignore[index]
                req.host_hit_length += done  # type: ignore[union-attr]
        outcomes = self.cache.metrics.prefetch_outcomes
        if req is None or cancelled:
            outcomes.labels(outcome="aborted").inc()
        elif op.outcome == "issued":
            op.outcome = "completed" if host is not None and done == len(host) else "partial"
            outcomes.labels(outcome=op.outcome).inc()
        else:
            outcomes.labels(outcome=op.outcome).inc()
        self.cache.metrics.prefetched_tokens.inc(done)
        if cancelled:
            raise asyncio.CancelledError
        return done

    # ------------------------------------------------------------------ read path: load
    def release_request(self, req: CacheRequest) -> None:
        """Free the bounce parked for ``req`` (it finished or was aborted before loading)."""
        staged = self._staged.pop(req, None)
        if staged is not None:
            self._free_bounce(staged.host_slots)

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
        cache = self.cache
        try:
            bounce = staged.host_slots
            skip = req.prefix_len - staged.start  # grown meanwhile: those pages are cached
            n = len(bounce) - skip
            if skip < 0 or n <= 0 or n < cache.config.load_back_threshold or (
                    mem_quota is not None and n > mem_quota):
                return 0
            self._free_bounce(bounce[:skip])
            bounce = bounce[skip:]
            prefix = req.slots[: req.prefix_len]
            pin = cache.tree.lock(req.last_node)
            try:
                slots = await cache.alloc_device(n)
            except PoolExhaustedError:
                cache.tree.unlock(pin)
                return 0
            except BaseException:
                cache.tree.unlock(pin)
                raise
            handle = cache.engine_submit_h2d(bounce, slots)
            owned, bounce = bounce, None  # the completion callback frees it from here on
            self._loads.add(handle)
            outcome: list[int] = []
            key = req.key[: req.prefix_len + n]
            handle.add_done_callback(
                lambda h: self._loaded(h, key, prefix, slots, owned, pin, outcome))
            await handle.done()
            return outcome[0] if outcome else 0
        finally:
            if bounce is not None:
                self._free_bounce(bounce)

    def _loaded(self, handle: CopyHandle, key: RadixKey, prefix: np.ndarray, slots: np.ndarray,
                bounce: np.ndarray, pin: LockReceipt, outcome: list[int]) -> None:
        cache = self.cache
        self._loads.discard(handle)
        try:
            result = handle.result()
        except Exception as exc:
            _log.warning("buffer_load_failed", tokens=len(slots), error=repr(exc))
            cache.free_device(slots)
            outcome.append(0)
        else:
            if cache._state == "running":
                cache.insert(key, np.concatenate([prefix, slots]), prev_prefix_len=len(prefix))
                outcome.append(len(slots))
            else:  # closing: nothing may join the tree any more
                cache.free_device(slots)
                outcome.append(0)
            m = cache.metrics
            m.load_back_tokens.inc(result.num_tokens)
            m.load_back_bytes.inc(result.num_bytes)
            m.load_back_duration.observe(result.duration_s)
        finally:
            cache.tree.unlock(pin)
            self._free_bounce(bounce)

    # ------------------------------------------------------------------ lifecycle
    def clear_beliefs(self) -> None:
        self.existence.clear()

    async def close(self) -> None:
        """Write what is queued, wait for every write, drop fetches and parked bounces."""
        try:
            await self.drain()
        finally:
            self._closed = True
            for op in list(self._fetches):
                await self._end_fetch(op, None)
            for req in list(self._staged):
                self.release_request(req)
            for nid in list(self._intents):
                self._metric_intent("dropped", self._drop(nid).num_tokens)
            if self._copies or self._writes:
                await self._wait_in_flight()
            self.cache.tree.set_storage_intents(False)

    def check(self) -> None:
        """Accounting of the staging (for ``sanity_check``)."""
        if self.write_staged < 0 or self.occupied < 0:
            raise AssertionError(
                f"buffer staging went negative: writes {self.write_staged}, reads {self.occupied}")
        staged = sum(len(s.host_slots) for s in self._staged.values())
        if staged > self.occupied:
            raise AssertionError(f"parked bounces hold {staged} tokens but reads hold {self.occupied}")
        if self._queued_tokens != sum(i.num_tokens for i in self._intents.values()):
            raise AssertionError("queued intent tokens out of step with the queue")
        if not self._fetches and not self._parked and not self._loads and \
                self.occupied != staged:
            raise AssertionError(f"reads hold {self.occupied} host tokens, parked bounces {staged}")
        if not self._copies and not self._writes and self.write_staged:
            raise AssertionError(f"{self.write_staged} write staging tokens with nothing in flight")
