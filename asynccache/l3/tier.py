"""The L3 tier inside the engine: storage backup (L2 -> L3) and prefetch (L3 -> L2).

Backup: when a node's D->H copy commits (the engine's ``node_backed_up`` port), its pages are
written to the backend from host memory (the node stays host-pinned until the write returns);
pages known to exist are skipped. Prefetch: for a request whose prompt runs past its cached
prefix, ask the backend how many of the following pages exist, allocate host memory, read them
in batches and insert the fetched prefix into the tree as host copies, from where the usual
load-back brings it to the device. When a prefetch starts, how much it reads and when it stops
follow the rules of :mod:`asynccache.l3.policy`; pages move through :mod:`asynccache.l3.pages`.

Every storage fault degrades: the backend returns False for a page (a miss or a skipped write,
counted and logged) and the engine goes on. Nothing here blocks the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asynccache.engine import StoragePorts, TaskOwner, Tiering, stop_and_wait
from asynccache.errors import ConfigError, InvalidInputError
from asynccache.l3.existence import StorageExistenceCache, listen, unlisten
from asynccache.l3.hybrid import HybridStorage
from asynccache.l3.hybrid_ranks import AgreedComponents
from asynccache.l3.op import HybridPrefetch, PrefetchOp
from asynccache.l3.pages import BATCH_PAGES, read_run, stored_prefix, write_pages
from asynccache.l3.policy import (
    StoragePolicy,
    admission,
    count_finished,
    floor_pages,
    may_stop,
    pages_to_read,
    prefetch_span,
    stop_policy,
    stop_wait_s,
)
from asynccache.logs import get_logger
from asynccache.ranks import Agreement
from asynccache.tree import LockReceipt, MatchResult, RadixKey

_log = get_logger("l3")


async def await_stop(task: asyncio.Task[Any], stop: str, policy: StoragePolicy,
                     requested_tokens: int, started: float) -> None:
    """Wait for a prefetch's ``task`` as long as the stop rule
    (:func:`~asynccache.l3.policy.stop_wait_s`) says before stopping it under ``stop``."""
    wait_s = stop_wait_s(stop, policy, requested_tokens, time.perf_counter() - started)
    if wait_s is None:
        await asyncio.wait({task})
    elif wait_s > 0:
        await asyncio.wait({task}, timeout=wait_s)


async def wait_all(tasks: Collection[asyncio.Task[Any]]) -> None:
    """Wait until ``tasks`` finished, never cancelling them (a cancelled waiter stops only its
    wait); their failures count as retrieved (each task reports its own)."""
    if not tasks:
        return
    done, _ = await asyncio.wait(tasks)
    for t in done:
        if not t.cancelled():
            t.exception()


@dataclass(eq=False)
class PrefetchTasks:
    """The tasks of one prefetch: its main task (the hit query, then the read), the side tasks
    of a hybrid prefetch on several ranks (component reads, searches), and ``released``, set
    once its release is over."""

    task: asyncio.Task[None] | None = None
    side: list[asyncio.Task[None]] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)


class StorageTier:
    """Storage backup and prefetch for one cache's engine (see the module docstring).

    ``tasks`` owns its background tasks: storage writes and the releases of prefetches their
    requests dropped (groups named after this tier, so a detached tier still closing and the
    next one attached are told apart)."""

    def __init__(self, tiering: Tiering, backend: Any, policy: StoragePolicy, *,
                 tasks: TaskOwner) -> None:
        parts = tiering.parts
        host = parts.host_pool
        if host is None:
            raise ConfigError("storage needs a host tier: set host_tokens or host_bytes")
        self._t = tiering
        self._parts = parts
        self._tasks = tasks
        self.page_size = tiering.page_size
        self.backend = backend
        self.policy = policy
        # Page keys believed stored (written or read by this tier): writes skip them. A prefetch
        # that finds a page missing, or fails to read it, forgets it (and the pages after it).
        self._known = StorageExistenceCache(max(1, policy.known_keys))
        self._write_group = tasks.new_group("storage_writes")
        self._abort_group = tasks.new_group("prefetch_aborts")  # releases nobody finished
        self._prefetches: dict[PrefetchOp, PrefetchTasks] = {}
        self._agreeing: list[PrefetchOp] = []  # several ranks: prefetches in start order
        self._occupied = 0
        # Write circuit breaker: consecutive failed batches, and writes are off until this time.
        self._failures = 0
        self._closed_until = 0.0
        self._backoff = 0.0
        self._host = host
        self._page_bytes = host.page_bytes
        # Sidecars of the KV pool ride its pages (<key>.<name> objects, see l3/pages.py); one
        # that is not needed for every page (trailing_pages) makes a prefetch all or nothing.
        self._sidecars = parts.sidecars.stored_with("kv")
        self._all_or_nothing = parts.sidecars.all_or_nothing("kv")
        self._hybrid: HybridStorage | None = None
        self._agreed_hy: AgreedComponents | None = None
        if parts.hybrid is not None:
            self._hybrid = HybridStorage(tiering)
            if self.agreement is not None:
                self._agreed_hy = AgreedComponents(self, self._hybrid)
        self.set_policy(policy)
        listen(backend, self._known)

    @property
    def agreement(self) -> Agreement | None:
        """The ranks' agreement (None: one rank)."""
        return self._t.commits.agreement

    def ports(self) -> StoragePorts:
        """What the engine calls up into this tier."""
        return StoragePorts(node_backed_up=self.backup_nodes,
                            writes_pending=lambda: self.writes_pending, drain=self.drain)

    def set_policy(self, policy: StoragePolicy) -> None:
        """Use ``policy`` from now on (operations already running keep their limits)."""
        self.policy = policy
        self._write_sem = asyncio.Semaphore(policy.write_concurrency)
        self._capacity_limit = int(self._host.num_slots * policy.prefetch_capacity_fraction)
        if policy.known_keys:
            self._known.resize(policy.known_keys)
        else:
            self._known.clear()

    @property
    def _writes(self) -> list[asyncio.Task[Any]]:
        """Storage writes not yet done."""
        return self._tasks.tasks(self._write_group)

    @property
    def _aborts(self) -> list[asyncio.Task[Any]]:
        """Releases of prefetches whose requests ended without finishing them."""
        return self._tasks.tasks(self._abort_group)

    def tasks_of(self, op: PrefetchOp) -> PrefetchTasks:
        """The tasks of a prefetch not yet released."""
        return self._prefetches[op]

    def run_main(self, op: PrefetchOp, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as ``op``'s main task (its hit query, then its read)."""
        self._prefetches[op].task = asyncio.get_running_loop().create_task(coro)

    def run_side(self, op: PrefetchOp, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a side task of ``op`` (several ranks, hybrid: component reads and
        searches), stopped when ``op`` is released."""
        self._prefetches[op].side.append(asyncio.get_running_loop().create_task(coro))

    def cancel_main(self, op: PrefetchOp) -> None:
        task = self._prefetches[op].task
        if task is not None:
            task.cancel()

    # ------------------------------------------------------------------ known keys
    def _remember(self, keys: Sequence[str]) -> None:
        if self.policy.known_keys:
            self._known.add(keys)

    @property
    def known_keys(self) -> int:
        """How many page keys the tier believes stored."""
        return len(self._known)

    def forget_known(self) -> None:
        """Forget which keys were seen stored (the backend was cleared)."""
        self._known.clear()

    # ------------------------------------------------------------------ write breaker
    def _writes_suspended(self) -> bool:
        return time.monotonic() < self._closed_until

    def _write_outcome(self, stored: int, tried: int) -> None:
        """Count a write batch for the breaker: ``stored`` of ``tried`` pages landed."""
        if stored:
            self._failures = 0
            self._closed_until = self._backoff = 0.0
            return
        if not tried:
            return
        self._failures += 1
        if self._failures >= self.policy.write_failure_threshold and not self._writes_suspended():
            base = self.policy.write_backoff_s
            self._backoff = min(self._backoff * 2, base * 64) if self._backoff else base
            self._closed_until = time.monotonic() + self._backoff
            self._parts.metrics.storage_write_circuit_opened.inc()
            _log.warning("storage_writes_suspended", failed_batches=self._failures,
                         backoff_s=self._backoff)

    # ------------------------------------------------------------------ backup (L2 -> L3)
    def backup_nodes(self, node_ids: Sequence[int]) -> None:
        """Write the pages of freshly backed-up nodes to storage (in the background)."""
        tree = self._t.tree
        skipped = self._parts.metrics.storage_backup_skipped_tokens
        agree = self.agreement
        for nid in node_ids:
            keys = tree.node_page_keys(nid)
            if agree is not None:  # several ranks: the known set is rank-local, pins must not be
                self._agreed_write(nid, keys)
                continue
            extra = self._hybrid.node_objects(nid, keys) if self._hybrid is not None else None
            if all(k in self._known for k in keys) and not (extra and extra[0]):
                skipped.labels(reason="exists").inc(len(keys) * self.page_size)
                continue
            if self._writes_suspended():
                skipped.labels(reason="circuit_open").inc(len(keys) * self.page_size)
                continue
            pin = tree.lock_host(nid)
            host_slots = tree.host_slots_of(nid)
            assert host_slots is not None
            self._tasks.spawn(self._write_group, self._write(keys, host_slots, pin, extra))

    def _agreed_write(self, nid: int, keys: list[str]) -> None:
        tree = self._t.tree
        agree = self.agreement
        pin = tree.lock_host(nid)
        host_slots = tree.host_slots_of(nid)
        assert host_slots is not None and agree is not None
        # hybrid: the node's SWA pages and state, read now (at the agreed commit)
        extra = self._hybrid.node_objects(nid, keys) if self._hybrid is not None else None
        task = self._tasks.spawn(self._write_group, self._write(keys, host_slots, None, extra))
        agree.defer_task(task, lambda: tree.unlock_host(pin))

    async def _write(self, keys: list[str], host_slots: np.ndarray,
                     pin: LockReceipt | None,
                     extra: tuple[list[str], list[torch.Tensor]] | None = None) -> None:
        ps = self.page_size
        metrics = self._parts.metrics
        try:
            async with self._write_sem:
                for i in range(0, len(keys), BATCH_PAGES):
                    batch = keys[i : i + BATCH_PAGES]
                    slots = host_slots[i * ps : (i + len(batch)) * ps]
                    todo = [j for j, k in enumerate(batch) if k not in self._known]
                    if len(todo) < len(batch):
                        metrics.storage_backup_skipped_tokens.labels(reason="exists").inc(
                            (len(batch) - len(todo)) * ps)
                    if not todo:
                        continue
                    if self._writes_suspended():  # (queued before the breaker opened)
                        metrics.storage_backup_skipped_tokens.labels(reason="circuit_open").inc(
                            len(todo) * ps)
                        continue
                    t0 = time.perf_counter()
                    ok = await self._write_pages([batch[j] for j in todo], slots, todo)
                    dt = time.perf_counter() - t0
                    written = sum(ok)
                    self._write_outcome(written, len(todo))
                    self._remember([batch[j] for j, good in zip(todo, ok, strict=True) if good])
                    metrics.storage_backup_tokens.inc(written * ps)
                    if written < len(todo):
                        metrics.storage_backup_skipped_tokens.labels(reason="failed").inc(
                            (len(todo) - written) * ps)
                    if written and dt > 0:
                        metrics.storage_backup_bandwidth.observe(written * self._page_bytes / dt)
                if extra and extra[0]:  # hybrid: the node's SWA pages and state
                    await self.backend.set_batch(*extra)
        finally:
            if pin is not None:
                self._t.tree.unlock_host(pin)

    async def _write_pages(self, keys: list[str], slots: np.ndarray,
                           pages: list[int]) -> list[bool]:
        """Write pages ``pages`` (indices of whole pages of ``slots``) as ``keys``, with their
        sidecar objects; per page, whether all of it was stored."""
        ps = self.page_size
        if len(pages) == len(slots) // ps:
            chosen = slots
        else:
            chosen = np.concatenate([slots[j * ps : (j + 1) * ps] for j in pages])
        return await write_pages(self.backend, self._host, keys, chosen, self._sidecars)

    @property
    def writes_pending(self) -> bool:
        """Storage writes started and not yet done (not yet retired, with several ranks)."""
        agree = self.agreement
        if agree is None:
            return self._tasks.count(self._write_group) > 0
        return not agree.lane_empty("storage")

    async def drain(self) -> None:
        """Wait for every storage write started so far (cancelling the waiter never cancels a
        write: its pages would be lost while their host pins are released)."""
        agree = self.agreement
        if agree is not None:
            await agree.until(lambda: agree.lane_empty("storage"))
        else:
            await wait_all(self._writes)

    # ------------------------------------------------------------------ prefetch (L3 -> L2)
    def start_prefetch(self, key: RadixKey, match: MatchResult) -> PrefetchOp | None:
        """Start fetching the pages of ``key`` after ``match``'s cached prefix; None if declined."""
        ps = self.page_size
        tree = self._t.tree
        outcomes = self._parts.metrics.prefetch_outcomes
        start = match.device_prefix_len + match.host_hit_length
        if not tree.keeps_host_inserts_below(match.best_node):
            # (write-through policies, an anchor without a host copy: what arrived would be
            # dropped; the reference's scheduler does not prefetch from such an anchor either)
            outcomes.labels(outcome="declined_unbacked").inc()
            return None
        n = prefetch_span(len(key), start, ps)
        # (full: the pages being read fill the prefetch capacity)
        declined = admission(self.policy, ps, n, self._occupied, self._capacity_limit)
        if declined is not None:
            outcomes.labels(outcome=declined).inc()
            return None
        keys = tree.chain_keys(match.best_node, key, start)
        pin = tree.lock_host(match.best_node)
        op = PrefetchOp(key=key, start=start, requested_tokens=n, keys=keys, pin=pin,
                        started=time.perf_counter(),
                        hybrid=HybridPrefetch() if self._hybrid is not None else None)
        self._prefetches[op] = PrefetchTasks()
        outcomes.labels(outcome="issued").inc()
        if self.agreement is not None:
            self._agreeing.append(op)
            self.run_main(op, self._query(op))
        else:
            self.run_main(op, self._fetch(op))
        return op

    async def _hits(self, op: PrefetchOp) -> int:
        """How many of ``op``'s pages storage holds, from the first (the hit query)."""
        hit = await stored_prefix(self.backend, op.keys)
        if hit < len(op.keys):  # the backend's answer is evidence: forget what it lacks
            self._known.invalidate_beyond(op.keys, hit)
        return hit

    def floor_pages(self) -> int:
        """The fewest pages a prefetch may bring (the threshold, at least one page)."""
        return floor_pages(self.policy, self.page_size)

    async def _fetch(self, op: PrefetchOp) -> None:
        hit = await self._hits(op)
        hy = self._hybrid
        if hy is not None:  # only the prefix every pool can restore
            hit = await hy.query(op, self.backend, hit, self.floor_pages())
        want = self._take_hit(op, hit)
        if want and hy is not None and want < op.hy.restorable_pages:
            # Host memory for a shorter prefix only: read no further than its restorable end.
            p = await hy.restorable(self.backend, op, want, self.floor_pages())
            hy.note_fallback(op, "host_memory", op.hy.restorable_pages, p)
            op.hy.restorable_pages = p
            want = self._trim(op, p)
        if want:
            if hy is None:
                await self.read_hit(op, want)
                return
            floor = self.floor_pages()

            async def between() -> None:  # what a stop can insert: the deepest that arrived
                await hy.fetch(op, self.backend, floor, final=False)

            await self.read_hit(op, want, between)
            await hy.fetch(op, self.backend, floor)

    def _trim(self, op: PrefetchOp, pages: int) -> int:
        """Keep the host memory of ``op``'s first ``pages`` pages only (0: revoke it)."""
        ps = self.page_size
        host = op.host_slots
        assert host is not None
        self._t.free_host(host[pages * ps :])
        op.host_slots = host[: pages * ps] if pages else None
        self._reserve(op, pages * ps)
        if not pages:
            op.outcome = "revoked_no_host_memory"
        return pages

    def _take_host(self, num_tokens: int) -> np.ndarray | None:
        """Host slots for a prefetch, evicting host copies if short (:class:`ClosedError` once
        the cache is no longer running: nothing may be evicted then)."""
        host = self._t.take_host(num_tokens, evict=False)
        if host is None:
            self._parts.life.check_open()
            host = self._t.take_host(num_tokens)
        return host

    def _take_hit(self, op: PrefetchOp, hit: int) -> int:
        """Account the query's ``hit`` pages and allocate host memory for them (or a shorter
        prefix under pressure); returns the pages to read (0: revoked)."""
        ps = self.page_size
        metrics = self._parts.metrics
        op.hit_tokens = hit * ps
        metrics.storage_hit_tokens.inc(hit * ps)
        metrics.storage_miss_tokens.inc(op.requested_tokens - hit * ps)
        # Only pages found and about to be read count against the prefetch capacity, and never
        # beyond it unless this is the only prefetch reading (the reference system,
        # see docs/differences.md, reserves every requested token from the start, found or not: it
        # declines concurrent prefetches that would fit, and overshoots with the last one it
        # admits).
        room = (self._capacity_limit - self._occupied) // ps
        want, revoked = pages_to_read(self.policy, ps, hit, None if self._occupied == 0 else room)
        if revoked is not None:
            op.outcome = revoked
            return 0
        # Host memory for the hit; under pressure a shorter prefix that still clears the bar.
        floor = self.floor_pages()
        host = self._take_host(want * ps)
        while host is None and want > 1:
            want = min(want - 1, self._host.allocator.available_size // ps)
            if want < floor:
                break
            host = self._take_host(want * ps)
        if host is None:
            op.outcome = "revoked_no_host_memory"
            return 0
        op.host_slots = host
        self._reserve(op, want * ps)
        return want

    def _reserve(self, op: PrefetchOp, tokens: int) -> None:
        """Lower ``op``'s reservation against the prefetch capacity to ``tokens``."""
        self._occupied -= op.reserved_tokens - tokens
        op.reserved_tokens = tokens

    async def read_hit(self, op: PrefetchOp, want: int,
                       between: Callable[[], Awaitable[None]] | None = None) -> None:
        """Read ``want`` pages into ``op.host_slots``; ``completed_tokens`` grows batch by
        batch. ``between``: awaited after each batch but the last."""
        ps = self.page_size
        host = op.host_slots
        assert host is not None
        agree = self.agreement

        def landed(first: int, good: int) -> None:
            self._remember(op.keys[first : first + good])
            op.completed_tokens += good * ps
            if agree is not None:
                agree.note_progress()

        got = await read_run(self.backend, self._host, op.keys[:want], host, landed=landed,
                             between=between, bandwidth=self._parts.metrics.prefetch_bandwidth,
                             sidecars=self._sidecars)
        if got < want:  # missing, corrupt or unreadable from there on
            self._known.invalidate_beyond(op.keys, got)

    async def finish_prefetch(self, op: PrefetchOp, policy: str | None = None) -> int:
        """Stop ``op`` per the stop policy, insert what arrived, release the rest; returns the
        tokens the insert added (not the pages the host tree held already).

        Cancelling the caller still releases everything (nothing fetched is inserted then).
        """
        if op.finished:
            raise InvalidInputError("this prefetch was already finished")
        stop = stop_policy(policy, self.policy)
        if self.agreement is not None:
            return await self._finish_agreed(op, stop)
        task = self._prefetches[op].task
        assert task is not None
        try:
            await await_stop(task, stop, self.policy, op.requested_tokens, op.started)
        except BaseException:
            await self._release(op, insert=False)
            raise
        return await self._release(op, insert=True)

    async def abort_prefetch(self, op: PrefetchOp) -> None:
        """Drop ``op``: nothing is inserted, every page and pin is released."""
        if not op.finished:
            await self._release(op, insert=False)

    def abort_soon(self, op: PrefetchOp) -> None:
        """Release ``op`` in the background (its request ended without finishing it)."""
        self._tasks.spawn(self._abort_group, self.abort_prefetch(op))

    async def _release(self, op: PrefetchOp, *, insert: bool) -> int:
        if op.finished:  # already released (e.g. by close() while its requester waited)
            return 0
        op.finished = True
        run = self._prefetches[op]
        try:
            return await self._release_now(op, run, insert)
        finally:
            run.released.set()

    async def _release_now(self, op: PrefetchOp, run: PrefetchTasks, insert: bool) -> int:
        t = self._t
        task = run.task
        assert task is not None
        # The backend never touches our buffers once its call returned or was cancelled. If our
        # caller is cancelled meanwhile, finish the release first, then let the cancel through.
        cancelled = await stop_and_wait(task, "prefetch_failed")
        for side in run.side:  # several ranks, hybrid: component reads and searches
            cancelled = await stop_and_wait(side, "prefetch_failed") or cancelled
        hy = self._hybrid
        if (insert and not cancelled and hy is not None and op.host_slots is not None
                and op.agreed_tokens is None and not op.hy.parts_settled):
            # Stopped early: the components of the deepest restorable prefix that arrived.
            try:
                await hy.fetch(op, self.backend, self.floor_pages())
            except asyncio.CancelledError:
                cancelled = True
            except Exception as exc:  # a storage fault: nothing restorable
                _log.warning("prefetch_component_fetch_failed", error=repr(exc))
        self._prefetches.pop(op, None)
        if op in self._agreeing:
            self._agreeing.remove(op)
        self._reserve(op, 0)
        taken = done = 0
        host = op.host_slots
        if host is not None:
            got = op.completed_tokens if op.agreed_tokens is None else op.agreed_tokens
            done = got if insert else 0
            if done < len(host) and self._all_or_nothing:
                done = 0  # a sidecar that cannot be cut short: the whole prefix or nothing
            kw: dict[str, Any] = {}
            if done and hy is not None:  # the restorable prefix the components cover
                done, kw = hy.insert_args(op, done)
            if done:
                res = t.tree.insert_host(op.key, op.start, host[:done], **kw)
                # The tree adopted the slots, but for pages it already had: those it gives
                # back (still this prefetch's, freed here).
                adopted = host[:done]
                if res.device_frees:
                    dups = np.concatenate(res.device_frees)
                    t.free_host(dups)
                    adopted = np.setdiff1d(adopted, dups, assume_unique=True)
                t.host_adopted(adopted)
                if hy is not None:
                    hy.release(op, inserted=True)
                    hy.tier.free_host(res.component_frees)
                taken = len(adopted)  # what it added: SGLang's loaded_from_storage
            t.free_host(host[done:])
        if hy is not None:
            hy.release(op, inserted=False)  # what was not inserted
        t.tree.unlock_host(op.pin)
        count_finished(self._parts.metrics, op, kept=insert,
                       complete=host is not None and done == len(host), tokens=taken)
        if cancelled:
            raise asyncio.CancelledError
        return taken

    async def close(self) -> None:
        """Abort prefetches and wait for writes (called by the cache before it frees memory)."""
        for op, run in list(self._prefetches.items()):
            if op.finished:  # its requester is releasing it: wait until that is over
                await run.released.wait()
            else:
                await self._release(op, insert=False)
        await wait_all(self._aborts)
        await self.drain()
        unlisten(self.backend, self._known)

    # ------------------------------------------------------------------ several ranks
    # With several ranks the decisions of a prefetch that depend on rank-local timing are taken
    # at agreement ticks (asynccache/ranks/agreement.py): the hit query's hit (MIN over ranks,
    # then the host allocation, identically everywhere), whether it may stop (MAX of "cannot
    # stop") and how many fetched tokens to keep (MIN). Each op in ``_agreeing`` contributes
    # ENTRY_WIDTH ints to a tick: [local hit or -1, its negation (for the MAX), -1 if it cannot
    # stop else 0, local pages read, hybrid cand, hybrid target state] (the hybrid ones: see
    # asynccache/l3/hybrid_ranks.py; FULL caches send 0 there).

    async def _query(self, op: PrefetchOp) -> None:
        try:
            hit = await self._hits(op)
            if self._hybrid is not None:  # the deepest prefix every pool can restore here
                hit = await self._hybrid.query(op, self.backend, hit, self.floor_pages())
            op.local_hit = hit
        except Exception as exc:  # a storage fault is a miss
            _log.warning("prefetch_query_failed", error=repr(exc))
            op.local_hit = 0
        finally:
            agree = self.agreement
            if agree is not None:
                agree.note_progress()

    def _cannot_stop(self, op: PrefetchOp) -> bool:
        """This rank's vote: ``op`` may not stop yet (the stop rule,
        :func:`~asynccache.l3.policy.may_stop`, on what arrived here)."""
        stop = op.stop_policy
        if stop is None:
            return True
        if op.phase == "stopping":
            return False
        if op.phase == "query":
            complete = False
        else:
            task = self._prefetches[op].task
            complete = op.completed_tokens >= op.want_pages * self.page_size or (
                task is not None and task.done())
        return not may_stop(stop, self.policy, op.requested_tokens,
                            time.perf_counter() - op.started, complete=complete)

    def locally_busy(self) -> bool:
        """An agreeing prefetch still has local work (a query or a read) in progress."""
        for op in self._agreeing:
            run = self._prefetches[op]
            if (run.task is not None and not run.task.done()) or any(
                    not t.done() for t in run.side):
                return True
        return False

    def agreement_entries(self) -> tuple[list[PrefetchOp], list[list[int]]]:
        """This rank's view of every agreeing prefetch, for one tick."""
        ps = self.page_size
        ops = list(self._agreeing)
        entries = []
        for op in ops:
            hit = op.local_hit if op.phase == "query" else 0
            pages = op.completed_tokens // ps if op.phase in ("transfer", "stopping") else 0
            cand, status = (self._agreed_hy.entry(op) if self._agreed_hy is not None
                            else (0, 0))
            entries.append([hit, -hit if hit >= 0 else 0, -1 if self._cannot_stop(op) else 0,
                            pages, cand, status])
        return ops, entries

    def apply_agreement(self, ops: Sequence[PrefetchOp], agreed: Sequence[Sequence[int]]) -> None:
        """Apply a tick's reduced values (identical on every rank) to ``ops``."""
        ps = self.page_size
        hy = self._agreed_hy
        for op, (hit, neg_max_hit, stop, pages, cand, status) in zip(ops, agreed, strict=True):
            if op.finished or op.phase in ("stopped", "done"):
                continue
            was = op.phase
            if was == "query" and hit >= 0 and (hy is None or hy.converged(op, hit, -neg_max_hit)):
                try:
                    op.want_pages = self._take_hit(op, hit)
                except Exception as exc:  # e.g. the cache is closing: identical on every rank
                    _log.warning("prefetch_not_started", error=repr(exc))
                    op.want_pages = 0
                if op.want_pages:
                    op.phase = "transfer"
                    if hy is not None:
                        hy.start(op)
                    else:
                        self.run_main(op, self.read_hit(op, op.want_pages))
                else:
                    op.phase = "done"
                    op.agreed_tokens = 0
            if hy is not None and was in ("transfer", "stopping"):
                hy.apply(op, cand, status)
            if stop == 0 and op.phase in ("query", "transfer"):
                if hy is not None and was == "transfer":
                    hy.stop(op, pages)
                else:
                    op.phase = "stopped"
                    op.agreed_tokens = pages * ps if was == "transfer" else 0
            if hy is not None and op.phase == "stopping" and hy.settled(op, cand):
                op.phase = "stopped"
                op.agreed_tokens = op.hy.parts_pages * ps
            if op.phase in ("stopped", "done") and op in self._agreeing:
                self._agreeing.remove(op)

    async def _finish_agreed(self, op: PrefetchOp, policy: str) -> int:
        op.stop_policy = policy
        try:
            agree = self.agreement
            assert agree is not None
            await agree.until(lambda: op.phase in ("stopped", "done") or op.finished)
        except BaseException:
            await self._release(op, insert=False)
            raise
        return await self._release(op, insert=True)
