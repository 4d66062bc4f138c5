"""Buffer-only host mode: host memory as transient staging between device and storage.

With ``CacheConfig(host_mode="buffer_only")`` and a storage backend attached, the tree never
holds host copies. Host slots belong to operations only:

* **Writes.** A node reaching the write threshold becomes an *intent* (its id, length and page
  keys; nothing pinned while it waits; the engine's ``write_intents`` port) in a FIFO. Once per
  loop turn (and at every ``flush`` of the cache) the queued intents that still exist and are not
  already believed stored get host staging inside the write window, their device pages are
  pinned and copied to host as **one** D->H copy; when it lands the pins are released and the
  pages are written to storage; the staging is freed when the storage write returns. An
  intent whose node was evicted meanwhile is dropped (eviction always wins); one whose node
  was split is gathered from the fragments.
* **Reads** (:mod:`asynccache.buffer.reads`). A request's prefetch fetches its stored pages
  into an operation-owned host bounce that is *parked* for the request. Its load-back allocates
  device slots, copies the bounce to device layer by layer, inserts the loaded prefix into the
  tree like computed KV and frees the bounce when the copy lands. A fetch that cannot get
  staging waits in FIFO order.

FULL+SWA caches (:mod:`asynccache.buffer.swa`): an intent also writes the SWA pages of its
node that are still SWA-live, staged in the host SWA pool and stored as ``<page key>.swa``;
a prefetch also reads the ``.swa`` pages of the trailing window of what it loads, all or
nothing (a missing one falls back to a shorter prefix whose window is whole). Mamba is not
supported in this mode (the config refuses it).

Budgets (shares of the host pool): reads may hold up to 90 % minus the write staging; writes
may hold the pool minus the read bounces minus 10 %, but never less than 20 %. Host SWA
staging comes from its own pool; an operation that cannot get it waits like one without KV
staging.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from asynccache.buffer.reads import StagedReads
from asynccache.buffer.swa import EMPTY, SWABuffer
from asynccache.engine import StoragePorts, TaskOwner, Tiering
from asynccache.errors import ConfigError
from asynccache.l3 import (
    BATCH_PAGES,
    DEFAULT_MAX_ENTRIES,
    StorageExistenceCache,
    StoragePolicy,
    write_pages,
)
from asynccache.l3.existence import listen, unlisten
from asynccache.logs import get_logger
from asynccache.request import CacheRequest
from asynccache.transfers.handles import CopyHandle
from asynccache.transfers.hybrid_copies import GroupHandle
from asynccache.tree import LockReceipt

_log = get_logger("buffer_mode")

WRITE_MARGIN: Final = 0.1  # writes leave this share free besides the read bounces...
WRITE_FLOOR: Final = 0.2  # ...but may always hold this share


@dataclass(slots=True)
class _Intent:
    node_id: int
    num_tokens: int
    keys: list[str]


@dataclass(slots=True)
class _Batch:
    """One write: KV pages ``keys`` staged in ``host``, SWA pages ``swa_keys`` in ``swa_host``."""

    keys: list[str]
    host: np.ndarray
    swa_keys: list[str]
    swa_host: np.ndarray


class BufferModePipeline:
    """Storage writes and prefetches of a buffer-only host (one per attached backend).

    ``tasks`` owns its storage writes (a group named after this pipeline)."""

    def __init__(self, tiering: Tiering, backend: Any, policy: StoragePolicy, *,
                 tasks: TaskOwner, existence_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        parts = tiering.parts
        host = parts.host_pool
        if host is None:
            raise ConfigError("buffer_only host mode needs host staging: set host_tokens")
        self._t = tiering
        self._parts = parts
        self._tasks = tasks
        self._write_group = tasks.new_group("buffer_writes")
        self.backend = backend
        self.policy = policy
        self.existence = StorageExistenceCache(existence_entries)
        listen(backend, self.existence)
        self.host = host
        # Sidecars of the KV pool: their objects go with each page (asynccache/l3/pages.py).
        self._sidecars = parts.sidecars.stored_with("kv")
        # FULL+SWA: the SWA pages go with the KV pages (None: a FULL-only cache).
        self.swa = (SWABuffer(tiering, backend, existence_entries)
                    if parts.hybrid is not None else None)
        self._ps = tiering.page_size
        pool = host.num_slots
        self._write_margin = int(pool * WRITE_MARGIN)
        self._write_floor = int(pool * WRITE_FLOOR)
        self.backlog_cap = 2 * parts.device_pool.num_slots  # tokens of queued intents
        self._intents: OrderedDict[int, _Intent] = OrderedDict()
        self._queued_tokens = 0
        self.write_staged = 0  # host tokens staged for writes (D->H or storage write running)
        self._copies: set[CopyHandle] = set()  # D->H copies of write batches
        self._launch_pending = False
        self._closed = False
        self.reads = StagedReads(self, tiering)
        tiering.tree.set_storage_intents(True)

    def ports(self) -> StoragePorts:
        """What the engine calls up into this pipeline."""
        return StoragePorts(write_intents=self.enqueue, writes_pending=self._writes_in_flight,
                            drain=self.drain)

    @property
    def _writes(self) -> list[asyncio.Task[Any]]:
        """Storage writes of landed batches not yet returned."""
        return self._tasks.tasks(self._write_group)

    def _writes_in_flight(self) -> bool:
        return bool(self._copies) or self._tasks.count(self._write_group) > 0

    # ------------------------------------------------------------------ accounting
    @property
    def queued_intents(self) -> int:
        return len(self._intents)

    @property
    def staged_requests(self) -> int:
        """Requests with a fetched bounce parked, not loaded yet."""
        return self.reads.staged_requests

    @property
    def occupied(self) -> int:
        """Host tokens held by read bounces (fetching, parked, loading)."""
        return self.reads.occupied

    @property
    def load_limit(self) -> int:
        return self.reads.load_limit

    def write_window(self) -> int:
        """Host tokens writes may hold now: the pool minus read bounces minus the margin,
        floored."""
        room: int = max(self.host.num_slots - self.reads.occupied - self._write_margin,
                        self._write_floor)
        return room

    def _metric_intent(self, outcome: str, tokens: int = 0) -> None:
        metrics = self._parts.metrics
        metrics.buffer_intents.labels(outcome=outcome).inc()
        if tokens and outcome in ("covered", "stale", "backlog"):
            reason = "exists" if outcome == "covered" else outcome
            metrics.storage_backup_skipped_tokens.labels(reason=reason).inc(tokens)

    # ------------------------------------------------------------------ write path
    def enqueue(self, node_ids: Sequence[int]) -> None:
        """Record write intents for nodes that reached the write threshold (root first)."""
        if self._closed:
            return
        tree = self._t.tree
        for nid in node_ids:
            if nid in self._intents:
                continue
            keys = tree.node_page_keys(nid)
            n = len(keys) * self._ps
            if self.existence.covered(keys) and not self._swa_todo(nid, n, keys):
                self._metric_intent("covered", n)
                continue
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

    def _swa_todo(self, nid: int, num_tokens: int, keys: list[str]) -> list[int]:
        """Pages of the span whose SWA is live, pinnable and not believed stored."""
        if self.swa is None:
            return []
        slots = self._t.tree.tail_slots(nid, num_tokens)
        if slots is None:
            return []
        return self.swa.write_pages(nid, slots, keys)

    def _drop(self, nid: int) -> _Intent:
        intent = self._intents.pop(nid)
        self._queued_tokens -= intent.num_tokens
        return intent

    def _sweep_stale(self) -> None:
        tree = self._t.tree
        for nid in [i.node_id for i in self._intents.values()
                    if tree.tail_slots(i.node_id, i.num_tokens) is None]:
            self._metric_intent("stale", self._drop(nid).num_tokens)

    def _launch_soon(self) -> None:
        self._launch_pending = False
        if not self._closed and self._parts.life.running:
            self.launch_writes()

    def launch_writes(self) -> int:
        """Stage queued intents (FIFO, within the write window) and start their D->H copy as
        one batch; returns the tokens staged."""
        if self._closed or not self._intents:
            return 0
        t = self._t
        tree = t.tree
        ps = self._ps
        room = self.write_window() - self.write_staged
        dev_parts: list[np.ndarray] = []
        keys: list[str] = []
        swa_parts: list[np.ndarray] = []
        swa_keys: list[str] = []
        nodes: list[int] = []
        swa_room = self.swa.available if self.swa is not None else 0
        while self._intents and room >= ps:
            intent = next(iter(self._intents.values()))
            slots = tree.tail_slots(intent.node_id, intent.num_tokens)
            if slots is None:  # evicted while queued
                self._metric_intent("stale", self._drop(intent.node_id).num_tokens)
                continue
            todo = self.existence.missing(intent.keys)
            swa_todo = self.swa.write_pages(intent.node_id, slots, intent.keys) \
                if self.swa is not None else []
            if not todo and not swa_todo:
                self._metric_intent("covered", self._drop(intent.node_id).num_tokens)
                continue
            fit = todo[: room // ps]
            whole = len(fit) == len(todo)
            short = False  # the host SWA pool cannot stage all of this intent's SWA pages
            if swa_todo:
                if not whole:  # the SWA of the pages that wait stays with them
                    swa_todo = [j for j in swa_todo if j <= fit[-1]]
                if len(swa_todo) > swa_room // ps:
                    cut = swa_todo[swa_room // ps]  # the first SWA page without staging
                    swa_todo = swa_todo[: swa_room // ps]
                    fit = [j for j in fit if j < cut]
                    whole = False
                    short = True
                    if not fit and not swa_todo:
                        break  # wait at the head of the queue for host SWA staging
            for j in fit:
                dev_parts.append(slots[j * ps : (j + 1) * ps])
                keys.append(intent.keys[j])
            self.existence.begin_write(intent.keys[j] for j in fit)
            if swa_todo:
                assert self.swa is not None
                for j in swa_todo:
                    swa_parts.append(slots[j * ps : (j + 1) * ps])
                    swa_keys.append(intent.keys[j])
                self.swa.existence.begin_write(intent.keys[j] for j in swa_todo)
                swa_room -= len(swa_todo) * ps
            nodes.append(intent.node_id)
            room -= len(fit) * ps
            if whole:
                self._drop(intent.node_id)
                self._metric_intent("staged")
            # else: the rest of the node waits at the head of the queue for the next window
            if short:
                break
        if not keys and not swa_keys:
            return 0
        n = len(keys) * ps
        host = t.take_host(n, evict=False) if n else EMPTY
        swa_host: np.ndarray | None = EMPTY
        if host is not None and swa_keys:
            assert self.swa is not None
            swa_host = self.swa.take(len(swa_keys) * ps, read=False)  # fits: swa_room
            if swa_host is None:
                t.free_host(host)
        if host is None or swa_host is None:  # the pools are held by reads: later
            self.existence.end_write(keys, [False] * len(keys))
            if self.swa is not None:
                self.swa.existence.end_write(swa_keys, [False] * len(swa_keys))
            self._requeue_front(nodes)
            return 0
        receipts = [tree.lock(nid) for nid in nodes]
        self.write_staged += n
        batch = _Batch(keys, host, swa_keys, swa_host)
        handles: list[CopyHandle] = []
        if n:
            handles.append(t.submit_d2h(np.concatenate(dev_parts), host))
        if swa_keys:
            assert self.swa is not None
            swa_dev = self.swa.device_slots(np.concatenate(swa_parts))
            handles.append(self.swa.submit_d2h(swa_dev, swa_host))
        handle = handles[0] if len(handles) == 1 else GroupHandle(handles)
        self._copies.add(handle)
        handle.add_done_callback(lambda h: self._copied(h, batch, receipts))
        return n

    def _requeue_front(self, nodes: list[int]) -> None:
        """Intents taken off the queue for a batch that could not get staging go back first."""
        tree = self._t.tree
        for nid in reversed(nodes):
            if nid not in self._intents:
                keys = tree.node_page_keys(nid)
                self._intents[nid] = _Intent(nid, len(keys) * self._ps, keys)
                self._queued_tokens += len(keys) * self._ps
                self._intents.move_to_end(nid, last=False)

    def _copied(self, handle: CopyHandle, batch: _Batch, receipts: list[LockReceipt]) -> None:
        self._copies.discard(handle)
        for r in receipts:
            self._t.tree.unlock(r)
        try:
            result = handle.result()
        except Exception as exc:
            _log.warning("buffer_write_copy_failed", pages=len(batch.keys),
                         swa_pages=len(batch.swa_keys), error=repr(exc))
            self._write_done(batch, [False] * len(batch.keys), [False] * len(batch.swa_keys))
            return
        m = self._parts.metrics
        m.backup_tokens.inc(len(batch.host))
        m.backup_bytes.inc(result.num_bytes)
        m.backup_duration.observe(result.duration_s)
        self._tasks.spawn(self._write_group, self._store(batch))

    async def _store(self, batch: _Batch) -> None:
        ps = self._ps
        keys, host = batch.keys, batch.host
        ok: list[bool] = []
        swa_ok: list[bool] = []
        metrics = self._parts.metrics
        try:
            for i in range(0, len(keys), BATCH_PAGES):
                part = keys[i : i + BATCH_PAGES]
                t0 = time.perf_counter()
                got = await write_pages(self.backend, self.host, part,
                                        host[i * ps : (i + len(part)) * ps], self._sidecars)
                dt = time.perf_counter() - t0
                ok.extend(bool(g) for g in got)
                written = sum(got)
                if written and dt > 0:
                    metrics.storage_backup_bandwidth.observe(written * self.host.page_bytes / dt)
            if batch.swa_keys:
                assert self.swa is not None
                await self.swa.store(batch.swa_keys, batch.swa_host, swa_ok)
        except Exception as exc:  # a closed backend or a bug: the pages stay unwritten
            _log.warning("buffer_storage_write_failed", pages=len(keys),
                         swa_pages=len(batch.swa_keys), error=repr(exc))
        finally:
            ok.extend([False] * (len(keys) - len(ok)))
            swa_ok.extend([False] * (len(batch.swa_keys) - len(swa_ok)))
            self._write_done(batch, ok, swa_ok)

    def _write_done(self, batch: _Batch, ok: list[bool], swa_ok: list[bool]) -> None:
        ps = self._ps
        keys, host = batch.keys, batch.host
        written = sum(ok)
        self.existence.end_write(keys, ok)
        self._t.free_host(host)
        self.write_staged -= len(host)
        if self.swa is not None:
            self.swa.existence.end_write(batch.swa_keys, swa_ok)
            self.swa.give(batch.swa_host, read=False)
            if not all(swa_ok):
                _log.warning("buffer_swa_write_failed", pages=len(swa_ok) - sum(swa_ok))
        m = self._parts.metrics
        m.storage_backup_tokens.inc(written * ps)
        if written < len(keys):
            m.storage_backup_skipped_tokens.labels(reason="failed").inc((len(keys) - written) * ps)
        self.reads.wake_parked()
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

    # ------------------------------------------------------------------ reads (delegated)
    async def prefetch_request(self, req: CacheRequest, policy: str | None) -> int:
        """Fetch ``req``'s stored pages into a bounce parked for it; returns the tokens."""
        if self._closed:
            return 0
        return await self.reads.prefetch_request(req, policy)

    async def load_staged(self, req: CacheRequest, mem_quota: int | None) -> int:
        """Copy ``req``'s parked bounce to the device and insert it; returns the tokens."""
        return await self.reads.load_staged(req, mem_quota)

    def release_request(self, req: CacheRequest) -> None:
        """Free the bounce parked for ``req`` (finished or aborted before loading it)."""
        self.reads.release_request(req)

    # ------------------------------------------------------------------ lifecycle
    def clear_beliefs(self) -> None:
        """Forget what was believed stored (the backend was cleared)."""
        self.existence.clear()
        if self.swa is not None:
            self.swa.existence.clear()

    async def close(self) -> None:
        """Write what is queued, wait for every write, drop fetches and parked bounces."""
        try:
            await self.drain()
        finally:
            self._closed = True
            await self.reads.close()
            for nid in list(self._intents):
                self._metric_intent("dropped", self._drop(nid).num_tokens)
            if self._copies or self._writes:
                await self._wait_in_flight()
            self._t.tree.set_storage_intents(False)
            unlisten(self.backend, self.existence)

    def check(self) -> None:
        """Accounting of the staging (for ``sanity_check``)."""
        reads = self.reads
        if self.write_staged < 0 or reads.occupied < 0:
            raise AssertionError(
                f"buffer staging went negative: writes {self.write_staged}, reads {reads.occupied}")
        staged = reads.staged_tokens
        if staged > reads.occupied:
            raise AssertionError(f"parked bounces hold {staged} tokens but reads hold {reads.occupied}")
        if self._queued_tokens != sum(i.num_tokens for i in self._intents.values()):
            raise AssertionError("queued intent tokens out of step with the queue")
        if not reads.busy and reads.occupied != staged:
            raise AssertionError(f"reads hold {reads.occupied} host tokens, parked bounces {staged}")
        if not self._copies and not self._writes and self.write_staged:
            raise AssertionError(f"{self.write_staged} write staging tokens with nothing in flight")
        if self.swa is not None:
            self.swa.check()
            if not self._copies and not self._writes and self.swa.write_staged:
                raise AssertionError(
                    f"{self.swa.write_staged} SWA write staging slots with nothing in flight")
            if not reads.busy and self.swa.read_held != reads.staged_swa_tokens:
                raise AssertionError(
                    f"reads hold {self.swa.read_held} host SWA slots, parked bounces "
                    f"{reads.staged_swa_tokens}")
