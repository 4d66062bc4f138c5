"""Replay a trace across N cache instances with one shared L3 (``asynccache replay --instances``).

Each instance is a real :class:`~asynccache.HierarchicalCache` with its own L1/L2 (the
capacities of the config); all of them run on one event loop (in-process is exact for hit
rates: the instances share nothing but the L3 backend, as separate servers would). Requests
are routed round-robin or by a hash of their first ``route_tokens`` tokens (a prefix-affinity
router). With a shared L3 every instance backs its pages up to the one backend and prefetches
the pages other instances wrote.

The report gives each instance's *local* hit rate (L1 + L2 of that instance), the *global* hit
rate (local + shared L3), and — from a second replay of the same trace and routing without the
shared L3 — the *isolated* hit rate and the pooled-vs-isolated ratio (Mooncake's comparison of
a pooled KV store with per-node caches).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from asynccache.cache import HierarchicalCache
from asynccache.config import CacheConfig
from asynccache.errors import ConfigError
from asynccache.replay.driver import Replayer, ReplayOptions, ReplayStats
from asynccache.replay.formats import TraceRequest

ROUTES = ("round_robin", "prefix_hash")


@dataclass
class ClusterStats:
    instances: list[ReplayStats]
    bound: ReplayStats  # the pooled infinite-cache bound over every request
    route: str
    wall_s: float = 0.0
    storage: dict[str, Any] = field(default_factory=dict)


def route_of(req: TraceRequest, index: int, instances: int, route: str, route_tokens: int) -> int:
    """The instance that serves ``req`` (the ``index``-th request of the trace)."""
    if route == "round_robin":
        return index % instances
    head = req.tokens[:route_tokens].tobytes() + (req.namespace or "").encode()
    return int.from_bytes(hashlib.blake2b(head, digest_size=8).digest(), "little") % instances


class ClusterReplayer:
    """Replays a trace across ``instances`` caches built from ``config``; ``options.storage_url``
    (if any) is the L3 they share."""

    def __init__(self, config: CacheConfig, options: ReplayOptions | None = None, *,
                 instances: int = 2, route: str = "round_robin", route_tokens: int = 1024,
                 drain_each: bool = False,
                 progress: Callable[[int], None] | None = None) -> None:
        """``drain_each``: finish each request and wait for every instance's copies and
        storage writes before the next one (a deterministic, slower replay: tests, debugging
        a routing); otherwise requests overlap as in :class:`Replayer`."""
        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
            raise ConfigError(f"instances must be an int >= 1, got {instances!r}")
        if route not in ROUTES:
            raise ConfigError(f"unknown route {route!r}; choose one of {list(ROUTES)}")
        if isinstance(route_tokens, bool) or not isinstance(route_tokens, int) or route_tokens < 1:
            raise ConfigError(f"route_tokens must be an int >= 1, got {route_tokens!r}")
        self.config = config
        self.options = options or ReplayOptions()
        self.instances = instances
        self.route = route
        self.route_tokens = route_tokens
        self.drain_each = drain_each
        self._progress = progress

    async def run(self, trace: Iterable[TraceRequest]) -> ClusterStats:
        opts = self.options
        t0 = time.perf_counter()
        reps = [Replayer(self.config, opts, self._progress) for _ in range(self.instances)]
        pooled = Replayer(self.config, opts)  # only its infinite-cache bound is used
        caches = [HierarchicalCache(self.config) for _ in reps]
        backend = None
        failure: list[BaseException] = []
        try:
            for cache in caches:
                await cache.start()
            if opts.storage_url:
                from asynccache.storage.factory import open_backend

                backend = await open_backend(opts.storage_url, caches[0].storage_layout())
                for cache in caches:
                    cache.attach_storage(backend, opts.storage_policy)
            for rep, cache in zip(reps, caches, strict=True):
                rep.cache = cache
            sems = [asyncio.Semaphore(opts.max_in_flight) for _ in reps]
            tasks: set[asyncio.Task[None]] = set()
            loop = asyncio.get_running_loop()
            start = loop.time()
            for i, req in enumerate(trace):
                if (opts.limit is not None and i >= opts.limit) or failure:
                    break
                if opts.time_scale > 0:
                    delay = start + req.arrival * opts.time_scale - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                k = route_of(req, i, self.instances, self.route, self.route_tokens)
                await sems[k].acquire()
                pooled._account_bound(req)
                reps[k]._account_bound(req)
                task = loop.create_task(reps[k]._one(caches[k], req))
                tasks.add(task)

                def _done(t: asyncio.Task[None], sem: asyncio.Semaphore = sems[k]) -> None:
                    tasks.discard(t)
                    sem.release()
                    if not t.cancelled() and t.exception() is not None:
                        failure.append(t.exception())  # type: ignore[arg-type]

                task.add_done_callback(_done)
                if self.drain_each:
                    await asyncio.gather(*tasks, return_exceptions=True)
                    for cache in caches:
                        await cache.flush()
                        if cache.storage is not None:
                            await cache.storage.drain()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            if failure:
                raise failure[0]
            for rep, cache in zip(reps, caches, strict=True):
                await cache.flush()
                if cache.storage is not None:
                    await cache.storage.drain()
                cache.sanity_check()
                rep.stats.extra = Replayer._engine_figures(cache)
            storage = backend.stats() if backend is not None and hasattr(backend, "stats") else {}
        finally:
            for cache in caches:
                if cache._state == "running":
                    await cache.detach_storage()
                await cache.aclose()
            if backend is not None:
                await backend.aclose()
        wall = time.perf_counter() - t0
        for rep in reps:
            rep.stats.wall_s = wall
        return ClusterStats([r.stats for r in reps], pooled.stats, self.route, wall,
                            storage if isinstance(storage, dict) else {})


def _rate(a: float, b: float) -> float:
    return round(a / b, 4) if b else 0.0


def cluster_report(pooled: ClusterStats, isolated: ClusterStats | None, config: CacheConfig,
                   source: str, storage: str | None) -> dict[str, Any]:
    """Per-instance local / global hit rates, totals, and pooled vs isolated."""
    per = []
    tot = dict.fromkeys(("prompt", "local", "l3", "requests", "bound"), 0)
    for i, s in enumerate(pooled.instances):
        local = s.device_hit_tokens + s.host_hit_tokens
        per.append({
            "instance": i,
            "requests": s.completed,
            "prompt_tokens": s.prompt_tokens,
            "local_hit_rate": _rate(local, s.prompt_tokens),
            "global_hit_rate": _rate(local + s.storage_hit_tokens, s.prompt_tokens),
            "local_infinite_bound": _rate(s.bound_hit_tokens, s.prompt_tokens),
        })
        tot["prompt"] += s.prompt_tokens
        tot["local"] += local
        tot["l3"] += s.storage_hit_tokens
        tot["requests"] += s.completed
        tot["bound"] += s.bound_hit_tokens
    out: dict[str, Any] = {
        "trace": source,
        "instances": len(pooled.instances),
        "route": pooled.route,
        "config": {
            "page_size": config.page_size,
            "device_tokens_per_instance": config.device_tokens,
            "host_tokens_per_instance": config.host_tokens or 0,
            "shared_storage": storage,
            "write_policy": config.write_policy,
        },
        "requests": tot["requests"],
        "prompt_tokens": tot["prompt"],
        "local_hit_rate": _rate(tot["local"], tot["prompt"]),
        "storage_hit_rate": _rate(tot["l3"], tot["prompt"]),
        "global_hit_rate": _rate(tot["local"] + tot["l3"], tot["prompt"]),
        "per_node_infinite_bound": _rate(tot["bound"], tot["prompt"]),
        "pooled_infinite_bound": _rate(pooled.bound.bound_hit_tokens, pooled.bound.prompt_tokens),
        "per_instance": per,
        "wall_s": round(pooled.wall_s, 3),
    }
    if isolated is not None:
        iso_prompt = sum(s.prompt_tokens for s in isolated.instances)
        iso_hit = sum(s.reused_tokens for s in isolated.instances)
        out["isolated_hit_rate"] = _rate(iso_hit, iso_prompt)
        out["pooled_vs_isolated"] = _rate(out["global_hit_rate"], out["isolated_hit_rate"])
        out["isolated_wall_s"] = round(isolated.wall_s, 3)
    return out


def format_cluster(report: dict[str, Any]) -> str:
    rows = [
        ("trace", report["trace"]),
        ("instances / route", f"{report['instances']} / {report['route']}"),
        ("requests", f"{report['requests']}"),
        ("prompt tokens", f"{report['prompt_tokens']:,}"),
        ("local hit rate (L1+L2)", f"{report['local_hit_rate']:.2%}"),
        ("shared L3 hit rate", f"{report['storage_hit_rate']:.2%}"
         if report.get("shared_storage") else "- (no --storage: the instances share nothing)"),
        ("global hit rate", f"{report['global_hit_rate']:.2%}"),
    ]
    if "isolated_hit_rate" in report:
        rows.append(("isolated hit rate (no shared L3)", f"{report['isolated_hit_rate']:.2%}"))
        rows.append(("pooled / isolated", f"x{report['pooled_vs_isolated']:.2f}"))
    rows.append(("infinite bound per node / pooled",
                 f"{report['per_node_infinite_bound']:.2%} / {report['pooled_infinite_bound']:.2%}"))
    for p in report["per_instance"]:
        rows.append((f"instance {p['instance']} local / global",
                     f"{p['local_hit_rate']:.2%} / {p['global_hit_rate']:.2%} "
                     f"({p['requests']} requests)"))
    rows.append(("wall time", f"{report['wall_s']} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
