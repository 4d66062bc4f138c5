"""The buffer-only read path, end to end: device -> staging -> storage with one cache, then
storage -> bounce -> device with a fresh cache on the same storage, KV equal bit for bit."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asynccache.l3 import StoragePolicy

POLICY = StoragePolicy(prefetch_threshold=16)


def _seqs(kit):
    s1 = kit.tokens(1, 67)  # 16 pages + an unaligned tail of 3 (never stored)
    s2 = np.concatenate([s1[:32], kit.tokens(2, 40)])  # shares 8 pages with s1, 10 of its own
    s3 = kit.tokens(3, 600)  # 150 pages: two read batches (128 + 22)
    return s1, s2, s3


async def _round_trip(kit, make_cache, open_backend, layout: str) -> None:
    s1, s2, s3 = _seqs(kit)
    a = await make_cache(host_layout=layout)
    a.attach_storage(await open_backend(a), POLICY)
    await kit.write_sequences(a, [s1, s2, s3])
    assert kit.counter(a, "asynccache_storage_backup_tokens") == (16 + 10 + 150) * kit.PS
    assert a.host_size == 0
    await kit.quiesce(a)
    await a.detach_storage()
    await a.aclose()

    b = await make_cache(host_layout=layout)
    b.attach_storage(await open_backend(b), POLICY)
    r1 = await kit.serve(b, s1)
    assert (r1.device, r1.host, r1.fetched, r1.loaded) == (0, 0, 64, 64)
    r2 = await kit.serve(b, s2)
    assert (r2.device, r2.host, r2.fetched, r2.loaded) == (32, 0, 40, 40)
    r3 = await kit.serve(b, s3)
    assert (r3.device, r3.host, r3.fetched, r3.loaded) == (0, 0, 600, 600)
    assert kit.counter(b, "asynccache_prefetched_tokens") == 704
    assert kit.counter(b, "asynccache_load_back_tokens") == 704
    assert kit.outcomes(b) == {"issued": 3, "completed": 3}
    await kit.quiesce(b)
    # Everything B holds came from storage: believed stored, so B wrote nothing back.
    assert kit.counter(b, "asynccache_storage_backup_tokens") == 0
    assert b.host_size == 0 and b.host_pool.allocator.used_size == 0


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_round_trip_file(kit, make_cache, make_file_backend, layout) -> None:
    await _round_trip(kit, make_cache, make_file_backend, layout)


@pytest.mark.seaweedfs
async def test_round_trip_seaweedfs(kit, make_cache, make_s3_backend, seaweed) -> None:
    prefix = kit.new_prefix()

    async def open_backend(cache):
        return make_s3_backend(seaweed, cache, prefix)

    await _round_trip(kit, make_cache, open_backend, "page_first")


async def test_cache_mode_reads_what_buffer_mode_wrote(kit, make_cache, make_file_backend) -> None:
    s1, _, _ = _seqs(kit)
    a = await make_cache()
    a.attach_storage(await make_file_backend(a), POLICY)
    await kit.write_sequences(a, [s1])
    await kit.quiesce(a)
    await a.detach_storage()
    await a.aclose()
    b = await make_cache(strict=False, host_mode="cache")
    b.attach_storage(await make_file_backend(b), POLICY)
    r = await kit.serve(b, s1)
    assert (r.fetched, r.loaded) == (64, 64) and b.host_size == 64
    await b.flush()
    await b.storage.drain()
    await b.detach_storage()


async def test_short_hit_query_invalidates_beliefs_and_heals(kit, make_cache,
                                                            make_file_backend) -> None:
    c = await make_cache()
    backend = await make_file_backend(c)
    c.attach_storage(backend, POLICY)
    p = c.storage
    s = kit.tokens(7, 64)
    keys = kit.page_keys(s)
    await kit.write_sequences(c, [s])
    assert p.existence.covered(keys)
    assert await backend.delete(keys[8:]) == 8  # storage lost the second half
    assert c.evict(10**6) == 64
    r = await kit.serve(c, s)  # the hit query finds 8 pages: beliefs past them are dropped
    assert (r.fetched, r.loaded) == (32, 32)
    assert p.existence.invalidated == 8
    await kit.quiesce(c)
    # The recomputed pages were written again (the loaded ones were believed stored).
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 64 + 32
    assert await backend.exists_prefix(keys) == 16
    assert p.existence.covered(keys)


async def test_clear_storage_clears_beliefs(kit, make_cache, make_file_backend) -> None:
    c = await make_cache()
    backend = await make_file_backend(c)
    c.attach_storage(backend, POLICY)
    s = kit.tokens(8, 32)
    await kit.write_sequences(c, [s])
    assert len(c.storage.existence) == 8
    assert await c.clear_storage() == 8
    assert len(c.storage.existence) == 0
    c.evict(10**6)
    await kit.write_sequences(c, [s])  # not believed stored any more: written again
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 64
    assert await backend.exists_prefix(kit.page_keys(s)) == 8


async def test_clear_storage_in_cache_mode_forgets_known_keys(kit, make_cache,
                                                             make_file_backend) -> None:
    c = await make_cache(strict=False, host_mode="cache")
    backend = await make_file_backend(c)
    c.attach_storage(backend, POLICY)
    s = kit.tokens(9, 32)
    await kit.write_sequences(c, [s])
    assert await c.clear_storage() == 8
    c.evict(10**6)
    c.evict_host(10**6)
    await kit.write_sequences(c, [s])
    assert await backend.exists_prefix(kit.page_keys(s)) == 8
    await c.detach_storage()


async def _stored(kit, make_cache, make_file_backend, seqs) -> None:
    w = await make_cache()
    w.attach_storage(await make_file_backend(w), POLICY)
    await kit.write_sequences(w, seqs)
    await kit.quiesce(w)
    await w.detach_storage()
    await w.aclose()


async def test_fetches_park_for_staging_and_resume_in_fifo_order(kit, make_cache,
                                                                make_file_backend) -> None:
    seqs = [kit.tokens(20 + i, 160) for i in range(3)]  # 40 pages each
    await _stored(kit, make_cache, make_file_backend, seqs)
    c = await make_cache(host_tokens=256)  # reads may hold int(0.9 * 256) = 230 tokens
    c.attach_storage(await make_file_backend(c), POLICY)
    p = c.storage
    assert p.load_limit == 230
    reqs = [c.admit(s) for s in seqs]
    try:
        assert await c.prefetch_request(reqs[0], policy="wait_complete") == 160
        assert p.occupied == 160 and c.host_pool.allocator.used_size == 160
        done: list[int] = []

        async def fetch(i: int) -> int:
            got = await c.prefetch_request(reqs[i], policy="wait_complete")
            done.append(i)
            return got

        t1 = asyncio.ensure_future(fetch(1))
        t2 = asyncio.ensure_future(fetch(2))

        async def both_parked() -> None:
            while len(p.reads._parked) < 2:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(both_parked(), kit.TIMEOUT)
        assert [op.key for op in p.reads._parked] == [reqs[1].key, reqs[2].key]
        assert kit.counter(c, "asynccache_buffer_parked_prefetches") == 2
        # Loading request 0 frees its bounce: request 1 (first in line) gets it, 2 waits.
        assert await c.load_back_request(reqs[0]) == 160
        assert await asyncio.wait_for(t1, kit.TIMEOUT) == 160
        assert done == [1] and len(p.reads._parked) == 1
        assert await c.load_back_request(reqs[1]) == 160
        assert await asyncio.wait_for(t2, kit.TIMEOUT) == 160
        assert await c.load_back_request(reqs[2]) == 160
        for r, s in zip(reqs, seqs, strict=True):
            kit.assert_kv(c, s, r.slots, f"request {r.rid}")
    finally:
        for r in reqs:
            c.abort_req(r)
    kit.assert_at_rest(c)


async def test_unloaded_bounce_is_freed_when_the_request_ends(kit, make_cache,
                                                             make_file_backend) -> None:
    s = kit.tokens(30, 64)
    await _stored(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), POLICY)
    req = c.admit(s)
    assert await c.prefetch_request(req, policy="wait_complete") == 64
    assert c.host_pool.allocator.used_size == 64 and c.storage.staged_requests == 1
    kit.assert_at_rest(c, own_receipts=1)
    c.abort_req(req)
    assert c.host_pool.allocator.used_size == 0 and c.storage.staged_requests == 0
    kit.assert_at_rest(c)


async def test_rate_limit_subtracts_write_staging(kit, make_cache, make_file_backend) -> None:
    x, y = kit.tokens(40, 184), kit.tokens(41, 184)  # 46 pages each
    await _stored(kit, make_cache, make_file_backend, [x, y])
    c = await make_cache(host_tokens=256)
    c.attach_storage(await make_file_backend(c), POLICY)
    p = c.storage
    rx = c.admit(x)
    assert await c.prefetch_request(rx, policy="wait_complete") == 184
    # Writes keep their floor (20 % of 256 = 51 tokens -> 12 pages) while reads hold 184.
    assert p.write_window() == 51
    z = kit.tokens(42, 80)
    slots = c.try_alloc_device(80)
    c.write_kv(slots, kit.expected(c, z))
    c.insert(z, slots)
    assert p.launch_writes() == 48 and p.write_staged == 48
    # Reads may hold 230 minus the 48 staged for writes: 184 >= 182, so the next is declined.
    ry = c.admit(y)
    assert await c.prefetch_request(ry, policy="wait_complete") == 0
    assert kit.outcomes(c) == {"issued": 1, "completed": 1, "declined_rate_limited": 1}
    await p.drain()  # the write staging is freed: now it goes through
    assert await c.load_back_request(rx) == 184
    assert await c.prefetch_request(ry, policy="wait_complete") == 184
    assert await c.load_back_request(ry) == 184
    kit.assert_kv(c, x, rx.slots, "x")
    kit.assert_kv(c, y, ry.slots, "y")
    c.abort_req(rx)
    c.abort_req(ry)
    kit.assert_at_rest(c)
