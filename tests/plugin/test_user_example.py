"""Integration tests of a scheduler on asynccache, written the way an engine team would.

Nothing here is imported from the project's test suite: the fixtures come from the asynccache
pytest plugin (active once asynccache is installed), the helpers from ``asynccache.testing``.
Each test gets real caches on small CPU pools; at teardown the plugin fails the test if a
request left a lock, a slot, a copy or a task behind.
"""

import asyncio

import pytest

from asynccache import HierarchicalCache
from asynccache.l3 import StoragePolicy
from asynccache.storage import FileBackend, S3Backend, StorageBackend
from asynccache.testing import (
    CacheFactory,
    CancelOutcome,
    KVFactory,
    Served,
    assert_quiescent,
    faults,
    sweep_cancellations,
)

# Storage: prefetch anything, and wait for the whole prefetch (deterministic hit counts).
POLICY = StoragePolicy(prefetch_threshold=0, prefetch_policy="wait_complete")


async def test_concurrent_requests_share_a_prefix(
    asynccache_cache: HierarchicalCache, asynccache_kv: KVFactory
) -> None:
    system_prompt = asynccache_kv.prompt(32)
    await asynccache_kv.serve(asynccache_cache, system_prompt)

    prompts = [asynccache_kv.prompt(n, prefix=system_prompt) for n in (5, 9, 14)]
    served = await asyncio.gather(*(asynccache_kv.serve(asynccache_cache, p) for p in prompts))

    # Every request got the shared prefix from the cache; serve() checked its KV bit for bit.
    assert [s.device_hit for s in served] == [32, 32, 32]


async def restart_and_read_back(storage: StorageBackend, cache: HierarchicalCache,
                                cache_factory: CacheFactory, kv: KVFactory) -> Served:
    prompt = kv.prompt(64)
    cache.attach_storage(storage, POLICY)
    await kv.serve(cache, prompt)  # backed up to host memory, then to storage
    await cache_factory.close(cache)  # the engine stops (checked for leaks first)

    restarted = await cache_factory()  # same config: same storage layout
    restarted.attach_storage(storage, POLICY)
    return await kv.serve(restarted, prompt, prefetch=True)


@pytest.mark.asynccache_config(write_policy="write_through")
async def test_a_restarted_engine_reads_prefixes_back_from_files(
    asynccache_cache: HierarchicalCache, asynccache_cache_factory: CacheFactory,
    asynccache_file_storage: FileBackend, asynccache_kv: KVFactory,
) -> None:
    served = await restart_and_read_back(asynccache_file_storage, asynccache_cache,
                                         asynccache_cache_factory, asynccache_kv)
    assert (served.fetched, served.loaded, served.computed) == (64, 64, 0)


@pytest.mark.asynccache_config(write_policy="write_through")
async def test_a_restarted_engine_reads_prefixes_back_from_s3(
    asynccache_cache: HierarchicalCache, asynccache_cache_factory: CacheFactory,
    asynccache_s3_storage: S3Backend, asynccache_kv: KVFactory,
) -> None:
    served = await restart_and_read_back(asynccache_s3_storage, asynccache_cache,
                                         asynccache_cache_factory, asynccache_kv)
    assert (served.fetched, served.loaded, served.computed) == (64, 64, 0)


@pytest.mark.asynccache_config(write_policy="write_through")
async def test_corrupt_storage_is_a_miss_never_wrong_kv(
    asynccache_cache: HierarchicalCache, asynccache_cache_factory: CacheFactory,
    asynccache_file_storage: FileBackend, asynccache_kv: KVFactory,
) -> None:
    prompt = asynccache_kv.prompt(48)
    asynccache_cache.attach_storage(asynccache_file_storage, POLICY)
    await asynccache_kv.serve(asynccache_cache, prompt)
    await asynccache_cache_factory.close(asynccache_cache)

    # Every page read from storage gets a flipped byte: the checksums must catch all of them.
    corrupting = faults(asynccache_file_storage, "flip_bytes", ops={"read"})
    restarted = await asynccache_cache_factory()
    restarted.attach_storage(corrupting, POLICY)
    served = await asynccache_kv.serve(restarted, prompt, prefetch=True)

    assert corrupting.injected_total() > 0
    assert (served.fetched, served.computed) == (0, 48)  # recomputed; its KV checked


@pytest.mark.asynccache_config(write_policy="write_through")
async def test_cancelling_a_request_at_any_await_leaks_nothing(
    asynccache_cache: HierarchicalCache, asynccache_kv: KVFactory
) -> None:
    cache = asynccache_cache
    prompt = asynccache_kv.prompt(40)
    await asynccache_kv.serve(cache, prompt)
    await cache.flush()
    cache.evict(cache.evictable_size)  # now on host only: serving it awaits a load-back

    async def after_each_run(outcome: CancelOutcome[Served]) -> None:
        await assert_quiescent(cache)  # no lock, slot, copy or prefetch left behind
        await cache.flush()
        cache.evict(cache.evictable_size)  # back to host only for the next run

    outcomes = await sweep_cancellations(lambda: asynccache_kv.serve(cache, prompt),
                                         check=after_each_run)

    assert sum(o.cancelled for o in outcomes) >= 2  # cancelled at each await, then...
    assert outcomes[-1].completed  # ...a run that completed (its KV checked bit for bit)
