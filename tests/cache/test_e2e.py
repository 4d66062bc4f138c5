"""End to end, per write policy: admit -> extend -> write KV -> cache -> (backup) -> evict ->
host hit -> load back -> the reloaded KV is bit for bit what was written; plus the metrics."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

POLICIES = ("write_through", "write_through_selective", "write_back")
DTYPES = ("float16", "bfloat16", "float32")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def sample(cache, name, labels=None):
    value = cache.metrics.registry.get_sample_value(name, labels or {})
    assert value is not None, f"metric {name} {labels} not exported"
    return value


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", POLICIES)
async def test_round_trip_bit_exact(make_cache, kit, policy, dtype):
    cache = await make_cache(write_policy=policy, dtype=dtype, device_tokens=64, host_tokens=128)
    model = kit.KVModel.of(cache)
    tokens = list(range(100, 126))  # 6 whole pages + a 2-token tail (never cached)
    bytes_per_token = 2 * 2 * 2 * 8 * ITEMSIZE[dtype]
    assert cache.shape.bytes_per_token == bytes_per_token

    req = cache.admit(tokens)
    assert (req.prefix_len, req.host_hit_length) == (0, 0)
    new = await cache.extend(req, len(tokens))
    written = model.expected(tokens)
    cache.write_kv(new, written)
    kit.assert_bits_equal(cache.read_kv(new), written, "KV as written")
    cache.cache_finished_req(req)
    assert cache.tree.held_locks == 0
    assert cache.tree.device_size == 24
    assert cache.device_pool.allocator.used_size == 24  # the unaligned tail page was freed

    if policy == "write_through":
        assert cache.in_flight == 1  # backed up at its first insert
    else:
        assert cache.in_flight == 0
    if policy == "write_through_selective":
        await kit.serve(cache, model, tokens)  # the second hit triggers the backup
        assert cache.in_flight == 1
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    assert cache.in_flight == 0
    assert cache.host_size == (0 if policy == "write_back" else 24)
    cache.sanity_check()

    evicted = await asyncio.wait_for(cache.evict_async(64), kit.TIMEOUT)
    assert evicted == 24
    assert cache.tree.device_size == 0
    assert cache.device_pool.allocator.used_size == 0
    assert cache.host_size == 24
    cache.sanity_check()

    req2 = cache.admit(tokens)
    assert (req2.prefix_len, req2.host_hit_length) == (0, 24)
    loaded = await asyncio.wait_for(cache.load_back_request(req2), kit.TIMEOUT)
    assert loaded == 24
    assert req2.prefix_len == 24 and len(req2.slots) == 24
    assert req2.host_hit_length == 0
    assert cache.tree.held_locks == 1  # the request's lock moved to the loaded prefix
    reloaded = cache.read_kv(req2.slots)
    kit.assert_bits_equal(reloaded, written[:, :, :24], "reloaded KV")
    # The host copy stays as a duplicate; the device prefix is served from now on.
    assert cache.host_size == 24 and cache.tree.device_size == 24
    m = cache.match_prefix(tokens)
    assert (m.device_prefix_len, m.host_hit_length) == (24, 0)
    np.testing.assert_array_equal(m.device_indices, req2.slots)
    cache.cache_finished_req(req2)
    await kit.quiesce_and_check(cache)

    # Metrics: exact token and byte counts of the flow.
    backups = 1
    assert sample(cache, "asynccache_evicted_tokens_total") == 24
    assert sample(cache, "asynccache_backup_tokens_total") == 24
    assert sample(cache, "asynccache_backup_bytes_total") == 24 * bytes_per_token
    assert sample(cache, "asynccache_backup_duration_seconds_count") == backups
    assert sample(cache, "asynccache_load_back_tokens_total") == 24
    assert sample(cache, "asynccache_load_back_bytes_total") == 24 * bytes_per_token
    assert sample(cache, "asynccache_load_back_duration_seconds_count") == 1
    assert sample(cache, "asynccache_dropped_tokens_total", {"reason": "host_pressure"}) == 0
    assert sample(cache, "asynccache_dropped_tokens_total", {"reason": "backup_failed"}) == 0
    assert sample(cache, "asynccache_eviction_duration_seconds_count") >= 1
    admits = 3 if policy == "write_through_selective" else 2
    assert sample(cache, "asynccache_matched_tokens_total") == 26 * admits + 26  # + match_prefix
    assert sample(cache, "asynccache_hit_tokens_total") == 24 * (admits - 1) + 24
    assert sample(cache, "asynccache_host_total_tokens") == 128
    cache.refresh_gauges()
    assert sample(cache, "asynccache_evictable_tokens") == 24
    assert sample(cache, "asynccache_protected_tokens") == 0
    assert sample(cache, "asynccache_host_used_tokens") == 24
    text = cache.metrics.exposition().decode()
    assert "asynccache_load_back_tokens_total 24.0" in text


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
async def test_round_trip_host_layouts_and_unaligned_pages(make_cache, kit, host_layout):
    """Several requests sharing prefixes, evicted and reloaded through either host layout."""
    cache = await make_cache(write_policy="write_through", host_layout=host_layout,
                             device_tokens=128, host_tokens=256)
    model = kit.KVModel.of(cache)
    seqs = [
        list(range(1, 31)),
        list(range(1, 17)) + list(range(200, 214)),
        list(range(1, 9)) + list(range(300, 311)),
        list(range(500, 505)),
    ]
    for s in seqs:
        await kit.serve(cache, model, s)
    await cache.flush()
    await cache.evict_async(10_000)
    assert cache.tree.device_size == 0
    for s in seqs:
        cached = len(s) - len(s) % 4
        req = cache.admit(s)
        assert req.prefix_len + req.host_hit_length == cached  # earlier loads share prefixes
        await cache.load_back_request(req)
        assert req.prefix_len == cached
        model.check(cache, s, req.slots)
        cache.cache_finished_req(req)
    await kit.quiesce_and_check(cache)


async def test_layerwise_load_back(make_cache, kit):
    """``await lb.layer(i)`` means layer i of the loaded KV is in place."""
    cache = await make_cache(write_policy="write_through", num_layers=4)
    model = kit.KVModel.of(cache)
    tokens = list(range(40, 60))
    await kit.serve(cache, model, tokens)
    await cache.flush()
    await cache.evict_async(1000)
    m = cache.match_prefix(tokens)
    assert m.host_hit_length == 20
    lb = cache.begin_load_back(m)
    assert lb is not None and lb.num_tokens == 20
    want = model.expected(tokens)
    for layer in range(4):
        await asyncio.wait_for(lb.layer(layer), kit.TIMEOUT)
        got = cache.read_kv(lb.device_indices)[layer]
        kit.assert_bits_equal(got, want[layer], f"layer {layer}")
    await asyncio.wait_for(lb.wait(), kit.TIMEOUT)
    assert lb.receipt is not None
    kit.assert_bits_equal(cache.read_kv(lb.device_indices), want, "all layers")
    cache.release_load(lb)
    assert lb.receipt is None
    await kit.quiesce_and_check(cache)


async def test_load_back_after_partial_device_hit(make_cache, kit):
    """A device prefix plus a host suffix: only the suffix is loaded, the whole prefix served."""
    cache = await make_cache(write_policy="write_through")
    model = kit.KVModel.of(cache)
    base = list(range(1, 9))
    long = base + list(range(70, 82))
    await kit.serve(cache, model, long)
    await cache.flush()
    await cache.evict_async(1000)
    await kit.serve(cache, model, base)  # reload [1..8] through its own host hit
    m = cache.match_prefix(long)
    assert (m.device_prefix_len, m.host_hit_length) == (8, 12)
    req = cache.admit(long)
    assert await cache.load_back_request(req) == 12
    assert req.prefix_len == 20
    model.check(cache, long, req.slots)
    cache.cache_finished_req(req)
    await kit.quiesce_and_check(cache)


async def test_disable_mode_is_a_chunk_cache(make_cache, kit):
    cache = await make_cache(disable=True, host_tokens=None)
    model = kit.KVModel.of(cache)
    tokens = list(range(10, 30))
    for _ in range(2):
        req = cache.admit(tokens)
        assert (req.prefix_len, req.host_hit_length, len(req.slots)) == (0, 0, 0)
        m = cache.match_prefix(tokens)
        assert (m.device_prefix_len, m.host_hit_length, len(m.device_indices)) == (0, 0, 0)
        new = await cache.extend(req, 20)
        cache.write_kv(new, model.expected(tokens))
        assert cache.device_pool.allocator.used_size == 20
        cache.cache_unfinished_req(req)  # nothing is cached
        cache.cache_finished_req(req)
        assert cache.device_pool.allocator.used_size == 0
        assert cache.tree.node_count == 0
        assert cache.tree.held_locks == 0
    from asynccache.errors import InvalidInputError

    with pytest.raises(InvalidInputError):
        cache.insert(tokens[:4], np.arange(4))
    await kit.quiesce_and_check(cache)


async def test_device_only_cache_has_no_host_tier(make_cache, kit):
    cache = await make_cache(host_tokens=None, device_tokens=16)
    model = kit.KVModel.of(cache)
    assert cache.host_pool is None and cache.copy_engine is None
    await kit.serve(cache, model, list(range(1, 13)))
    await kit.serve(cache, model, list(range(50, 62)))  # evicts the first (deleted, no host)
    m = cache.match_prefix(list(range(1, 13)))
    assert (m.device_prefix_len, m.host_hit_length) == (0, 0)
    assert cache.begin_load_back(m) is None
    req = await kit.serve(cache, model, list(range(50, 62)), finish=False)
    assert req.prefix_len == 12
    cache.cache_finished_req(req)
    await kit.quiesce_and_check(cache)
