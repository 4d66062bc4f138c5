"""The L3 tier inside the engine: storage backup (L2 -> L3) and prefetch (L3 -> L2).

Backup: when a node's D->H copy commits, its pages are written to the backend from host memory
(the node stays host-pinned until the write returns); pages known to exist are skipped.
Prefetch: for a request whose prompt runs past its cached prefix, ask the backend how many of
the following pages exist, allocate host memory, read them in batches and insert the fetched
prefix into the tree as host copies, from where the usual load-back brings it to the device.

Every storage fault degrades: the backend returns False for a page (a miss or a skipped write,
counted and logged) and the engine goes on. Nothing here blocks the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.existence import StorageExistenceCache, listen, unlisten
from asynccache.hostpages import page_buffers, read_pages
from asynccache.logs import get_logger
from asynccache.tasks import stop_and_wait
from asynccache.tree import LockReceipt, MatchResult, RadixKey

if TYPE_CHECKING:
    from asynccache.cache import HierarchicalCache
    from asynccache.l3_hybrid import HybridStorage
    from asynccache.l3_hybrid_ranks import AgreedComponents

_log = get_logger("l3")

BATCH_PAGES: Final = 128
PREFETCH_POLICIES: Final = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True, slots=True)
class StoragePolicy:
    """How the engine uses storage.

    ``prefetch_threshold``: prompts whose uncached part is shorter are not prefetched (tokens).
    ``prefetch_policy``: when a request stops waiting for its prefetch — ``best_effort`` (take
    what has arrived), ``wait_complete`` (all of it), ``timeout`` (all of it or
    ``timeout_base_s + tokens / 1024 * timeout_per_ki_token_s``, whichever comes first).
    ``prefetch_capacity_fraction``: prefetches may occupy at most this share of the host pool.
    ``write_failure_threshold`` consecutive failed write batches (nothing stored) open a circuit
    breaker: backups are not written to storage (counted as skipped, ``circuit_open``) for
    ``write_backoff_s``, doubling while the store keeps failing (up to 64x); a write that stores
    something closes it. A dead store then costs one failed batch per back-off, not a queue of
    writes that grows with every backup.
    """

    prefetch_threshold: int = 256
    prefetch_policy: str = "best_effort"
    timeout_base_s: float = 1.0
    timeout_per_ki_token_s: float = 0.25
    prefetch_capacity_fraction: float = 0.5
    write_concurrency: int = 4
    known_keys: int = 1 << 20
    write_failure_threshold: int = 3
    write_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ConfigError(
                f"unknown prefetch_policy {self.prefetch_policy!r}; choose one of "
                f"{list(PREFETCH_POLICIES)}"
            )
        if isinstance(self.prefetch_threshold, bool) or not isinstance(self.prefetch_threshold, int) \
                or self.prefetch_threshold < 0:
            raise ConfigError(f"prefetch_threshold must be an int >= 0, got {self.prefetch_threshold!r}")
        for name in ("timeout_base_s", "timeout_per_ki_token_s"):
            if not isinstance(getattr(self, name), int | float) or getattr(self, name) < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {getattr(self, name)!r}")
        if not 0 < self.prefetch_capacity_fraction <= 1:
            raise ConfigError(
                f"prefetch_capacity_fraction must be in (0, 1], got {self.prefetch_capacity_fraction!r}"
            )
        if self.write_concurrency < 1 or self.known_keys < 0:
            raise ConfigError("write_concurrency must be >= 1 and known_keys >= 0")
        if isinstance(self.write_failure_threshold, bool) or not isinstance(
                self.write_failure_threshold, int) or self.write_failure_threshold < 1:
            raise ConfigError(f"write_failure_threshold must be an int >= 1, got "
                              f"{self.write_failure_threshold!r}")
        if not isinstance(self.write_backoff_s, int | float) or not self.write_backoff_s > 0:
            raise ConfigError(f"write_backoff_s must be a number > 0, got {self.write_backoff_s!r}")

    def timeout_s(self, num_tokens: int) -> float:
        """The ``timeout`` policy's deadline for a prefetch of ``num_tokens`` tokens."""
        return self.timeout_base_s + num_tokens / 1024 * self.timeout_per_ki_token_s


