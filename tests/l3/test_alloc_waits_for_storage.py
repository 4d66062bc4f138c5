"""alloc_device waits for storage writes whose host pins keep device nodes from eviction."""

from __future__ import annotations

import asyncio

import pytest

from asynccache.errors import PoolExhaustedError
from asynccache.l3 import StoragePolicy
from asynccache.storage.faults import FaultKind, FaultRule


async def test_alloc_device_waits_for_pinning_storage_writes(make_cache, make_file_backend,
                                                             kit) -> None:
    cache = await make_cache(device_tokens=64, host_tokens=256, write_policy="write_back")
    slow = [FaultRule(FaultKind.DELAY, ops=frozenset({"write"}), delay_s=0.15)]
    backend = await make_file_backend(cache, slow)
    cache.attach_storage(backend)
    toks = kit.tokens(1, 64)
    for n in (32, 64):  # parent P (tokens 0-32), then its child C (32-64): device only
        req = cache.admit(toks[:n])
        await kit.compute_rest(cache, req)
        cache.cache_finished_req(req)
    assert cache.tree.device_size == 64 and cache.tree.host_size == 0
    # Room for 32: the leaf C is written back to host, demoted, and its (slow) storage write
    # pins it on host, which protects its device-only parent P.
    slots = await asyncio.wait_for(cache.alloc_device(32), kit.TIMEOUT)
    cache.free_device(slots)
    assert cache.storage.writes_pending
    assert (cache.tree.device_size, cache.tree.host_size, cache.tree.protected_size) == (32, 32, 32)
    # All 64 slots: P can only go once C's storage write returned; alloc_device waits for it.
    slots = await asyncio.wait_for(cache.alloc_device(64), kit.TIMEOUT)
    assert len(slots) == 64  # (P's own write-back then started another storage write)
    assert (cache.tree.device_size, cache.tree.host_size) == (0, 64)
    cache.free_device(slots)
    cache.sanity_check()


async def _pending_write(cache, kit, delay_s: float, make_file_backend, policy=None) -> None:
    """Attach a store whose writes take ``delay_s`` and leave one write pending."""
    slow = [FaultRule(FaultKind.DELAY, ops=frozenset({"write"}), delay_s=delay_s)]
    cache.attach_storage(await make_file_backend(cache, slow), policy)
    req = cache.admit(kit.tokens(7, 16))
    await kit.compute_rest(cache, req)
    cache.cache_finished_req(req)
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)  # D->H done: the L3 write is running
    assert cache.storage.writes_pending


async def test_alloc_does_not_wait_for_storage_that_cannot_help(make_cache, make_file_backend,
                                                                 kit) -> None:
    """Every device slot is held by callers: no storage write can free one, so the allocation
    fails at once instead of draining a slow (or dead) store's queue first (issue 23 item 2)."""
    cache = await make_cache(device_tokens=64, host_tokens=256, write_policy="write_through")
    await _pending_write(cache, kit, 1.0, make_file_backend)
    cache.evict(64)
    held = await cache.alloc_device(64)
    with pytest.raises(PoolExhaustedError, match="64 held by requests"):
        await asyncio.wait_for(cache.alloc_device(4), kit.TIMEOUT)
    assert cache.storage.writes_pending  # it did not wait for them
    cache.free_device(held)


async def test_alloc_waits_for_pinning_storage_writes_at_most_its_deadline(
        make_cache, make_file_backend, kit) -> None:
    """Host pins of storage writes are what blocks, but the store is too slow: the allocation
    gives up after ``alloc_wait_s`` with the writes still pending, and succeeds once they land."""
    cache = await make_cache(device_tokens=64, host_tokens=256, write_policy="write_back",
                             alloc_wait_s=0.05)
    slow = [FaultRule(FaultKind.DELAY, ops=frozenset({"write"}), delay_s=1.0)]
    cache.attach_storage(await make_file_backend(cache, slow))
    toks = kit.tokens(1, 64)
    for n in (32, 64):
        req = cache.admit(toks[:n])
        await kit.compute_rest(cache, req)
        cache.cache_finished_req(req)
    slots = await asyncio.wait_for(cache.alloc_device(32), kit.TIMEOUT)
    cache.free_device(slots)
    assert cache.tree.host_pinned_size == 32
    with pytest.raises(PoolExhaustedError, match="storage writes"):
        await asyncio.wait_for(cache.alloc_device(64), kit.TIMEOUT)
    assert cache.storage.writes_pending
    await asyncio.wait_for(cache.storage.drain(), kit.TIMEOUT)
    slots = await asyncio.wait_for(cache.alloc_device(64), kit.TIMEOUT)
    cache.free_device(slots)
    cache.sanity_check()


async def test_failing_store_trips_the_write_breaker(make_cache, make_file_backend, kit) -> None:
    """A store whose writes keep failing stops getting writes for a back-off period (counted),
    instead of a queue that grows with every backup."""
    cache = await make_cache(write_policy="write_through")
    failing = [FaultRule(FaultKind.EIO, ops=frozenset({"write"}))]
    backend = await make_file_backend(cache, failing)
    cache.attach_storage(backend, StoragePolicy(write_failure_threshold=2,
                                                write_backoff_s=60.0))
    for i in range(6):
        req = cache.admit(kit.tokens(100 + i, 8))
        await kit.compute_rest(cache, req)
        cache.cache_finished_req(req)
        await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
        await asyncio.wait_for(cache.storage.drain(), kit.TIMEOUT)
    tried = backend.stats()["injected"]["write.eio"]
    assert tried == 2 * 2  # two failed nodes of 2 pages each, then the breaker opened
    assert kit.counter(cache, "asynccache_storage_backup_skipped_tokens",
                       reason="circuit_open") == 4 * 8
    assert kit.counter(cache, "asynccache_storage_write_circuit_opened") == 1
    cache.sanity_check()
