"""Probe: how long does a scheduler step stall when the object store dies? (prints JSON)

A real SeaweedFS S3 server behind a TCP proxy on 127.0.0.1 (asynccache.testing.netproxy). A
write-through cache with S3 as its L3 serves requests until backups are queued, the proxy then
black-holes every connection (a dead store: packets vanish, nothing answers), and a scheduler
loop keeps admitting requests into a full device: each step allocates with ``extend`` (waiting
for nothing, or for host-pinning storage writes at most ``alloc_wait_s``) and on
``PoolExhaustedError`` frees the oldest running request, as the README's loop does. Reported:
the longest step, the median step, how many steps hit ``PoolExhaustedError``, and the storage
writes still pending, for the dead store and for the same run with the store alive.

Usage: python scripts/probe_dead_store.py [--steps 60] [--alloc-wait-s 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import numpy as np

from asynccache import CacheConfig, HierarchicalCache, PoolExhaustedError, StoragePolicy
from asynccache.storage.s3 import S3Backend
from asynccache.storage.seaweed import LocalSeaweed
from asynccache.testing.netproxy import TcpProxy


async def run(server: LocalSeaweed, dead: bool, steps: int, alloc_wait_s: float) -> dict:
    proxy = TcpProxy(server.endpoint).start()
    config = CacheConfig(page_size=16, num_layers=2, num_heads=2, head_dim=64,
                         device_tokens=4096, host_tokens=16384, write_policy="write_through",
                         device="cpu", alloc_wait_s=alloc_wait_s)
    rng = np.random.default_rng(0)
    try:
        async with HierarchicalCache(config) as cache:
            backend = S3Backend(server.bucket, cache.storage_layout(),
                                prefix=f"probe-{time.monotonic_ns()}",
                                endpoint=proxy.endpoint, access_key_id=server.access_key,
                                secret_access_key=server.secret_key, timeout_s=4.0)
            cache.attach_storage(backend, StoragePolicy(write_concurrency=2))
            running = []
            stalls: list[float] = []
            exhausted = 0
            for step in range(steps):
                if step == 8 and dead:
                    proxy.black_hole()
                tokens = rng.integers(1, 32000, 512).tolist()
                t0 = time.perf_counter()
                req = cache.admit(tokens)
                try:
                    await cache.extend(req, len(tokens) - req.prefix_len)
                    cache.cache_unfinished_req(req)
                    running.append(req)
                except PoolExhaustedError:
                    exhausted += 1
                    cache.abort_req(req)
                    if running:
                        cache.cache_finished_req(running.pop(0))
                stalls.append(time.perf_counter() - t0)
            pending = cache.storage.writes_pending
            for req in running:
                cache.abort_req(req)
            proxy.pass_through()
            await cache.detach_storage()
            await backend.aclose()
    finally:
        proxy.stop()
    ms = np.array(stalls) * 1e3
    return {"store": "dead" if dead else "alive", "steps": steps,
            "max_step_ms": round(float(ms.max()), 1), "median_step_ms": round(float(np.median(ms)), 2),
            "pool_exhausted_steps": exhausted, "writes_pending_at_end": pending}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--alloc-wait-s", type=float, default=0.5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        server = LocalSeaweed(root).start()
        try:
            out = {"probe": "dead_store", "alloc_wait_s": args.alloc_wait_s, "runs": []}
            for dead in (False, True):
                out["runs"].append(await run(server, dead, args.steps, args.alloc_wait_s))
        finally:
            server.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