@dataclass(eq=False)
class PrefetchOp:
    """One prefetch in flight. ``completed_tokens`` grows as batches land (visible progress)."""

    key: RadixKey
    start: int  # tokens of the key already cached when the prefetch started
    requested_tokens: int
    keys: list[str]
    pin: LockReceipt
    started: float
    host_slots: np.ndarray | None = None
    hit_tokens: int = 0
    completed_tokens: int = 0
    outcome: str = "issued"
    task: asyncio.Task[None] | None = None
    finished: bool = False
    staging: list[torch.Tensor] = field(default_factory=list)
    reserved_tokens: int = 0  # counted against the prefetch capacity until released
    # multi-rank (see asynccache/agreement.py): the agreed phase and figures
    phase: str = "query"  # query -> transfer -> [stopping: hybrid] -> stopped (done: revoked)
    local_hit: int = -1  # pages this rank found (-1: query still running)
    want_pages: int = 0
    stop_policy: str | None = None  # set by finish_prefetch
    agreed_tokens: int | None = None
    # hybrid caches (asynccache/l3_hybrid.py): the restorable prefix the query found (pages),
    # host slots of the fetched SWA pages / state and the prefix they restore (pages; 0: none),
    # whether fetching them is over, and what storage said of component objects (False: missing
    # or could not be read)
    restorable_pages: int = 0
    parts: dict[str, np.ndarray] | None = None
    parts_pages: int = 0
    parts_new: dict[str, np.ndarray] | None = None  # being fetched to replace ``parts``
    parts_settled: bool = False
    stored: dict[str, bool] = field(default_factory=dict)
    # hybrid caches on several ranks (asynccache/l3_hybrid_ranks.py): the deepest restorable
    # arrived prefix found here (-1: searching) within ``cap`` pages, the agreed prefix whose
    # components are being read (0: none) and this rank's state of that read, whether no host
    # slots were left for components, the targets some rank could not read (agreed), and the
    # rank-local tasks reading components or searching
    cand: int = -1
    cand_gen: int = 0
    cap: int = 0
    target: int = 0
    target_status: int = 2
    blocked: bool = False
    no_room: int = 0  # the cand last found no component host slots (while transferring)
    failed_targets: set[int] = field(default_factory=set)
    side: list[asyncio.Task[None]] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)  # set once _release is over


