"""The replay driver: a trace through real caches, with every cache decision taken in trace
order and trace time, never at this machine's speed.

**The model.** Time is the trace's (arrival times in seconds). A request is *admitted* at its
arrival, or later when its instance already has ``max_in_flight`` requests running (then in
arrival order): it matches its prompt, prefetches from storage (L3 -> L2), loads its host hit
back (L2 -> L1), "computes" the missed tokens (allocates slots and writes their deterministic
KV) and verifies the KV it was served from L2 / L3. It *finishes* (caches its prompt, frees
the rest) ``computed / prefill_rate + output_len / decode_rate`` seconds later; with both
rates 0 (the default) compute takes no trace time, so every request finishes before the next
one arrives. Finishes come before admissions at the same time. A request that does not fit
in device memory while others hold it waits for the next finish of its instance; one that
does not fit alone is *rejected* (counted apart, not in the hit rates).

**Determinism.** Each admission and each finish is one *step*, run alone to completion, and
after every step the driver waits for every copy and storage write it started
(``flush`` + ``drain``); within a step, the slots a request needs are freed in eviction
rounds that each wait for the same (:meth:`TraceDriver._make_room`). So the next step sees a
state that depends only on the trace and the options, and every storage write completes before the next request is admitted — unless a
write bandwidth is modelled (:class:`~asynccache.replay.storemodel.TraceTimeStore`). Requests
*overlap in trace time* (several admitted, holding their prefix pins and slots, none of them
finished); the engine runs one step at a time. Prefetch stop policies other than
``wait_complete`` stop on the wall clock (``timeout``) or on what has arrived
(``best_effort``), so only ``wait_complete`` is deterministic with storage.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asynccache.cache import HierarchicalCache
from asynccache.config import CacheConfig
from asynccache.errors import AsyncCacheError, ConfigError, PoolExhaustedError
from asynccache.l3 import StoragePolicy
from asynccache.logs import get_logger
from asynccache.metrics import serve_metrics
from asynccache.replay.bound import BeladyBound, InfiniteBound
from asynccache.replay.formats import TraceFormatError, TraceRequest
from asynccache.replay.kvcheck import ReplayKV
from asynccache.replay.kvpattern import STORAGE_TAG
from asynccache.replay.storemodel import TraceTimeStore
from asynccache.request import CacheRequest
from asynccache.tree import RadixKey

_log = get_logger("replay")
PAGE_HEADER_BYTES = 64  # a stored page's header (asynccache.storage.pageformat.HEADER_SIZE)


_DEVICE, _HOST, _STORAGE = 0, 1, 2  # where a served position's KV came from


def _runs(origin: np.ndarray) -> Iterator[tuple[int, int]]:
    """The ``[start, end)`` runs of non-zero entries of ``origin``."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], origin != 0, [0])).astype(np.int8)))
    for a, b in zip(edges[::2], edges[1::2], strict=True):
        yield int(a), int(b)


class KVMismatchError(AsyncCacheError):
    """A request was served KV that differs from what its tokens produce."""


@dataclass
class ReplayStats:
    """What one cache instance served. Token and page counters are over *served* requests
    (completed); rejected requests are counted apart."""

    requests: int = 0  # routed to this instance (served + rejected + never admitted)
    completed: int = 0
    rejected: int = 0  # did not fit in device memory even alone
    rejected_tokens: int = 0
    largest_rejected: int = 0  # tokens of the longest rejected prompt
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    computed_tokens: int = 0
    bound_hit_tokens: int = 0  # infinite-cache upper bound (whole pages seen before)
    prompt_pages: int = 0  # every page of every prompt, the partial last one included
    device_hit_pages: int = 0
    host_hit_pages: int = 0
    storage_hit_pages: int = 0
    bound_hit_pages: int = 0
    optimum_capacity_pages: int = 0  # the device pool's pages: the optimum's capacity
    optimum_hit_tokens: int = 0  # offline optimum (Belady over prefix pages) at L1 capacity
    optimum_hit_pages: int = 0
    verified_tokens: int = 0
    verified_draft_bytes: int = 0  # draft KV bytes checked (a draft sidecar, --draft-layers)
    max_in_flight: int = 0  # most requests admitted and unfinished at once (trace time)
    overlapped: int = 0  # requests admitted while another one of the instance was running
    queued: int = 0  # requests admitted after their arrival (in-flight cap or memory)
    wall_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    # Where the wall time went (seconds, see ``timing_figures``); never part of the results.
    timing: dict[str, float] = field(default_factory=dict)

    @property
    def reused_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens

    @property
    def reused_pages(self) -> int:
        return self.device_hit_pages + self.host_hit_pages + self.storage_hit_pages


