"""The replay driver: requests of a trace through the real engine on one event loop.

Each request matches its prompt, waits for load-backs of its prefix, loads its host hit back
(L2 -> L1), "computes" the missed tokens (allocates slots and writes their deterministic KV),
verifies the KV it was served from L2, caches its prompt and finishes. Requests arrive on the
trace's clock (scaled) or as fast as possible, many in flight at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from asynccache.cache import HierarchicalCache
from asynccache.config import CacheConfig
from asynccache.errors import AsyncCacheError, PoolExhaustedError
from asynccache.l3 import StoragePolicy
from asynccache.logs import get_logger
from asynccache.replay.formats import TraceRequest
from asynccache.replay.kvgen import expected_kv, mismatched_tokens, same_bits
from asynccache.tree import RadixKey, RadixTree

_log = get_logger("replay")


class KVMismatchError(AsyncCacheError):
    """A request was served KV that differs from what its tokens produce."""


@dataclass
class ReplayStats:
    requests: int = 0
    completed: int = 0
    rejected: int = 0  # did not fit in device memory even alone
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    computed_tokens: int = 0
    bound_hit_tokens: int = 0  # infinite-cache upper bound
    prompt_pages: int = 0
    device_hit_pages: int = 0
    host_hit_pages: int = 0
    storage_hit_pages: int = 0
    bound_hit_pages: int = 0
    verified_tokens: int = 0
    max_in_flight: int = 0
    wall_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def reused_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens


@dataclass(frozen=True)
class ReplayOptions:
    time_scale: float = 0.0  # 0: as fast as possible; 1: real time; 0.1: 10x faster
    max_in_flight: int = 32
    verify: str = "loaded"  # "loaded" (KV served from L2/L3), "all" (also device hits), "none"
    limit: int | None = None
    storage_url: str | None = None  # file:///dir or s3://bucket/prefix?endpoint=...
    storage_policy: StoragePolicy | None = None


class Replayer:
    """Replays a trace through a :class:`HierarchicalCache` built from ``config``."""

    def __init__(self, config: CacheConfig, options: ReplayOptions | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.config = config
        self.options = options or ReplayOptions()
        self.stats = ReplayStats()
        self._progress = progress
        self._bound = RadixTree(page_size=config.page_size)  # never evicts: the upper bound
        self._bound_slots = 0
        self._in_flight = 0
        self._waiting = 0
        self._freed = asyncio.Event()

    async def run(self, trace: Iterable[TraceRequest]) -> ReplayStats:
        opts = self.options
        st = self.stats
        t0 = time.perf_counter()
        backend = None
        async with HierarchicalCache(self.config) as cache:
            self.cache = cache
            if opts.storage_url:
                from asynccache.storage.factory import open_backend

                backend = await open_backend(opts.storage_url, cache.storage_layout())
                cache.attach_storage(backend, opts.storage_policy)
            loop = asyncio.get_running_loop()
            start = loop.time()
            sem = asyncio.Semaphore(opts.max_in_flight)
            tasks: set[asyncio.Task[None]] = set()
            failure: list[BaseException] = []
            for i, req in enumerate(trace):
                if opts.limit is not None and i >= opts.limit:
                    break
                if failure:
                    break
                if opts.time_scale > 0:
                    delay = start + req.arrival * opts.time_scale - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                await sem.acquire()
                self._account_bound(req)
                task = loop.create_task(self._one(cache, req))
                tasks.add(task)

                def _done(t: asyncio.Task[None]) -> None:
                    tasks.discard(t)
                    sem.release()
                    if not t.cancelled() and t.exception() is not None:
                        failure.append(t.exception())  # type: ignore[arg-type]

                task.add_done_callback(_done)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            if failure:
                raise failure[0]
            await cache.flush()
            if cache.storage is not None:
                await cache.storage.drain()
            cache.sanity_check()
            st.extra = self._engine_figures(cache)
            await cache.detach_storage()
        if backend is not None:
            await backend.aclose()
        st.wall_s = time.perf_counter() - t0
        return st

    def _account_bound(self, req: TraceRequest) -> None:
        """Infinite-cache bound: every page-aligned prefix seen before is a hit."""
        ps = self.config.page_size
        key = RadixKey(req.tokens, extra_key=req.namespace)
        hit = self._bound.match_prefix(key).device_prefix_len
        n = len(key)
        self._bound.insert(key, np.arange(self._bound_slots, self._bound_slots + n), prev_prefix_len=0)
        self._bound_slots += n
        st = self.stats
        st.requests += 1
        st.prompt_tokens += n
        st.prompt_pages += n // ps
        st.bound_hit_tokens += hit
        st.bound_hit_pages += hit // ps

    async def _one(self, cache: HierarchicalCache, tr: TraceRequest) -> None:
        st = self.stats
        self._in_flight += 1
        st.max_in_flight = max(st.max_in_flight, self._in_flight)
        try:
            key = RadixKey(tr.tokens, extra_key=tr.namespace)
            n = len(key)
            if n == 0:
                st.completed += 1
                return
            while True:
                req = cache.admit(key, rid=tr.rid)
                try:
                    dev_hit = req.prefix_len
                    fetched = await cache.prefetch_request(req)
                    loaded = await cache.load_back_request(req)
                    if self.options.verify == "all" and dev_hit:
                        self._verify(cache, tr, req.slots[:dev_hit], 0)
                    if loaded and self.options.verify != "none":
                        self._verify(cache, tr, req.slots[dev_hit : dev_hit + loaded], dev_hit)
                    start = req.prefix_len
                    new = await cache.extend(req, n - start)
                    pos = np.arange(start, n)
                    cache.write_kv(new, expected_kv(cache.shape, tr.tokens[start:], pos))
                except PoolExhaustedError:
                    cache.abort_req(req)
                    if self._in_flight - self._waiting > 1:
                        # Others hold the memory; retry once one of them finishes.
                        self._freed.clear()
                        self._waiting += 1
                        try:
                            await self._freed.wait()
                        finally:
                            self._waiting -= 1
                        continue
                    st.rejected += 1
                    _log.info("request_rejected", rid=tr.rid, tokens=n,
                              device_tokens=cache.device_pool.num_slots)
                    return
                except BaseException:
                    if not req.finished:
                        cache.abort_req(req)
                    raise
                break
            cache.cache_finished_req(req)
            ps = self.config.page_size
            from_l3 = min(fetched, loaded)  # fetched pages that made it onto the device
            st.device_hit_tokens += dev_hit
            st.host_hit_tokens += loaded - from_l3
            st.storage_hit_tokens += from_l3
            st.device_hit_pages += dev_hit // ps
            st.host_hit_pages += (loaded - from_l3) // ps
            st.storage_hit_pages += from_l3 // ps
            st.computed_tokens += n - dev_hit - loaded
            st.completed += 1
            if self._progress is not None:
                self._progress(1)
        finally:
            self._in_flight -= 1
            self._freed.set()

    def _verify(self, cache: HierarchicalCache, tr: TraceRequest, slots: np.ndarray,
                start: int) -> None:
        n = len(slots)
        got = cache.read_kv(slots)
        want = expected_kv(cache.shape, tr.tokens[start : start + n], np.arange(start, start + n))
        if not same_bits(got, want):
            bad = int(mismatched_tokens(got, want)[0])
            raise KVMismatchError(
                f"request {tr.rid}: KV served for token position {start + bad} "
                f"(slot {int(slots[bad])}) differs from the KV of its tokens"
            )
        self.stats.verified_tokens += n

    @staticmethod
    def _engine_figures(cache: HierarchicalCache) -> dict[str, float]:
        reg = cache.metrics.registry

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
            "storage_read_bytes": val("asynccache_prefetched_tokens_total")
            * cache.shape.bytes_per_token,
            "storage_write_bytes": val("asynccache_storage_backup_tokens_total")
            * cache.shape.bytes_per_token,
        }
