"""A seeded random workload with sidecars: requests over shared prefixes, device and host
eviction, write-back demotion, retraction, storage prefetch from a second cache; every
served token's KV and sidecar data is checked bit for bit, and the accounting after every
step. The reference model is the data itself: each token's KV and sidecar values are a
function of its prefix (SidecarModel), so whatever path brought a page back, it must match."""

from __future__ import annotations

import asyncio
import random

import pytest

from asynccache.l3 import StoragePolicy

PS = 4


def _prompts(rng: random.Random) -> list[list[int]]:
    docs = [[rng.randrange(50_000) for _ in range(rng.randrange(3, 9) * PS)] for _ in range(4)]
    return [docs[rng.randrange(4)] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 9))]
            for _ in range(40)]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_random_workload_serves_exact_sidecars(make_cache, kit, make_file_backend, seed,
                                                      policy):
    rng = random.Random(seed)
    cache = await make_cache(device_tokens=96, host_tokens=192, write_policy=policy,
                             retraction_backup=True)
    model = kit.SidecarModel(cache)
    if policy == "write_through":
        cache.attach_storage(await make_file_backend(cache), StoragePolicy(prefetch_threshold=PS))
    retracted = []
    for toks in _prompts(rng):
        op = rng.random()
        if op < 0.15:
            await cache.evict_async(rng.randrange(1, 64))
            model.clobber()
        elif op < 0.25:
            cache.evict_host(rng.randrange(1, 64))
        elif op < 0.35 and not retracted:
            req = cache.admit(toks)
            await cache.load_back_request(req)
            new = await cache.extend(req, len(toks) - req.computed)
            model.write(new, toks, len(toks) - len(new), len(toks))
            await cache.retract(req)
            retracted.append((req, toks))
            model.clobber()
            continue
        elif retracted and op < 0.5:
            req, rtoks = retracted.pop()
            await cache.restore(req)
            model.check(rtoks, req.slots, "restored")
            cache.cache_finished_req(req)
        policy_ = "best_effort" if cache.storage is not None and op > 0.8 else None
        await kit.fetch_and_serve(cache, model, toks, policy_)
        await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
        cache.sanity_check()
    for req, _ in retracted:
        cache.abort_req(req)
    reg = cache.metrics.registry
    loaded = reg.get_sample_value("asynccache_load_back_tokens_total") or 0
    backed = reg.get_sample_value("asynccache_backup_tokens_total") or 0
    assert loaded > 0 and backed > 0
    if cache.storage is None:
        return
    # A second cache on the same storage serves every prompt from it, bit-exact.
    await cache.storage.drain()
    other = await make_cache(device_tokens=96, host_tokens=192, write_policy=policy)
    other.attach_storage(await make_file_backend(other), StoragePolicy(prefetch_threshold=PS))
    model2 = kit.SidecarModel(other)
    fetched = 0
    for toks in _prompts(random.Random(seed))[:10]:
        fetched += (await kit.fetch_and_serve(other, model2, toks))[1]
        other.evict(10**6)
        other.evict_host(10**6)
    assert fetched > 0
