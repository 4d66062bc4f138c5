"""The reference scenarios of behavior.md §1.13 / §1.17 / §1.19 on CPU pools with page size 2."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asynccache.tree import AllBlocksCleared, BlockRemoved, BlockStored, Medium

PAGE = 2


def stored(tokens, medium, parent=None, *, first=0):
    """The BlockStored event of ``tokens[first:]`` (hashes chained from the start of tokens)."""
    from_hashes = _hashes(tokens)
    return BlockStored(
        block_hashes=from_hashes[first // PAGE:],
        parent_block_hash=parent,
        token_ids=list(tokens[first:]),
        block_size=PAGE,
        medium=medium,
    )


def _hashes(tokens):
    import hashlib
    import struct

    out, prev = [], b""
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        prev = hashlib.sha256(prev + struct.pack(f"<{PAGE}I", *tokens[i: i + PAGE])).digest()
        out.append(int.from_bytes(prev[:8], "big", signed=True))
    return out


async def _scenario_cache(make_cache, policy, **kw):
    opts = {"page_size": PAGE, "write_policy": policy, "device_tokens": 32, "host_tokens": 64,
            "enable_kv_events": True, "load_back_threshold": 1, **kw}
    return await make_cache(**opts)


def _insert(cache, tokens):
    """Insert ``tokens`` with freshly allocated slots (duplicates come back to the pool)."""
    slots = cache.try_alloc_device(len(tokens))
    assert slots is not None
    return cache.insert(tokens, slots)


async def test_hash_helper_matches_reference_s11(make_cache, kit):
    """§1.19 S11: [1,2,3,4] is one event with 2 hashes and a null parent; [1,2,5,6] stores
    [5,6] with parent = hash([1,2]); evicting all removes exactly those 3 hashes."""
    cache = await _scenario_cache(make_cache, "write_through_selective", host_tokens=None)
    assert _hashes([1, 2, 3, 4]) == kit.event_hashes([1, 2, 3, 4], PAGE)
    _insert(cache, [1, 2, 3, 4])
    assert cache.take_events() == [stored([1, 2, 3, 4], Medium.GPU)]
    _insert(cache, [1, 2, 5, 6])
    h12 = _hashes([1, 2])[0]
    assert cache.take_events() == [stored([1, 2, 5, 6], Medium.GPU, h12, first=2)]
    assert cache.evict(100) == 6
    (ev,) = cache.take_events()
    assert isinstance(ev, BlockRemoved) and ev.medium is Medium.GPU
    assert sorted(ev.block_hashes) == sorted(_hashes([1, 2, 3, 4]) + _hashes([1, 2, 5, 6])[1:])
    await kit.quiesce_and_check(cache)


async def test_write_through(make_cache, kit):
    cache = await _scenario_cache(make_cache, "write_through")
    res = _insert(cache, [1, 2, 3, 4])
    assert len(res.backups) == 1 and cache.in_flight == 1  # launched at once
    # Device-locked until the ack: it cannot be evicted half-written.
    assert cache.protected_size == 4 and cache.evictable_size == 0
    assert cache.evict(100) == 0
    res = _insert(cache, [1, 2, 3, 4, 5, 6])
    assert [b.num_tokens for b in res.backups] == [2]
    assert cache.take_events() == [stored([1, 2, 3, 4, 5, 6], Medium.GPU)]
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    assert cache.take_events() == [stored([1, 2, 3, 4, 5, 6], Medium.CPU_PINNED)]
    assert cache.host_size == 6 and cache.protected_size == 0
    assert await cache.evict_async(100) == 6
    h = _hashes([1, 2, 3, 4, 5, 6])
    # leaves first: [5,6], then its parent [1..4]; consecutive removals coalesce
    assert cache.take_events() == [BlockRemoved([h[2], h[0], h[1]], Medium.GPU)]
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.device_prefix_len, m.host_hit_length) == (0, 6)
    await kit.quiesce_and_check(cache)


async def test_write_through_selective(make_cache, kit):
    cache = await _scenario_cache(make_cache, "write_through_selective")
    assert _insert(cache, [1, 2, 3, 4]).backups == [] and cache.in_flight == 0
    res = _insert(cache, [1, 2, 3, 4])  # second hit
    assert len(res.backups) == 1 and cache.in_flight == 1
    res = _insert(cache, [1, 2, 3, 4, 5, 6])  # [5,6] is new: hit once, not backed up
    assert [b.node_id for b in res.backups] == []
    await cache.flush()
    events = cache.take_events()
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium is Medium.CPU_PINNED]
    assert cpu == [stored([1, 2, 3, 4], Medium.CPU_PINNED)]
    assert cache.host_size == 4
    assert await cache.evict_async(100) == 6
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.device_prefix_len, m.host_hit_length) == (0, 4)
    await kit.quiesce_and_check(cache)


async def test_write_through_selective_removal_events(make_cache, kit):
    cache = await _scenario_cache(make_cache, "write_through_selective")
    _insert(cache, [1, 2, 3, 4])
    _insert(cache, [1, 2, 3, 4])
    _insert(cache, [1, 2, 3, 4, 5, 6])
    await cache.flush()
    cache.take_events()
    await cache.evict_async(100)
    (ev,) = cache.take_events()
    assert isinstance(ev, BlockRemoved) and ev.medium is Medium.GPU
    assert sorted(ev.block_hashes) == sorted(_hashes([1, 2, 3, 4, 5, 6]))
    await kit.quiesce_and_check(cache)


async def test_write_back(make_cache, kit):
    cache = await _scenario_cache(make_cache, "write_back")
    model = kit.KVModel.of(cache)
    tokens = [1, 2, 3, 4, 5, 6]
    res = _insert(cache, tokens)
    assert res.backups == [] and cache.in_flight == 0  # no write at insert time
    # give the inserted slots real KV so the load-back can be checked
    m = cache.match_prefix(tokens)
    cache.write_kv(m.device_indices, model.expected(tokens))
    assert cache.take_events() == [stored(tokens, Medium.GPU)]
    assert await asyncio.wait_for(cache.evict_async(100), kit.TIMEOUT) == 6
    assert cache.take_events() == [
        stored(tokens, Medium.CPU_PINNED),
        BlockRemoved(_hashes(tokens), Medium.GPU),
    ]
    assert cache.host_size == 6 and cache.tree.device_size == 0
    m = cache.match_prefix(tokens)
    assert (m.device_prefix_len, m.host_hit_length) == (0, 6)
    lb = await asyncio.wait_for(cache.load_back(m), kit.TIMEOUT)
    assert lb is not None and lb.num_tokens == 6
    model.check(cache, tokens, lb.device_indices)
    cache.release_load(lb)
    assert cache.take_events() == [stored(tokens, Medium.GPU)]
    assert cache.host_size == 6  # host copy kept as a duplicate
    assert cache.evict_host(100) == 6  # duplicate reclaim
    assert cache.take_events() == [BlockRemoved(_hashes(tokens), Medium.CPU_PINNED)]
    assert cache.host_size == 0 and cache.host_pool.allocator.used_size == 0
    m = cache.match_prefix(tokens)
    assert (m.device_prefix_len, m.host_hit_length) == (6, 0)
    model.check(cache, tokens, m.device_indices)
    await kit.quiesce_and_check(cache)


@pytest.mark.parametrize(("threshold", "loaded"), [(10, False), (7, False), (6, True), (4, True)])
async def test_load_back_threshold(make_cache, kit, threshold, loaded):
    """§1.13: a 6-token host hit is not loaded with the threshold at 10, but is at 4."""
    cache = await _scenario_cache(make_cache, "write_through", load_back_threshold=threshold)
    model = kit.KVModel.of(cache)
    tokens = [1, 2, 3, 4, 5, 6]
    await kit.serve(cache, model, tokens)
    await cache.flush()
    await cache.evict_async(100)
    cache.take_events()
    m = cache.match_prefix(tokens)
    assert m.host_hit_length == 6
    used = cache.device_pool.allocator.used_size
    lb = cache.begin_load_back(m)
    if not loaded:
        assert lb is None
        assert cache.device_pool.allocator.used_size == used
        assert cache.take_events() == []
        req = cache.admit(tokens)
        assert await cache.load_back_request(req) == 0 and req.prefix_len == 0
        cache.cache_finished_req(req)
    else:
        assert lb is not None and lb.num_tokens == 6
        await asyncio.wait_for(lb.wait(), kit.TIMEOUT)
        model.check(cache, tokens, lb.device_indices)
        cache.release_load(lb)
    await kit.quiesce_and_check(cache)


@pytest.mark.parametrize(("quota", "loaded"), [(0, False), (5, False), (6, True), (100, True)])
async def test_load_back_mem_quota(make_cache, kit, quota, loaded):
    cache = await _scenario_cache(make_cache, "write_through")
    model = kit.KVModel.of(cache)
    tokens = [1, 2, 3, 4, 5, 6]
    await kit.serve(cache, model, tokens)
    await cache.flush()
    await cache.evict_async(100)
    req = cache.admit(tokens)
    n = await asyncio.wait_for(cache.load_back_request(req, mem_quota=quota), kit.TIMEOUT)
    assert n == (6 if loaded else 0)
    assert req.prefix_len == n
    assert cache.device_pool.allocator.used_size == n
    model.check(cache, tokens, req.slots)
    cache.cache_finished_req(req)
    await kit.quiesce_and_check(cache)


async def test_load_back_skipped_when_device_cannot_make_room(make_cache, kit):
    cache = await _scenario_cache(make_cache, "write_through", device_tokens=8)
    model = kit.KVModel.of(cache)
    tokens = [1, 2, 3, 4, 5, 6]
    await kit.serve(cache, model, tokens)
    await cache.flush()
    await cache.evict_async(100)
    holder = await kit.serve(cache, model, [9, 9, 8, 8, 7, 7], finish=False)  # locks 6 of 8
    assert cache.device_available == 2
    req = cache.admit(tokens)
    assert await cache.load_back_request(req) == 0
    assert req.prefix_len == 0
    cache.sanity_check()
    cache.cache_finished_req(holder)
    await cache.flush()  # the holder's write-through copy pins it until the ack
    assert await cache.load_back_request(req) == 6  # room now (the holder's KV is evictable)
    model.check(cache, tokens, req.slots)
    cache.cache_finished_req(req)
    await kit.quiesce_and_check(cache)


async def test_split_during_pending_write(make_cache, kit):
    """A node split while its write-through copy is in flight: both fragments get the host copy
    and CPU BlockStored is published for both (the split prefix is linked to by later stores)."""
    cache = await _scenario_cache(make_cache, "write_through")
    model = kit.KVModel.of(cache)
    a = [1, 2, 3, 4, 5, 6]
    b = [1, 2, 7, 8]
    req = cache.admit(a)
    new = await cache.extend(req, 6)
    cache.write_kv(new, model.expected(a))
    cache.cache_finished_req(req)
    assert cache.in_flight == 1
    cache.take_events()
    await kit.serve(cache, model, b)  # splits [1..6] into [1,2] + [3..6] before the ack
    assert cache.tree.node_count == 3
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    for node in cache.tree.iter_nodes():
        assert node.host_value is not None, node
        assert node.pending == 0
    events = cache.take_events()
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium is Medium.CPU_PINNED]
    cpu_hashes = [h for e in cpu for h in e.block_hashes]
    assert sorted(cpu_hashes) == sorted(_hashes(a) + _hashes(b)[1:])
    assert stored(a, Medium.CPU_PINNED) in cpu  # [1,2] and [3..6], linked and coalesced
    assert stored(b, Medium.CPU_PINNED, _hashes(b)[0], first=2) in cpu
    assert cache.host_size == 8
    await cache.evict_async(100)
    for tokens, hit in ((a, 6), (b, 4)):
        r = cache.admit(tokens)
        assert r.host_hit_length + r.prefix_len == hit
        await cache.load_back_request(r)
        assert r.prefix_len == hit
        model.check(cache, tokens, r.slots)
        cache.cache_finished_req(r)
    await kit.quiesce_and_check(cache)


async def test_reset_on_close_emits_all_blocks_cleared(make_cache, kit):
    cache = await _scenario_cache(make_cache, "write_through")
    _insert(cache, [1, 2, 3, 4])
    await cache.flush()
    cache.take_events()
    await cache.aclose()
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.device_pool.allocator.used_size == 0
    assert cache.host_pool.allocator.used_size == 0


async def test_insert_frees_duplicate_slots_exactly_once(make_cache, kit):
    cache = await _scenario_cache(make_cache, "write_through_selective")
    first = cache.try_alloc_device(4)
    cache.insert([1, 2, 3, 4], first)
    dup = cache.try_alloc_device(6)
    res = cache.insert([1, 2, 3, 4, 5, 6], dup)
    assert res.prefix_len == 4 and res.cached_len == 6
    assert cache.device_pool.allocator.used_size == 6  # the 4 duplicate slots went back
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(m.device_indices, np.concatenate([first, dup[4:]]))
    cache.sanity_check()
    await kit.quiesce_and_check(cache)


async def test_selective_chunked_request_counts_one_hit(make_cache, kit):
    """cache_unfinished_req + cache_finished_req of one request are one hit, not two."""
    cache = await _scenario_cache(make_cache, "write_through_selective")
    model = kit.KVModel.of(cache)
    tokens = list(range(1, 13))
    await kit.serve(cache, model, tokens, chunk=4)  # three chunks, two cache_unfinished_req
    assert cache.in_flight == 0 and cache.host_size == 0
    await kit.serve(cache, model, tokens)  # a second request: now it is backed up
    assert cache.in_flight >= 1
    await cache.flush()
    assert cache.host_size == 12
    await kit.quiesce_and_check(cache)


async def test_backup_commits_retire_in_submission_order(make_cache, kit):
    cache = await _scenario_cache(make_cache, "write_through", device_tokens=64, host_tokens=64)
    model = kit.KVModel.of(cache)
    seqs = [[100 * i + j for j in range(1, 5)] for i in range(1, 11)]
    for s in seqs:
        await kit.serve(cache, model, s)
    assert cache.in_flight == 10
    cache.take_events()
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    cpu = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert [e.token_ids for e in cpu] == seqs
    assert all(e.medium is Medium.CPU_PINNED and e.parent_block_hash is None for e in cpu)
    await kit.quiesce_and_check(cache)