class StorageTier:
    """Storage backup and prefetch for one :class:`~asynccache.HierarchicalCache`."""

    def __init__(self, cache: HierarchicalCache, backend: Any, policy: StoragePolicy) -> None:
        if cache.host_pool is None:
            raise ConfigError("storage needs a host tier: set host_tokens or host_bytes")
        self.cache = cache
        self.backend = backend
        self.policy = policy
        # Page keys believed stored (written or read by this tier): writes skip them. A prefetch
        # that finds a page missing, or fails to read it, forgets it (and the pages after it).
        self._known = StorageExistenceCache(max(1, policy.known_keys))
        self._writes: set[asyncio.Task[None]] = set()
        self._prefetches: set[PrefetchOp] = set()
        self._agreeing: list[PrefetchOp] = []  # multi-rank: prefetches in start order
        self._occupied = 0
        self._aborts: set[asyncio.Task[None]] = set()  # releases of prefetches nobody finished
        # Write circuit breaker: consecutive failed batches, and writes are off until this time.
        self._failures = 0
        self._closed_until = 0.0
        self._backoff = 0.0
        host = cache.host_pool
        self._host = host
        self._page_bytes = host.page_bytes
        self._hybrid: HybridStorage | None = None
        self._agreed_hy: AgreedComponents | None = None
        if cache.hybrid is not None:
            from asynccache.l3_hybrid import HybridStorage
            from asynccache.l3_hybrid_ranks import AgreedComponents

            self._hybrid = HybridStorage(cache)
            if cache._agree is not None:
                self._agreed_hy = AgreedComponents(self, self._hybrid)
        self.set_policy(policy)
        listen(backend, self._known)

    def set_policy(self, policy: StoragePolicy) -> None:
        """Use ``policy`` from now on (operations already running keep their limits)."""
        assert self.cache.host_pool is not None
        self.policy = policy
        self._write_sem = asyncio.Semaphore(policy.write_concurrency)
        self._capacity_limit = int(self.cache.host_pool.num_slots * policy.prefetch_capacity_fraction)
        if policy.known_keys:
            self._known.resize(policy.known_keys)
        else:
            self._known.clear()

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
            self.cache.metrics.storage_write_circuit_opened.inc()
            _log.warning("storage_writes_suspended", failed_batches=self._failures,
                         backoff_s=self._backoff)

    # ------------------------------------------------------------------ backup (L2 -> L3)
    def backup_nodes(self, node_ids: Sequence[int]) -> None:
        """Write the pages of freshly backed-up nodes to storage (in the background)."""
        tree = self.cache.tree
        agree = self.cache._agree
        for nid in node_ids:
            keys = tree.node_page_keys(nid)
            if agree is not None:  # multi-rank: the known set is rank-local, pins must not be
                self._agreed_write(nid, keys)
                continue
            extra = self._hybrid.node_objects(nid, keys) if self._hybrid is not None else None
            if all(k in self._known for k in keys) and not (extra and extra[0]):
                self.cache.metrics.storage_backup_skipped_tokens.labels(reason="exists").inc(
                    len(keys) * self.cache.page_size)
                continue
            if self._writes_suspended():
                self.cache.metrics.storage_backup_skipped_tokens.labels(
                    reason="circuit_open").inc(len(keys) * self.cache.page_size)
                continue
            pin = tree.lock_host(nid)
            host_slots = tree.host_slots_of(nid)
            assert host_slots is not None
            task = asyncio.get_running_loop().create_task(
                self._write(keys, host_slots, pin, extra))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    def _agreed_write(self, nid: int, keys: list[str]) -> None:
        tree = self.cache.tree
        pin = tree.lock_host(nid)
        host_slots = tree.host_slots_of(nid)
        assert host_slots is not None and self.cache._agree is not None
        # hybrid: the node's SWA pages and state, read now (at the agreed commit)
        extra = self._hybrid.node_objects(nid, keys) if self._hybrid is not None else None
        task = asyncio.get_running_loop().create_task(
            self._write(keys, host_slots, None, extra))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        self.cache._agree.defer_task(task, lambda: tree.unlock_host(pin))

    async def _write(self, keys: list[str], host_slots: np.ndarray,
                     pin: LockReceipt | None,
                     extra: tuple[list[str], list[torch.Tensor]] | None = None) -> None:
        ps = self.cache.page_size
        metrics = self.cache.metrics
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
                    pages = page_buffers(self._host, slots, fill=True)
                    t0 = time.perf_counter()
                    ok = await self.backend.set_batch([batch[j] for j in todo],
                                                      [pages[j] for j in todo])
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
                self.cache.tree.unlock_host(pin)

    @property
    def writes_pending(self) -> bool:
        """Storage writes started and not yet done (not yet retired, with several ranks)."""
        agree = self.cache._agree
        return bool(self._writes) if agree is None else not agree.lane_empty("storage")

    async def drain(self) -> None:
        """Wait for every storage write started so far."""
        agree = self.cache._agree
        if agree is not None:
            await agree.until(lambda: agree.lane_empty("storage"))
        elif self._writes:
            # Shielded: cancelling the waiter must not cancel the writes (their pages would be
            # lost while their host pins are released).
            await asyncio.shield(asyncio.gather(*list(self._writes), return_exceptions=True))

    # ------------------------------------------------------------------ prefetch (L3 -> L2)
    def start_prefetch(self, key: RadixKey, match: MatchResult) -> PrefetchOp | None:
        """Start fetching the pages of ``key`` after ``match``'s cached prefix; None if declined."""
        cache = self.cache
        ps = cache.page_size
        outcomes = cache.metrics.prefetch_outcomes
        start = match.device_prefix_len + match.host_hit_length
        total = len(key) - len(key) % ps
        n = total - start
        if n <= 0 or n < max(self.policy.prefetch_threshold, ps):
            outcomes.labels(outcome="declined_too_short").inc()
            return None
        if self._occupied >= self._capacity_limit:  # full (pages being read fill the capacity)
            outcomes.labels(outcome="declined_rate_limited").inc()
            return None
        keys = cache.tree.chain_keys(match.best_node, key, start)
        pin = cache.tree.lock_host(match.best_node)
        op = PrefetchOp(key=key, start=start, requested_tokens=n, keys=keys, pin=pin,
                        started=time.perf_counter())
        self._prefetches.add(op)
        outcomes.labels(outcome="issued").inc()
        if cache._agree is not None:
            self._agreeing.append(op)
            op.task = asyncio.get_running_loop().create_task(self._query(op))
        else:
            op.task = asyncio.get_running_loop().create_task(self._fetch(op))
        return op

    async def _hits(self, op: PrefetchOp) -> int:
        """How many of ``op``'s pages storage holds, from the first (the existence query)."""
        hit = 0
        for i in range(0, len(op.keys), BATCH_PAGES):
            batch = op.keys[i : i + BATCH_PAGES]
            found = await self.backend.exists_prefix(batch)
            hit += found
            if found < len(batch):
                break
        if hit < len(op.keys):  # the backend's answer is evidence: forget what it lacks
            self._known.invalidate_beyond(op.keys, hit)
        return hit

    def _floor_pages(self) -> int:
        """The fewest pages a prefetch may bring (the threshold, at least one page)."""
        ps = self.cache.page_size
        return -(-max(self.policy.prefetch_threshold, ps) // ps)

    async def _fetch(self, op: PrefetchOp) -> None:
        hit = await self._hits(op)
        hy = self._hybrid
        if hy is not None:  # only the prefix every pool can restore
            hit = await hy.query(op, self.backend, hit, self._floor_pages())
        want = self._take_hit(op, hit)
        if want and hy is not None and want < op.restorable_pages:
            # Host memory for a shorter prefix only: read no further than its restorable end.
            p = await hy.restorable(self.backend, op, want, self._floor_pages())
            hy.note_fallback(op, "host_memory", op.restorable_pages, p)
            op.restorable_pages = p
            want = self._trim(op, p)
        if want:
            if hy is None:
                await self._read(op, want)
                return
            floor = self._floor_pages()

            async def between() -> None:  # what a stop can insert: the deepest that arrived
                await hy.fetch(op, self.backend, floor, final=False)

            await self._read(op, want, between)
            await hy.fetch(op, self.backend, floor)

    def _trim(self, op: PrefetchOp, pages: int) -> int:
        """Keep the host memory of ``op``'s first ``pages`` pages only (0: revoke it)."""
        cache = self.cache
        ps = cache.page_size
        host = op.host_slots
        assert host is not None and cache.host_pool is not None
        if len(host) > pages * ps:
            cache.host_pool.allocator.free(host[pages * ps :])
            cache._host_inflight -= len(host) - pages * ps
        op.host_slots = host[: pages * ps] if pages else None
        self._reserve(op, pages * ps)
        if not pages:
            op.outcome = "revoked_no_host_memory"
        return pages

    def _take_hit(self, op: PrefetchOp, hit: int) -> int:
        """Account the query's ``hit`` pages and allocate host memory for them (or a shorter
        prefix under pressure); returns the pages to read (0: revoked)."""
        cache = self.cache
        ps = cache.page_size
        metrics = cache.metrics
        op.hit_tokens = hit * ps
        metrics.storage_hit_tokens.inc(hit * ps)
        metrics.storage_miss_tokens.inc(op.requested_tokens - hit * ps)
        bar = max(self.policy.prefetch_threshold, ps)
        if hit * ps < bar:
            op.outcome = "revoked_insufficient"
            return 0
        # Only pages found and about to be read count against the prefetch capacity, and never
        # beyond it unless this is the only prefetch reading (the reference reserves every
        # requested token from the start, found or not: it declines concurrent prefetches that
        # would fit, and overshoots with the last one it admits).
        room = (self._capacity_limit - self._occupied) // ps
        want = hit if self._occupied == 0 else min(hit, room)
        if want * ps < bar:
            op.outcome = "revoked_rate_limited"
            return 0
        # Host memory for the hit; under pressure a shorter prefix that still clears the bar.
        host = cache._alloc_host(want * ps)
        while host is None and want > 1:
            want = min(want - 1, cache.host_pool.allocator.available_size // ps)  # type: ignore[union-attr]
            if want * ps < bar:
                break
            host = cache._alloc_host(want * ps)
        if host is None:
            op.outcome = "revoked_no_host_memory"
            return 0
        cache._host_inflight += len(host)
        op.host_slots = host
        self._reserve(op, want * ps)
        return want

    def _reserve(self, op: PrefetchOp, tokens: int) -> None:
        """Lower ``op``'s reservation against the prefetch capacity to ``tokens``."""
        self._occupied -= op.reserved_tokens - tokens
        op.reserved_tokens = tokens

    async def _read(self, op: PrefetchOp, want: int,
                    between: Callable[[], Awaitable[None]] | None = None) -> None:
        """Read ``want`` pages into ``op.host_slots`` in batches; ``completed_tokens`` grows.
        ``between``: awaited after each batch but the last."""
        cache = self.cache
        ps = cache.page_size
        metrics = cache.metrics
        host = op.host_slots
        assert host is not None
        t0 = time.perf_counter()
        for i in range(0, want, BATCH_PAGES):
            keys = op.keys[i : min(want, i + BATCH_PAGES)]
            slots = host[i * ps : (i + len(keys)) * ps]
            good = await read_pages(self.backend, self._host, keys, slots)
            self._remember(keys[:good])
            if good < len(keys):  # missing, corrupt or unreadable from there on
                self._known.invalidate_beyond(op.keys, i + good)
            op.completed_tokens += good * ps
            if cache._agree is not None:
                cache._agree.note_progress()
            if good < len(keys):
                break
            if between is not None and i + BATCH_PAGES < want:
                await between()
        dt = time.perf_counter() - t0
        if op.completed_tokens and dt > 0:
            metrics.prefetch_bandwidth.observe(op.completed_tokens // ps * self._page_bytes / dt)

    async def finish_prefetch(self, op: PrefetchOp, policy: str | None = None) -> int:
        """Stop ``op`` per the stop policy, insert what arrived, release the rest; returns tokens.

        Cancelling the caller still releases everything (nothing fetched is inserted then).
        """
        if op.finished:
            raise InvalidInputError("this prefetch was already finished")
        policy = policy or self.policy.prefetch_policy
        if policy not in PREFETCH_POLICIES:
            raise ConfigError(f"unknown prefetch policy {policy!r}")
        task = op.task
        assert task is not None
        if self.cache._agree is not None:
            return await self._finish_agreed(op, policy)
        try:
            if policy == "wait_complete":
                await asyncio.wait({task})
            elif policy == "timeout":
                remaining = self.policy.timeout_s(op.requested_tokens) - (
                    time.perf_counter() - op.started)
                if remaining > 0:
                    await asyncio.wait({task}, timeout=remaining)
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
        task = asyncio.get_running_loop().create_task(self.abort_prefetch(op))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _release(self, op: PrefetchOp, *, insert: bool) -> int:
        if op.finished:  # already released (e.g. by close() while its requester waited)
            return 0
        op.finished = True
        try:
            return await self._release_now(op, insert)
        finally:
            op.released.set()

    async def _release_now(self, op: PrefetchOp, insert: bool) -> int:
        cache = self.cache
        task = op.task
        assert task is not None
        # The backend never touches our buffers once its call returned or was cancelled. If our
        # caller is cancelled meanwhile, finish the release first, then let the cancel through.
        cancelled = await stop_and_wait(task, "prefetch_failed")
        for side in op.side:  # multi-rank hybrid: component reads and searches
            cancelled = await stop_and_wait(side, "prefetch_failed") or cancelled
        if (insert and not cancelled and self._hybrid is not None and op.host_slots is not None
                and op.agreed_tokens is None and not op.parts_settled):
            # Stopped early: the components of the deepest restorable prefix that arrived.
            try:
                await self._hybrid.fetch(op, self.backend, self._floor_pages())
            except asyncio.CancelledError:
                cancelled = True
            except Exception as exc:  # a storage fault: nothing restorable
                _log.warning("prefetch_component_fetch_failed", error=repr(exc))
        self._prefetches.discard(op)
        if op in self._agreeing:
            self._agreeing.remove(op)
        self._reserve(op, 0)
        taken = 0
        host = op.host_slots
        if host is not None:
            cache._host_inflight -= len(host)
            got = op.completed_tokens if op.agreed_tokens is None else op.agreed_tokens
            done = got if insert else 0
            kw: dict[str, Any] = {}
            if done and self._hybrid is not None:  # the restorable prefix the components cover
                done, kw = self._hybrid.insert_args(op, done)
            if done:
                res = cache.tree.insert_host(op.key, op.start, host[:done], **kw)
                for dup in res.device_frees:  # host slots of pages the tree already had
                    cache.host_pool.allocator.free(dup)  # type: ignore[union-attr]
                if self._hybrid is not None:
                    self._hybrid.release(op, inserted=True)
                    self._hybrid.tier.free_host(res.component_frees)
                taken = done
            if len(host) > done:
                cache.host_pool.allocator.free(host[done:])  # type: ignore[union-attr]
        if self._hybrid is not None:
            self._hybrid.release(op, inserted=False)  # what was not inserted
        cache.tree.unlock_host(op.pin)
        outcomes = cache.metrics.prefetch_outcomes
        if not insert:
            outcomes.labels(outcome="aborted").inc()
        elif op.outcome == "issued":
            full = host is not None and done == len(host)
            op.outcome = "completed" if full else "partial"
            outcomes.labels(outcome=op.outcome).inc()
        else:
            outcomes.labels(outcome=op.outcome).inc()
        cache.metrics.prefetched_tokens.inc(taken)
        if cancelled:
            raise asyncio.CancelledError
        return taken

    async def close(self) -> None:
        """Abort prefetches and wait for writes (called by the cache before it frees memory)."""
        for op in list(self._prefetches):
            if op.finished:  # its requester is releasing it: wait until that is over
                await op.released.wait()
            else:
                await self._release(op, insert=False)
        if self._aborts:
            await asyncio.gather(*list(self._aborts), return_exceptions=True)
        await self.drain()
        unlisten(self.backend, self._known)

    # ------------------------------------------------------------------ multi-rank prefetch
    # With several ranks the decisions of a prefetch that depend on rank-local timing are taken
    # at agreement ticks (asynccache/agreement.py): the existence-query hit (MIN over ranks,
    # then the host allocation, identically everywhere), whether it may stop (MAX of "cannot
    # stop") and how many fetched tokens to keep (MIN). Each op in ``_agreeing`` contributes
    # ENTRY_WIDTH ints to a tick: [local hit or -1, its negation (for the MAX), -1 if it cannot
    # stop else 0, local pages read, hybrid cand, hybrid target state] (the hybrid ones: see
    # asynccache/l3_hybrid_ranks.py; FULL caches send 0 there).

    async def _query(self, op: PrefetchOp) -> None:
        try:
            hit = await self._hits(op)
            if self._hybrid is not None:  # the deepest prefix every pool can restore here
                hit = await self._hybrid.query(op, self.backend, hit, self._floor_pages())
            op.local_hit = hit
        except Exception as exc:  # a storage fault is a miss
            _log.warning("prefetch_query_failed", error=repr(exc))
            op.local_hit = 0
        finally:
            if self.cache._agree is not None:
                self.cache._agree.note_progress()

    def _cannot_stop(self, op: PrefetchOp) -> bool:
        policy = op.stop_policy
        if policy is None:
            return True
        if op.phase == "stopping":
            return False
        if policy == "best_effort":
            return False
        if op.phase == "query":
            incomplete = True
        else:
            task = op.task
            incomplete = op.completed_tokens < op.want_pages * self.cache.page_size and not (
                task is not None and task.done())
        if policy == "timeout" and incomplete:
            return time.perf_counter() - op.started < self.policy.timeout_s(op.requested_tokens)
        return incomplete

    def locally_busy(self) -> bool:
        """An agreeing prefetch still has local work (a query or a read) in progress."""
        return any((op.task is not None and not op.task.done())
                   or any(not t.done() for t in op.side) for op in self._agreeing)

    def agreement_entries(self) -> tuple[list[PrefetchOp], list[list[int]]]:
        """This rank's view of every agreeing prefetch, for one tick."""
        ps = self.cache.page_size
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
        ps = self.cache.page_size
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
                        op.task = asyncio.get_running_loop().create_task(
                            self._read(op, op.want_pages))
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
                op.agreed_tokens = op.parts_pages * ps
            if op.phase in ("stopped", "done") and op in self._agreeing:
                self._agreeing.remove(op)

    async def _finish_agreed(self, op: PrefetchOp, policy: str) -> int:
        op.stop_policy = policy
        try:
            agree = self.cache._agree
            assert agree is not None
            await agree.until(lambda: op.phase in ("stopped", "done") or op.finished)
        except BaseException:
            await self._release(op, insert=False)
            raise
        return await self._release(op, insert=True)
