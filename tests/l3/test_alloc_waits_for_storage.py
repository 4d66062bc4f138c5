"""alloc_device waits for storage writes whose host pins keep device nodes from eviction."""

from __future__ import annotations

import asyncio

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