@dataclass(frozen=True)
class ReplayOptions:
    """How a trace is replayed (see the module docstring for the model)."""

    time_scale: float = 0.0  # wall-clock pacing only: 0 as fast as possible, 1 the trace's clock
    max_in_flight: int = 32  # requests admitted and unfinished at once, per instance
    verify: str = "loaded"  # "loaded" (KV served from L2/L3), "all" (also device hits), "none"
    limit: int | None = None  # read only the first N requests of the trace
    storage_url: str | None = None  # file:///dir or s3://bucket/prefix?endpoint=...
    storage_policy: StoragePolicy | None = None
    prefill_rate: float = 0.0  # computed tokens per second of modelled compute (0: no time)
    decode_rate: float = 0.0  # output tokens per second per request (0: no decode time)
    write_bandwidth: float | None = None  # storage write bytes/s (None: done by the next request)
    clear_storage: bool = False  # empty the store (this layout's pages) before replaying
    # Serve the caches' Prometheus metrics at http://127.0.0.1:PORT/metrics while replaying
    # (0: a free port, see TraceDriver.metrics_url; None: not served).
    metrics_port: int | None = None
    # A draft model's KV in a sidecar pool (0: none), written and verified with the KV;
    # its heads and head_dim (None: the KV's).
    draft_layers: int = 0
    draft_heads: int | None = None
    draft_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("time_scale", "prefill_rate", "decode_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < float("inf"):
                raise ConfigError(f"{name} must be a number >= 0, got {v!r}")
        m = self.max_in_flight
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"max_in_flight must be an int >= 1, got {m!r}")
        if self.verify not in ("loaded", "all", "none"):
            raise ConfigError(f"verify must be 'loaded', 'all' or 'none', got {self.verify!r}")
        if self.limit is not None and (isinstance(self.limit, bool) or self.limit < 0):
            raise ConfigError(f"limit must be an int >= 0, got {self.limit!r}")
        port = self.metrics_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 0 <= port <= 65535):
            raise ConfigError(f"metrics_port must be an int in [0, 65535], got {port!r}")
        bw = self.write_bandwidth
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, int | float)
                               or not 0 < bw < float("inf")):
            raise ConfigError(f"write_bandwidth must be a number of bytes/s > 0, got {bw!r}")
        d = self.draft_layers
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ConfigError(f"draft_layers must be an int >= 0, got {d!r}")
        for name in ("draft_heads", "draft_head_dim"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be an int >= 1 (or None: the KV's), got {v!r}")
            if v is not None and not d:
                raise ConfigError(f"{name}={v!r} needs draft_layers >= 1 (a draft sidecar)")

    def draft_shape(self, config: CacheConfig) -> tuple[int, int, int] | None:
        """The draft sidecar's (layers, heads, head_dim), None without one."""
        if not self.draft_layers:
            return None
        return (self.draft_layers, self.draft_heads or config.num_heads,
                self.draft_head_dim or config.head_dim)

    def service_s(self, computed: int, output_len: int) -> float:
        """Trace seconds a request runs for after its admission."""
        t = computed / self.prefill_rate if self.prefill_rate else 0.0
        return t + (output_len / self.decode_rate if self.decode_rate else 0.0)


@dataclass(eq=False)
class _Flight:
    tr: TraceRequest
    req: CacheRequest
    inst: _Instance


@dataclass(eq=False)
class _Instance:
    index: int
    cache: HierarchicalCache
    stats: ReplayStats
    bound: InfiniteBound
    waiting: deque[TraceRequest] = field(default_factory=deque)
    running: int = 0
    blocked: bool = False  # the head of ``waiting`` needs memory a running request holds
    optimum: BeladyBound | None = None  # the offline optimum at this instance's L1 capacity
    kv: ReplayKV | None = None  # writes and verifies this cache's KV (set when it starts)


@dataclass
class RunOutcome:
    """How a run ended, besides its statistics."""

    stopped_by: str | None = None  # a malformed trace record ended the run early
    interrupted: bool = False  # cancelled (Ctrl-C): the report covers what finished
    storage_pages_at_start: int | None = None  # None: the backend cannot tell
    storage_foreign_pages: int = 0  # pages found that this run did not write
    storage_hidden_misses: int = 0  # lookups cut short by a modelled write still running

    @property
    def warm_storage(self) -> bool:
        return bool(self.storage_pages_at_start) or self.storage_foreign_pages > 0


Router = Callable[[TraceRequest, int], int]


def _serve(metrics: Any, port: int) -> Any:
    """The metrics server on 127.0.0.1:``port``; a port that cannot be bound (in use, not
    allowed) is a :class:`ConfigError` naming it, not an ``OSError`` out of the replay."""
    try:
        return serve_metrics(metrics, port=port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--metrics-port {port}: 127.0.0.1:{port} is already in use; "
                              "choose another port, or 0 for a free one") from None
        raise ConfigError(f"--metrics-port {port}: cannot listen on 127.0.0.1:{port} "
                          f"({exc.strerror or exc})") from None


class TraceDriver:
    """Replays one trace through ``instances`` caches built from ``config`` (one shared L3,
    ``options.storage_url``), routed by ``router(request, index)``."""

    def __init__(self, config: CacheConfig, options: ReplayOptions, instances: int,
                 router: Router, progress: Callable[[int], None] | None = None) -> None:
        self.config = config
        self.options = options
        self.n = instances
        self.router = router
        self.progress = progress
        self.clock = 0.0
        self.pooled_bound = InfiniteBound(config.page_size)
        self.pooled = ReplayStats()  # requests, prompt and bound over all instances
        self.outcome = RunOutcome()
        self.instances: list[_Instance] = []
        self.store: TraceTimeStore | None = None
        self._finishes: list[tuple[float, int, _Flight]] = []
        # Side work: the harness's own computations that touch no cache (prompts' page hashes,
        # the bounds), run in order while copies are in flight, so they overlap them.
        self._side: deque[Callable[[], object]] = deque()
        # id(request) -> (request, its page ids; None until computed), until it is admitted
        self._ids: dict[int, tuple[TraceRequest, np.ndarray | None]] = {}
        # id(request) -> where each prompt position's KV came from (_DEVICE / _HOST /
        # _STORAGE) by the request's own loads and fetches, over its attempts, until admitted
        self._origins: dict[int, np.ndarray] = {}
        self._seq = 0
        self._wall0 = 0.0
        self._warned_too_long = False
        self._stop = False
        self._stopped = asyncio.Event()
        self.metrics_url: str | None = None  # while replaying with options.metrics_port

    # ------------------------------------------------------------------ lifecycle
    async def run(self, trace: Iterable[TraceRequest]) -> list[ReplayStats]:
        t0 = time.perf_counter()
        caches = [HierarchicalCache(self.config) for _ in range(self.n)]
        draft = self.options.draft_shape(self.config)
        if draft is not None:
            for c in caches:
                c.register_draft_pools(num_layers=draft[0], num_heads=draft[1],
                                       head_dim=draft[2])
        backend = None
        server = None
        try:
            for c in caches:
                await c.start()
            setup_s = time.perf_counter() - t0
            if self.options.metrics_port is not None:
                server = _serve(caches[0].metrics if self.n == 1
                                else [c.metrics for c in caches], self.options.metrics_port)
                self.metrics_url = server.url
                _log.info("metrics_served", url=server.url)
            ps = self.config.page_size
            self.instances = [
                _Instance(i, c, ReplayStats(), InfiniteBound(ps),
                          optimum=BeladyBound(ps, c.device_pool.allocator.num_pages),
                          kv=ReplayKV(c.device_pool, c.shape, eagle=self.config.eagle,
                                      draft=c.sidecar("draft").device if draft else None))
                for i, c in enumerate(caches)]
            if self.options.storage_url:
                backend = await self._open_storage(caches[0], self.options.storage_url)
                policy = self.options.storage_policy or StoragePolicy(
                    prefetch_policy="wait_complete")
                for c in caches:
                    c.attach_storage(self.store, policy)
            try:
                await self._replay(trace)
                await self._quiesce()
            finally:
                t1 = time.perf_counter()
                self._settle_optimum()
                optimum_s = time.perf_counter() - t1
            for inst in self.instances:
                inst.cache.sanity_check()
                inst.stats.extra = engine_figures(inst.cache)
                inst.stats.timing = timing_figures(inst, setup_s, optimum_s)
            if self.store is not None:
                self.outcome.storage_foreign_pages = self.store.foreign_pages
                self.outcome.storage_hidden_misses = self.store.hidden_misses
        finally:
            if server is not None:
                server.close()
                self.metrics_url = None
            for c in caches:
                if c.state == "running":
                    await c.detach_storage()
                await c.aclose()
            if backend is not None:
                await backend.aclose()
        wall = time.perf_counter() - t0
        for inst in self.instances:
            inst.stats.wall_s = wall
        self.pooled.wall_s = wall
        return [inst.stats for inst in self.instances]

    async def _open_storage(self, cache: HierarchicalCache, url: str) -> Any:
        from asynccache.storage.factory import open_backend

        layout = cache.storage_layout()  # named apart from other writers' pages (STORAGE_TAG)
        backend = await open_backend(url, dataclasses.replace(
            layout, extra=f"{layout.extra}-{STORAGE_TAG}" if layout.extra else STORAGE_TAG))
        try:
            stats = backend.stats() if hasattr(backend, "stats") else {}
            capacity = stats.get("capacity_bytes")
            ps = self.config.page_size
            # a stored page: its KV object and, beside it, one object per KV-derived sidecar
            parts = [("", cache.shape.bytes_per_token)] + [
                (sc.name, sc.spec.shape.bytes_per_token) for sc in cache.sidecars
                if sc.spec.source == "kv"]
            page = sum(ps * b + PAGE_HEADER_BYTES for _, b in parts)
            if capacity is not None and capacity < page:
                what = "; ".join(
                    f"{ps} tokens x {b} B of KV + a {PAGE_HEADER_BYTES}-byte header" if not name
                    else f"sidecar {name!r}: {ps} tokens x {b} B + a {PAGE_HEADER_BYTES}-byte "
                    "header" for name, b in parts)
                raise ConfigError(
                    f"storage capacity {capacity:,} bytes ({url}) holds no "
                    f"page: one page takes {page:,} bytes ({what})")
            if self.options.clear_storage:
                await backend.clear()
            objects = backend.stats().get("objects") if hasattr(backend, "stats") else None
            self.outcome.storage_pages_at_start = int(objects) if objects is not None else None
            self.store = TraceTimeStore(backend, lambda: self.clock, self.options.write_bandwidth)
        except BaseException:
            await backend.aclose()
            raise
        return backend

    async def _replay(self, trace: Iterable[TraceRequest]) -> None:
        self._wall0 = time.perf_counter()
        try:
            await self._feed(iter(trace))
            await self._advance(float("inf"))
        except BaseException:
            await self._abort_running()
            raise

    def request_stop(self) -> None:
        """Stop reading the trace and admitting requests (Ctrl-C); requests already admitted
        still finish, and :meth:`run` returns what was served (``outcome.interrupted``)."""
        self._stop = True
        self._stopped.set()
        self.outcome.interrupted = True

    async def _feed(self, it: Iterator[TraceRequest]) -> None:
        limit = self.options.limit
        index = 0
        while (limit is None or index < limit) and not self._stop:
            try:
                tr = next(it)
            except StopIteration:
                return
            except TraceFormatError as err:
                if index == 0:
                    raise
                self.outcome.stopped_by = str(err)
                return
            t = max(float(tr.arrival), self.clock)
            inst = self.instances[self.router(tr, index) if self.n > 1 else 0]
            self._ids[id(tr)] = (tr, None)
            self._side.append(functools.partial(self._page_ids, tr, inst.kv, ahead=True))
            await self._advance(t)
            self.clock = t
            inst.stats.requests += 1
            self.pooled.requests += 1
            inst.waiting.append(tr)
            await self._admit(inst)
            index += 1

    async def _advance(self, t: float) -> None:
        """Run every finish due by trace time ``t`` (and the admissions each one unblocks)."""
        while self._finishes and self._finishes[0][0] <= t:
            when, _, flight = heapq.heappop(self._finishes)
            self.clock = max(self.clock, when)
            await self._finish(flight)
            await self._admit(flight.inst)

    async def _pace(self) -> None:
        scale = self.options.time_scale
        if scale > 0 and self.clock < float("inf") and not self._stop:
            delay = self._wall0 + self.clock * scale - time.perf_counter()
            if delay > 0:
                with contextlib.suppress(TimeoutError):  # woken early by request_stop()
                    await asyncio.wait_for(self._stopped.wait(), delay)

    # ------------------------------------------------------------------ steps
    async def _admit(self, inst: _Instance) -> None:
        while (inst.waiting and not inst.blocked and not self._stop
               and inst.running < self.options.max_in_flight):
            tr = inst.waiting[0]
            admitted = await self._admit_one(inst, tr)
            if admitted is None:  # others hold the memory: wait for a finish
                inst.blocked = True
                return
            inst.waiting.popleft()
            self._ids.pop(id(tr), None)
            self._origins.pop(id(tr), None)

    async def _admit_one(self, inst: _Instance, tr: TraceRequest) -> bool | None:
        """Admit ``tr`` now; None when it must wait for memory another request holds."""
        await self._pace()
        st, cache, opts = inst.stats, inst.cache, self.options
        n = len(tr.tokens)
        if n == 0:
            st.completed += 1
            self._progress()
            return True
        kv = inst.kv
        assert kv is not None
        ids = self._page_ids(tr, kv)
        assert ids is not None
        # Positions the cache can serve: n, or under EAGLE the n - 1 bigrams (the request
        # computes all n; its last position, whose bigram needs the next token, stays its own).
        npos = kv.pattern.positions(n)
        key = RadixKey(tr.tokens, extra_key=tr.namespace)
        req = cache.admit(key, rid=tr.rid)
        origin = self._origins.get(id(tr))  # what this request's earlier attempts brought in
        try:
            dev_hit = req.prefix_len
            host_hit = req.host_hit_length
            fetched = await cache.prefetch_request(req)
            h = req.host_hit_length
            if h and h >= self.config.load_back_threshold:  # the load-back's room
                await self._make_room(inst, h)
            loaded = await cache.load_back_request(req)
            if fetched or loaded:
                if origin is None:
                    origin = self._origins[id(tr)] = np.zeros(n, dtype=np.int8)
                # a load from L2 of a page nothing of this request brought in: an L2 hit; the
                # pages this attempt fetched from L3 (after the host hit): L3 hits
                part = origin[dev_hit : dev_hit + loaded]
                part[part == _DEVICE] = _HOST
                origin[dev_hit + host_hit : dev_hit + host_hit + fetched] = _STORAGE
            start = req.prefix_len
            await self._make_room(inst, n - start)
            new = await cache.extend(req, n - start)
            kv.write(new, ids, start)
        except PoolExhaustedError:
            cache.abort_req(req)
            await self._quiesce()
            if inst.running:
                return None
            self._reject(inst, tr)
            return False
        except BaseException:
            if not req.finished:
                cache.abort_req(req)
            raise
        # The request is served its prefix [0, start): from the device, except the pages it
        # (this attempt, or an aborted earlier one whose loads stayed on the device) loaded
        # from L2 or fetched from L3, which are L2 / L3 hits, as an engine would count them.
        served = origin[:start] if origin is not None else np.zeros(0, dtype=np.int8)
        from_l3 = int(np.count_nonzero(served == _STORAGE))
        from_l2 = int(np.count_nonzero(served == _HOST))
        dev_hit = start - from_l2 - from_l3
        verified = 0
        if opts.verify == "all" and start:
            verified = self._verify(kv, tr, ids, req.slots[:start], 0)
        elif opts.verify == "loaded":
            for a, b in _runs(served):
                verified += self._verify(kv, tr, ids, req.slots[a:b], a)
        ps = self.config.page_size
        computed = npos - start
        st.verified_tokens += verified
        st.verified_draft_bytes += verified * kv.draft_bytes_per_token
        st.prompt_tokens += npos
        st.prompt_pages += -(-npos // ps)
        st.device_hit_tokens += dev_hit
        st.host_hit_tokens += from_l2
        st.storage_hit_tokens += from_l3
        st.device_hit_pages += dev_hit // ps
        st.host_hit_pages += from_l2 // ps
        st.storage_hit_pages += from_l3 // ps
        st.computed_tokens += computed
        self._side.append(lambda: self._count_bounds(inst, ids[: npos // ps]))
        pooled = self.pooled
        pooled.prompt_tokens += npos
        pooled.prompt_pages += -(-npos // ps)
        if tr.arrival < self.clock:
            st.queued += 1
        if inst.running:
            st.overlapped += 1
        inst.running += 1
        st.max_in_flight = max(st.max_in_flight, inst.running)
        pooled.max_in_flight = max(pooled.max_in_flight, sum(i.running for i in self.instances))
        flight = _Flight(tr, req, inst)
        self._seq += 1
        done_at = self.clock + opts.service_s(n - start, tr.output_len)
        heapq.heappush(self._finishes, (done_at, self._seq, flight))
        await self._quiesce()
        return True

    async def _make_room(self, inst: _Instance, tokens: int) -> None:
        """Free device slots for ``tokens`` (whole pages) before the cache allocates them, in
        eviction rounds that each start from a settled cache: every copy and storage write
        finished. The cache's own allocation evicts in rounds too, but takes its next round's
        victims while the storage writes of the last round's write-backs run (their host pins
        protect device pages until they finish): its choice depended on how fast storage
        wrote. A shortfall above the evictable tokens evicts nothing (the allocation fails, as
        the cache's own would)."""
        cache = inst.cache
        ps = self.config.page_size
        need = -(-tokens // ps) * ps
        for _ in range(64):
            short = need - cache.device_available
            if short <= 0 or short > cache.evictable_size:
                return
            freed = cache.evict(short)
            copies = cache.in_flight  # write-backs: their victims are freed by a later round
            await self._quiesce()
            if not freed and not copies:
                return

    def _page_ids(self, tr: TraceRequest, kv: ReplayKV | None, *,
                  ahead: bool = False) -> np.ndarray | None:
        """The page ids of ``tr``'s prompt (:meth:`ReplayKV.page_ids`), computed once;
        ``ahead`` (side work): nothing when ``tr`` was admitted already."""
        got = self._ids.get(id(tr))
        if got is None and ahead:
            return None
        if got is None or got[1] is None:
            assert kv is not None
            got = self._ids[id(tr)] = (tr, kv.page_ids(tr.tokens, tr.namespace))
        return got[1]

    def _count_bounds(self, inst: _Instance, whole: np.ndarray) -> None:
        """Count an admitted prompt (its whole pages' prefix hashes) in the bounds; in
        admission order (side work keeps it)."""
        ps = self.config.page_size
        st, pooled = inst.stats, self.pooled
        if inst.optimum is not None:
            inst.optimum.access_pages(whole)
        hit = inst.bound.access_pages(whole)
        st.bound_hit_tokens += hit
        st.bound_hit_pages += hit // ps
        if self.n > 1:  # with one instance, the pooled bound is the instance's
            hit = self.pooled_bound.access_pages(whole)
        pooled.bound_hit_tokens += hit
        pooled.bound_hit_pages += hit // ps

    def _side_work(self, *, force: bool = False) -> None:
        """Run the queued side work, in order: now if a copy is in flight (the work then
        overlaps it), if ``force``, or once 64 items are queued (bounds the memory it holds)."""
        if force or len(self._side) >= 64 or any(i.cache.in_flight for i in self.instances):
            while self._side:
                self._side.popleft()()

    def _settle_optimum(self) -> None:
        """Each instance's offline optimum over the requests it served (computed once, at the
        end: it needs the future)."""
        self._side_work(force=True)
        for inst in self.instances:
            if inst.optimum is not None:
                st = inst.stats
                st.optimum_capacity_pages = inst.optimum.capacity_pages
                st.optimum_hit_pages = inst.optimum.hit_pages()
                st.optimum_hit_tokens = inst.optimum.hit_tokens()

    async def _finish(self, flight: _Flight) -> None:
        await self._pace()
        inst = flight.inst
        inst.cache.cache_finished_req(flight.req)
        inst.running -= 1
        inst.blocked = False
        inst.stats.completed += 1
        await self._quiesce()
        self._progress()

    def _reject(self, inst: _Instance, tr: TraceRequest) -> None:
        st = inst.stats
        n = len(tr.tokens)
        st.rejected += 1
        st.rejected_tokens += n
        st.largest_rejected = max(st.largest_rejected, n)
        self.pooled.rejected += 1
        device = inst.cache.device_pool.num_slots
        _log.info("request_rejected", rid=tr.rid, tokens=n, device_tokens=device)
        if not self._warned_too_long:
            self._warned_too_long = True
            _log.warning("request_longer_than_device_pool", rid=tr.rid, tokens=n,
                         device_tokens=device,
                         fix=f"pass --device-tokens {suggest_capacity(n, self.config.page_size)} "
                             "or more; rejected requests are left out of the hit rates")
        self._progress()

    async def _abort_running(self) -> None:
        """On an error: drop every request admitted and not finished (nothing is cached)."""
        while self._finishes:
            _, _, flight = heapq.heappop(self._finishes)
            if not flight.req.finished:
                flight.inst.cache.abort_req(flight.req)
            flight.inst.running -= 1
        await self._quiesce()

    async def _quiesce(self) -> None:
        """Wait for every copy and storage write started so far, on every instance (side work
        runs first, while they are in flight)."""
        self._side_work()
        for inst in self.instances:
            await inst.cache.flush()
            tier = inst.cache.storage
            if tier is not None:
                await tier.drain()

    def _progress(self) -> None:
        if self.progress is not None:
            self.progress(1)

    def _verify(self, kv: ReplayKV, tr: TraceRequest, ids: np.ndarray, slots: np.ndarray,
                start: int) -> int:
        """Check the KV served in ``slots`` bit for bit; returns how many tokens were checked."""
        n = len(slots)
        bad = kv.verify(slots, ids, start)
        if bad is not None:
            raise KVMismatchError(
                f"request {tr.rid}: {bad.pool} served for token position {start + bad} "
                f"(slot {int(slots[bad])}) differs from the {bad.pool} of its tokens"
            )
        return n

    # ------------------------------------------------------------------ running figures
    @property
    def running_hit_rate(self) -> float:
        """Reused / prompt tokens over every served request so far."""
        prompt = sum(i.stats.prompt_tokens for i in self.instances)
        reused = sum(i.stats.reused_tokens for i in self.instances)
        return reused / prompt if prompt else 0.0


def suggest_capacity(tokens: int, page_size: int) -> str:
    """A device capacity (in ``--device-tokens`` syntax) that holds a ``tokens`` prompt with
    room to spare: the prompt rounded up to pages, plus a quarter, in whole Ki."""
    need = -(-tokens // page_size) * page_size
    ki = -(-(need + need // 4) // 1024)
    return f"{ki}Ki"


def timing_figures(inst: _Instance, setup_s: float, optimum_s: float) -> dict[str, float]:
    """Seconds of a replay's parts: ``setup_s`` (building the caches: allocating and touching
    the pools), ``kv_ids_s`` / ``kv_write_s`` / ``kv_verify_s`` (the replay's own KV work on
    the loop thread: prefix hashes, writing computed KV, checking served KV), ``optimum_s``
    (the offline optimum, at the end) and ``copy_s`` (the copy engine's copies, summed over
    their durations on its worker thread; they overlap the loop thread's work)."""
    copier = inst.cache.copy_engine
    copy_s = sum(st.seconds for st in copier.stats.values()) if copier is not None else 0.0
    kv = inst.kv
    return {
        "setup_s": setup_s,
        "kv_ids_s": kv.ids_s if kv else 0.0,
        "kv_write_s": kv.write_s if kv else 0.0,
        "kv_verify_s": kv.verify_s if kv else 0.0,
        "optimum_s": optimum_s,
        "copy_s": copy_s,
    }


def engine_figures(cache: HierarchicalCache) -> dict[str, float]:
    """Counters of the cache's metrics registry that the report shows."""
    reg = cache.metrics.registry
    # a stored page's bytes: its KV and its sidecars' objects (a draft's KV)
    per_token = cache.shape.bytes_per_token + sum(
        sc.spec.shape.bytes_per_token for sc in cache.sidecars if sc.spec.source == "kv")

    def val(name: str, **labels: str) -> float:
        v = reg.get_sample_value(name, labels or None)
        return float(v) if v is not None else 0.0

    return {
        "evicted_tokens": val("asynccache_evicted_tokens_total"),
        "backup_tokens": val("asynccache_backup_tokens_total"),
        "backup_bytes": val("asynccache_backup_bytes_total"),
        "load_back_tokens": val("asynccache_load_back_tokens_total"),
        "load_back_bytes": val("asynccache_load_back_bytes_total"),
        "dropped_tokens": val("asynccache_dropped_tokens_total", reason="host_pressure")
        + val("asynccache_dropped_tokens_total", reason="backup_failed"),
        "storage_write_tokens": val("asynccache_storage_backup_tokens_total"),
        "prefetched_tokens": val("asynccache_prefetched_tokens_total"),
        "storage_read_bytes": val("asynccache_prefetched_tokens_total") * per_token,
        "storage_write_bytes": val("asynccache_storage_backup_tokens_total") * per_token,
    }


class Replayer:
    """Replays a trace through one :class:`HierarchicalCache` built from ``config``;
    ``progress(1)`` is called for every request served or rejected."""

    def __init__(self, config: CacheConfig, options: ReplayOptions | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.config = config
        self.options = options or ReplayOptions()
        self.stats = ReplayStats()
        self.outcome = RunOutcome()
        self.driver = TraceDriver(config, self.options, 1, lambda tr, i: 0, progress)

    @property
    def cache(self) -> HierarchicalCache:
        return self.driver.instances[0].cache

    @property
    def running_hit_rate(self) -> float:
        return self.driver.running_hit_rate

    async def run(self, trace: Iterable[TraceRequest]) -> ReplayStats:
        try:
            (self.stats,) = await self.driver.run(trace)
        finally:
            self.outcome = self.driver.outcome
        return self.stats
