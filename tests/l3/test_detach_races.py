"""Detach and close are safe at any await, in any order, with requests in flight (issue 23
item 4)."""

from __future__ import annotations

import asyncio

from asynccache.l3 import StoragePolicy
from asynccache.storage.faults import FaultKind, FaultRule


async def _host_only(cache, kit, toks) -> None:
    """Cache ``toks`` and demote them to host only (write-through backs them up)."""
    req = cache.admit(toks)
    await kit.compute_rest(cache, req)
    cache.cache_finished_req(req)
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    cache.evict(len(toks))
    assert cache.match_prefix(toks).host_hit_length == len(toks)


async def test_detach_while_a_request_waits_for_another_load(make_cache, make_file_backend,
                                                             kit) -> None:
    cache = await make_cache()
    cache.attach_storage(await make_file_backend(cache), StoragePolicy(prefetch_threshold=4))
    toks = kit.tokens(3, 32)
    await _host_only(cache, kit, toks)
    a = cache.admit(toks)
    lb = cache.begin_load_back(cache.match_prefix(toks))  # A's load is in flight...
    assert lb is not None
    b = cache.admit([*toks, *kit.tokens(4, 32)])
    assert b.pending_loads  # ...and B must wait for it inside prefetch_request
    waiting = asyncio.get_running_loop().create_task(cache.prefetch_request(b))
    await asyncio.sleep(0)
    assert await asyncio.wait_for(cache.detach_storage(), kit.TIMEOUT)
    assert await asyncio.wait_for(waiting, kit.TIMEOUT) == 0  # no storage any more: nothing
    await asyncio.wait_for(lb.wait(), kit.TIMEOUT)
    cache.release_load(lb)
    for req in (a, b):
        cache.abort_req(req)
    cache.sanity_check()


async def test_cancelled_detach_still_finishes_before_close(make_cache, make_file_backend,
                                                            kit) -> None:
    """A cancelled detach_storage() keeps detaching in the background; aclose() waits for it, so
    the tier's writes land (and release their host pins) before the tree is reset."""
    cache = await make_cache(write_policy="write_through")
    slow = [FaultRule(FaultKind.DELAY, ops=frozenset({"write"}), delay_s=0.3)]
    backend = await make_file_backend(cache, slow)
    cache.attach_storage(backend)
    req = cache.admit(kit.tokens(5, 16))
    await kit.compute_rest(cache, req)
    cache.cache_finished_req(req)
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    assert cache.storage.writes_pending
    detach = asyncio.get_running_loop().create_task(cache.detach_storage())
    await asyncio.sleep(0.01)
    detach.cancel()
    await asyncio.gather(detach, return_exceptions=True)
    assert cache.storage is None
    await asyncio.wait_for(cache.aclose(), kit.TIMEOUT)
    assert backend.stats()["objects"] == 4  # the 4 pages landed before close returned
    assert cache.device_pool.allocator.used_size == 0
    assert cache.host_pool.allocator.used_size == 0


async def test_close_with_a_request_in_prefetch(make_cache, make_file_backend, kit) -> None:
    """aclose() while a request waits for its prefetch: the request ends cleanly (the cache is
    closed), nothing leaks."""
    cache = await make_cache()
    slow = [FaultRule(FaultKind.DELAY, ops=frozenset({"read"}), delay_s=0.2)]
    writer = await make_cache()
    writer.attach_storage(await make_file_backend(writer), StoragePolicy(prefetch_threshold=4))
    toks = kit.tokens(6, 32)
    await kit.write_sequences(writer, [toks])
    cache.attach_storage(await make_file_backend(cache, slow), StoragePolicy(prefetch_threshold=4))
    req = cache.admit(toks)
    task = asyncio.get_running_loop().create_task(
        cache.prefetch_request(req, policy="wait_complete"))
    await asyncio.sleep(0.02)
    await asyncio.wait_for(cache.aclose(), kit.TIMEOUT)
    await asyncio.gather(task, return_exceptions=True)
    assert cache.device_pool.allocator.used_size == 0
    assert cache.host_pool.allocator.used_size == 0
