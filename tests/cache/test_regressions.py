"""Regression tests for bugs found in the facade; each docstring is the original reproducer."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asynccache.errors import AsyncCacheError, PoolExhaustedError


async def _host_only(cache, kit, model, tokens):
    await kit.serve(cache, model, tokens)
    await cache.flush()
    await cache.evict_async(10**6)
    await cache.flush()


def _accounting_ok(cache) -> str | None:
    try:
        cache.sanity_check()
    except AssertionError as exc:
        return str(exc)
    return None


async def test_concurrent_load_back_of_a_shared_host_hit(make_cache, kit):
    """admit(A); admit(B) (same tokens, both see host_hit_length=8);
    gather(load_back_request(A), load_back_request(B)) -> InvalidInputError + slot leak."""
    cache = await make_cache(write_policy="write_through", strict=False)
    model = kit.KVModel.of(cache)
    tokens = list(range(1, 11))
    await _host_only(cache, kit, model, tokens)
    a, b = cache.admit(tokens), cache.admit(tokens)
    assert a.host_hit_length == b.host_hit_length == 8
    try:
        got = await asyncio.wait_for(
            asyncio.gather(cache.load_back_request(a), cache.load_back_request(b),
                           return_exceptions=True), kit.TIMEOUT)
        assert not [g for g in got if isinstance(g, BaseException)], got
        assert 8 in got and set(got) <= {0, 8}  # one loads, the other waits for that load
        for r in (a, b):
            assert r.prefix_len == 8
            model.check(cache, tokens, r.slots)
    finally:
        await cache.flush()
        for r in (a, b):
            cache.cache_finished_req(r)
    assert _accounting_ok(cache) is None, _accounting_ok(cache)


@pytest.mark.parametrize("how", ["evict_host", "host_pressure"])
async def test_admitted_host_hit_is_pinned_until_loaded(make_cache, kit, how):
    """admit(X) with host_hit_length=8; evict_host(100) (or serve Y under write-through with
    host_tokens=8); load_back_request(req) used to raise UnknownNodeError and leak 8 device
    slots. admit now pins the host hit: host eviction cannot take it, and it loads."""
    cache = await make_cache(write_policy="write_through", host_tokens=8, strict=False)
    model = kit.KVModel.of(cache)
    x = list(range(1, 9))
    await _host_only(cache, kit, model, x)
    req = cache.admit(x)
    assert req.host_hit_length == 8
    if how == "evict_host":
        assert cache.evict_host(100) == 0
    else:
        await kit.serve(cache, model, list(range(500, 508)))  # its backup finds no host room
        await cache.flush()
        assert cache.match_prefix(x).host_hit_length == 8
    try:
        n = await asyncio.wait_for(cache.load_back_request(req), kit.TIMEOUT)
        assert n == 8 and req.prefix_len == 8
        model.check(cache, x, req.slots)
    finally:
        cache.cache_finished_req(req)
    assert _accounting_ok(cache) is None, _accounting_ok(cache)


async def test_write_back_load_back_makes_room_by_writing_back(make_cache, kit):
    """write_back, device 32: X (8 tokens) on host; serve 4 other 8-token sequences (device full
    of un-backed KV); admit(X); load_back_request -> 0 (expected 8)."""
    cache = await make_cache(write_policy="write_back", device_tokens=32, host_tokens=128)
    model = kit.KVModel.of(cache)
    x = list(range(1, 9))
    await _host_only(cache, kit, model, x)
    for i in range(4):
        await kit.serve(cache, model, [1000 * (i + 1) + j for j in range(8)])
    assert cache.device_available == 0
    req = cache.admit(x)
    assert req.host_hit_length == 8
    try:
        n = await asyncio.wait_for(cache.load_back_request(req), kit.TIMEOUT)
        assert n == 8
        model.check(cache, x, req.slots)
    finally:
        cache.cache_finished_req(req)


async def test_alloc_device_waits_for_its_own_write_back_copies(make_cache, kit):
    """write_back, device 16: serve two 8-token sequences; alloc_device(16) ->
    PoolExhaustedError('... 0 free, 0 evictable, 16 locked'); after flush() it succeeds."""
    cache = await make_cache(write_policy="write_back", device_tokens=16)
    model = kit.KVModel.of(cache)
    await kit.serve(cache, model, list(range(1, 9)))
    await kit.serve(cache, model, list(range(11, 19)))
    slots = await asyncio.wait_for(cache.alloc_device(16), kit.TIMEOUT)
    assert len(slots) == 16
    cache.free_device(slots)
    assert cache.host_size == 16


async def test_alloc_device_waits_for_in_flight_write_through_backups(make_cache, kit):
    """write_through, device 16: serve two 8-token sequences (backups in flight, nodes pinned);
    alloc_device(16) -> PoolExhaustedError; after flush() it succeeds."""
    cache = await make_cache(write_policy="write_through", device_tokens=16)
    model = kit.KVModel.of(cache)
    await kit.serve(cache, model, list(range(1, 9)))
    await kit.serve(cache, model, list(range(11, 19)))
    assert cache.in_flight == 2
    slots = await asyncio.wait_for(cache.alloc_device(16), kit.TIMEOUT)
    assert len(slots) == 16
    cache.free_device(slots)


async def test_flush_waits_only_for_copies_started_before_it(make_cache, kit):
    """write_through: insert, start flush(); keep inserting a new 4-token key each loop turn
    (each launches a backup) -> flush() still pending after 2000 turns."""
    cache = await make_cache(write_policy="write_through", device_tokens=4096,
                             host_tokens=1 << 15)
    slots = cache.try_alloc_device(8)
    cache.insert(list(range(1, 9)), slots)
    flush = asyncio.ensure_future(cache.flush())
    turns = 0
    while not flush.done() and turns < 2000:
        s = cache.try_alloc_device(4)
        cache.insert([100_000 + 4 * turns + j for j in range(4)], s)
        turns += 1
        if turns % 200 == 0:
            cache.evict(10**6)
        await asyncio.sleep(0)
    done = flush.done()
    await asyncio.wait_for(flush, kit.TIMEOUT)  # terminates once the producer stops
    assert done, f"flush() still waiting after {turns} loop turns"


async def test_cancelled_aclose_still_shuts_down(make_cache, kit):
    """start; insert 4 write-through sequences (backups in flight); t = create_task(aclose());
    one loop turn; t.cancel(); await aclose() -> worker thread alive, pools still used."""
    cache = await make_cache(write_policy="write_through", strict=False)
    model = kit.KVModel.of(cache)
    baseline = kit.copy_threads()
    engine_threads = list(cache.copy_engine.threads)
    for i in range(4):
        await kit.serve(cache, model, [100 * i + j for j in range(1, 13)])
    assert cache.in_flight == 4
    outcome, _ = await kit.run_cancelled(cache.aclose, 1)
    assert outcome == "cancelled"
    try:
        await asyncio.wait_for(cache.aclose(), kit.TIMEOUT)
        assert not [t.name for t in engine_threads if t.is_alive()]
        assert cache.device_pool.allocator.used_size == 0
        assert cache.host_pool.allocator.used_size == 0
    finally:
        if cache.copy_engine is not None and not cache.copy_engine.closed:
            await asyncio.wait_for(cache.copy_engine.aclose(), kit.TIMEOUT)  # do not leak it
    assert not (kit.copy_threads() - baseline)


async def test_evict_async_counts_dropped_write_back_victims(make_cache, kit):
    """write_back, device 16, host 8: serve two 8-token sequences; evict_async(16) -> 8."""
    cache = await make_cache(write_policy="write_back", device_tokens=16, host_tokens=8)
    model = kit.KVModel.of(cache)
    await kit.serve(cache, model, list(range(1, 9)))
    await kit.serve(cache, model, list(range(101, 109)))
    freed = await asyncio.wait_for(cache.evict_async(16), kit.TIMEOUT)
    assert cache.device_available == 16
    assert cache.metrics.registry.get_sample_value("asynccache_evicted_tokens_total") == 16
    assert freed == 16


async def test_hit_rate_gauge_is_maintained(make_cache, kit):
    """serve 8 tokens; match_prefix(same 8) -> matched 16, hit 8; refresh_gauges(); the gauge
    reads 0.0 (expected 0.5)."""
    cache = await make_cache(write_policy="write_through")
    model = kit.KVModel.of(cache)
    tokens = list(range(1, 9))
    await kit.serve(cache, model, tokens)
    assert cache.match_prefix(tokens).device_prefix_len == 8
    cache.refresh_gauges()
    reg = cache.metrics.registry
    assert reg.get_sample_value("asynccache_matched_tokens_total") == 16
    assert reg.get_sample_value("asynccache_hit_tokens_total") == 8
    assert reg.get_sample_value("asynccache_cache_hit_rate") == 0.5


async def test_bug_reproducers_do_not_break_a_fresh_cache(make_cache, kit):
    """Control: the flows above work when the trigger is absent (no stale hit, flush first)."""
    cache = await make_cache(write_policy="write_through")
    model = kit.KVModel.of(cache)
    tokens = list(range(1, 11))
    await _host_only(cache, kit, model, tokens)
    a = cache.admit(tokens)
    assert await cache.load_back_request(a) == 8
    b = cache.admit(tokens)  # admitted after the load started: waits for it
    assert await cache.load_back_request(b) == 0 and b.prefix_len == 8
    for r in (a, b):
        model.check(cache, tokens, r.slots)
        cache.cache_finished_req(r)
    assert isinstance(PoolExhaustedError("x"), AsyncCacheError)
    await kit.quiesce_and_check(cache)


async def test_cache_unfinished_req_does_not_hand_out_slots_still_loading(make_cache, kit):
    """X on host; A = admit(X+tail) recomputes X (no load); B's begin_load_back(X) is queued
    behind another copy; cache_unfinished_req(A) -> A.slots[:len(X)] == lb's slots, KV not there
    yet, A.pending_loads == ()."""
    cache = await make_cache(write_policy="write_through", device_tokens=256, host_tokens=512)
    model = kit.KVModel.of(cache)
    x = list(range(1, 33))
    await _host_only(cache, kit, model, x)
    cache.device_pool.kv.zero_()  # nothing on device is cached: no stale copy of X's KV
    a = cache.admit([*x, 99, 98])
    assert a.host_hit_length == 32
    new = await cache.extend(a, 32)
    cache.write_kv(new, model.expected(x))
    lock = cache.copy_engine._bridge._lock  # stalls the copy worker after its current copy
    with lock:
        gate = cache.try_alloc_device(4)
        cache.insert([7, 7, 7, 7], gate)  # a write-through copy queued ahead of the load
        lb = cache.begin_load_back(cache.match_prefix(x))
        assert lb is not None
        cache.cache_unfinished_req(a)
        pending = a.pending_loads
        stale = cache.read_kv(a.slots[:32])
    await asyncio.wait_for(cache.wait_loads(pending), kit.TIMEOUT)
    await asyncio.wait_for(lb.wait(), kit.TIMEOUT)
    cache.release_load(lb)
    try:
        if not pending:  # nothing to wait for: the KV must be in place already
            kit.assert_bits_equal(stale, model.expected(x), "request KV after cache_unfinished_req")
        model.check(cache, x, a.slots[:32])
    finally:
        cache.cache_finished_req(a)


async def test_load_back_cannot_evict_its_own_host_source(make_cache, kit):
    """write_back, eviction_policy='priority', device 12, host 16: H (8, prio 0) written back;
    A (8, prio 5) written back and loaded again (device + host); B (4, prio 0) un-backed;
    begin_load_back(match(H)) -> evict demotes A and writes back B, whose host slots come from
    evicting H -> UnknownNodeError, 8 device slots leaked."""
    cache = await make_cache(write_policy="write_back", eviction_policy="priority",
                             device_tokens=12, host_tokens=16, strict=False)
    model = kit.KVModel.of(cache)
    h, a, b = list(range(1, 9)), list(range(11, 19)), [21, 22, 23, 24]
    for tokens, prio in ((h, 0), (a, 5)):
        slots = cache.try_alloc_device(len(tokens))
        cache.write_kv(slots, model.expected(tokens))
        cache.insert(tokens, slots, priority=prio)
        assert await cache.evict_async(len(tokens)) == len(tokens)
    lb = await cache.load_back(cache.match_prefix(a))
    cache.release_load(lb)
    slots = cache.try_alloc_device(4)
    cache.insert(b, slots, priority=0)
    assert (cache.device_available, cache.host_size) == (0, 16)
    m = cache.match_prefix(h)
    assert m.host_hit_length == 8
    try:
        lb = cache.begin_load_back(m)
        if lb is not None:
            await asyncio.wait_for(lb.wait(), kit.TIMEOUT)
            model.check(cache, h, lb.device_indices)
            cache.release_load(lb)
    finally:
        await cache.flush()
    assert _accounting_ok(cache) is None, _accounting_ok(cache)


@pytest.mark.parametrize("call", ["alloc_device", "try_alloc_device", "extend"])
async def test_an_allocation_that_cannot_fit_evicts_nothing(make_cache, kit, call):
    """Pool of 64 device slots, 16 cached (no host copy): alloc_device(68) evicted the cached
    prefix, then raised PoolExhaustedError (its KV lost for nothing); the same for 40 slots
    while a request holds 32 (free 16 + evictable 16 < 40)."""
    cache = await make_cache(host_tokens=0)
    model = kit.KVModel.of(cache)
    cached = list(range(500, 516))
    await kit.serve(cache, model, cached)
    for need, hold in ((68, 0), (40, 32)):
        held = await cache.alloc_device(hold) if hold else None
        assert (cache.tree.evictable_size, cache.device_pool.allocator.available_size) == (
            16, 48 - hold)
        if call == "try_alloc_device":
            assert cache.try_alloc_device(need) is None
        else:
            req = cache.admit(list(range(900, 904))) if call == "extend" else None
            with pytest.raises(PoolExhaustedError, match=f"cannot allocate {need}"):
                if req is None:
                    await cache.alloc_device(need)
                else:
                    await cache.extend(req, need)
            if req is not None:
                cache.abort_req(req)
        assert cache.match_prefix(cached).device_prefix_len == 16  # still cached
        cache.sanity_check()
        if held is not None:
            cache.free_device(held)
    req = await kit.serve(cache, model, cached)  # served from the cache, its own KV
    assert req.prefix_len == 16
    cache.sanity_check()


async def test_take_host_that_cannot_fit_evicts_nothing(make_cache, kit):
    """take_host(10**6) evicted every host copy, then returned None."""
    cache = await make_cache(write_policy="write_through")
    model = kit.KVModel.of(cache)
    await _host_only(cache, kit, model, list(range(500, 516)))
    assert cache.host_size == 16
    assert cache.take_host(260) is None  # the host pool holds 256
    assert cache.host_size == 16
    cache.sanity_check()


async def test_write_back_eviction_takes_the_parent_chain_as_the_reference_does(make_cache):
    """Reference (behavior.md 1.5): a write-back victim is backed up and demoted, then its
    parent, now a device leaf, competes with the other leaves. Page 1, LRU: [1,2] -> [3] -> [4]
    and [9] (newest); evict_async(4) must take [4], [3], [1,2] and leave [9], backing up those
    three nodes only (it took [4] and [9] first: 5 tokens, [9] backed up for nothing)."""
    cache = await make_cache(page_size=1, write_policy="write_back", device_tokens=64,
                             host_tokens=64)
    for tokens in ([1, 2], [1, 2, 3], [1, 2, 3, 4], [9]):
        m = cache.match_prefix(tokens)
        slots = await cache.alloc_device(len(tokens) - m.device_prefix_len)
        res = cache.insert(tokens, np.concatenate([m.device_indices, slots]),
                           prev_prefix_len=m.device_prefix_len)
        assert res.cached_len == len(tokens)
    assert await cache.evict_async(4) == 4
    await cache.flush()
    assert cache.match_prefix([9]).device_prefix_len == 1
    m = cache.match_prefix([1, 2, 3, 4])
    assert (m.device_prefix_len, m.host_hit_length) == (0, 4)
    assert cache.metrics.registry.get_sample_value("asynccache_backup_tokens_total") == 4
    assert cache.host_size == 4
    cache.sanity_check()


@pytest.mark.parametrize("fail", [0, 1])
async def test_a_failed_copy_in_a_write_back_chain_never_drops_the_parent(make_cache, fail):
    """The chain [1,2] -> [3] is taken in one evict_async round: [3]'s copy, then its parent's.
    A failed child copy drops the child (as a failed write-back victim is); a failed parent
    copy leaves the parent on device (it is not dropped with its children's copies landed),
    and later rounds evict it with a copy of its own."""
    from asynccache.testing.copyfaults import copy_faults

    cache = await make_cache(page_size=1, write_policy="write_back", device_tokens=64,
                             host_tokens=64)
    for tokens in ([1, 2], [1, 2, 3]):
        m = cache.match_prefix(tokens)
        slots = await cache.alloc_device(len(tokens) - m.device_prefix_len)
        cache.insert(tokens, np.concatenate([m.device_indices, slots]),
                     prev_prefix_len=m.device_prefix_len)
    faults = copy_faults(cache.copy_engine, delay_s=0.0, fail={fail})
    await cache.evict_async(3)
    await cache.flush()
    faults.remove()
    m = cache.match_prefix([1, 2, 3])
    # fail 0: [3] dropped, then [1, 2] backed up by a later round and demoted; fail 1: [1, 2]
    # kept on device, then [3] and [1, 2] demoted in order: nothing else is lost
    assert (m.device_prefix_len, m.host_hit_length) == ((0, 2) if fail == 0 else (0, 3))
    assert cache.tree.device_size == 0
    cache.sanity_check()


@pytest.mark.parametrize("policy", ["mru", "lru"])
async def test_write_back_evict_async_demotes_every_victim_it_backed_up(make_cache, policy):
    """Reference (behavior.md 1.5): a write-back victim is backed up, then demoted, before
    the next one is taken. Page 1, [0,0] evicted (host only), inserted again (a duplicate),
    then [1] (no host copy). evict_async(2) takes both [1] and [0,0] (MRU: [1] first; LRU:
    [0,0] first, 2 tokens, then nothing more is needed: [1] stays). Under MRU it counted
    [1] (waiting for its copy) toward the target, stopped once [0,0] was demoted and left [1]
    on device with a host copy made for it: 2 tokens freed where SGLang frees 3."""
    cache = await make_cache(page_size=1, write_policy="write_back", eviction_policy=policy,
                             device_tokens=64, host_tokens=64)

    async def insert(tokens: list[int]) -> None:
        m = cache.match_prefix(tokens)
        slots = await cache.alloc_device(len(tokens) - m.device_prefix_len)
        cache.insert(tokens, np.concatenate([m.device_indices, slots]),
                     prev_prefix_len=m.device_prefix_len)

    await insert([0, 0])
    assert await cache.evict_async(1) == 2
    await insert([0, 0])
    await insert([1])
    freed = await cache.evict_async(2)
    await cache.flush()
    cache.sanity_check()
    on_device = cache.match_prefix([1]).device_prefix_len
    if policy == "mru":
        assert (freed, on_device, cache.tree.device_size) == (3, 0, 0)
        assert cache.match_prefix([1]).host_hit_length == 1
    else:
        assert (freed, on_device, cache.tree.device_size) == (2, 1, 1)
        assert cache.match_prefix([1]).host_hit_length == 0  # never backed up
