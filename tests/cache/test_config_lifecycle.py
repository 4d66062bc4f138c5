"""CacheConfig validation (clear ConfigError naming the bad value) and the cache's lifecycle:
start / aclose / ``async with``, ClosedError before start and after close, no thread left."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asynccache import CacheConfig, HierarchicalCache
from asynccache.errors import AsyncCacheError, ClosedError, ConfigError, InvalidInputError

GOOD = {"page_size": 4, "num_layers": 2, "num_heads": 2, "head_dim": 8, "device_tokens": 64}


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"page_size": 0}, ["page_size", "0"]),
        ({"page_size": -4}, ["page_size", "-4"]),
        ({"page_size": True}, ["page_size", "True"]),
        ({"page_size": 2.5}, ["page_size", "2.5"]),
        ({"num_layers": 0}, ["num_layers", "0"]),
        ({"num_heads": -1}, ["num_heads", "-1"]),
        ({"head_dim": "64"}, ["head_dim", "'64'"]),
        ({"write_policy": "write_sometimes"}, ["write_sometimes", "write_policy"]),
        ({"eviction_policy": "random"}, ["random", "eviction_policy"]),
        ({"dtype": "int8"}, ["int8", "dtype"]),
        ({"dtype": "float64"}, ["float64"]),
        ({"device_bytes": 4096}, ["device_tokens", "device_bytes"]),
        ({"device_tokens": None}, ["device_tokens", "device_bytes"]),
        ({"device_tokens": 0}, ["device_tokens", "0"]),
        ({"device_tokens": -8}, ["device_tokens", "-8"]),
        ({"host_tokens": -4}, ["host_tokens", "-4"]),
        ({"host_tokens": 64, "host_bytes": 4096}, ["host_tokens", "host_bytes"]),
        ({"host_bytes": -1}, ["host_bytes", "-1"]),
        ({"host_layout": "row_major"}, ["row_major"]),
        ({"load_back_threshold": -1}, ["load_back_threshold", "-1"]),
        ({"device": "tpu"}, ["tpu"]),
    ],
)
def test_bad_config_values_raise_config_error(overrides, needles):
    with pytest.raises(ConfigError) as info:
        CacheConfig(**{**GOOD, **overrides})
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert isinstance(info.value, AsyncCacheError) and isinstance(info.value, ValueError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda():
    with pytest.raises(ConfigError, match="cuda"):
        CacheConfig(**{**GOOD, "device": "cuda"})
    with pytest.raises(ConfigError, match="cuda:1"):
        CacheConfig(**{**GOOD, "device": "cuda:1"})


def test_pool_smaller_than_a_page_is_rejected_at_construction():
    with pytest.raises(ConfigError, match="num_tokens=2"):
        HierarchicalCache(CacheConfig(**{**GOOD, "device_tokens": 2}))
    with pytest.raises(ConfigError, match="num_bytes=100"):
        HierarchicalCache(CacheConfig(**{**GOOD, "device_tokens": None, "device_bytes": 100}))
    with pytest.raises(ConfigError, match="num_tokens=3"):
        HierarchicalCache(CacheConfig(**{**GOOD, "host_tokens": 3}))


def test_config_from_dict_and_defaults():
    with pytest.raises(ConfigError, match="page_sise"):
        CacheConfig.from_dict({**GOOD, "page_sise": 4})
    cfg = CacheConfig.from_dict({**GOOD, "dtype": "bf16", "host_tokens": 0})
    assert cfg.torch_dtype is torch.bfloat16
    assert cfg.host_enabled is False  # zero host capacity: no L2 tier
    assert CacheConfig(**GOOD).write_policy == "write_through_selective"
    assert CacheConfig(**GOOD).load_back_threshold == 10
    with pytest.raises(InvalidInputError):
        HierarchicalCache({**GOOD})  # not a CacheConfig


def test_capacity_from_bytes():
    per_token = 2 * 2 * 2 * 8 * 2  # layers x K/V x heads x dim x fp16
    cache = HierarchicalCache(CacheConfig(**{**GOOD, "device_tokens": None,
                                             "device_bytes": per_token * 4 * 5 + 7,
                                             "host_bytes": per_token * 4 * 3}))
    assert cache.device_pool.num_slots == 20
    assert cache.host_pool is not None and cache.host_pool.num_slots == 12


def _calls(cache, req, lb_match):
    """Every public call that must refuse to run on a cache that is not running."""
    return {
        "match_prefix": lambda: cache.match_prefix([1, 2, 3, 4]),
        "insert": lambda: cache.insert([1, 2, 3, 4], np.arange(4)),
        "evict": lambda: cache.evict(4),
        "evict_host": lambda: cache.evict_host(4),
        "lock": lambda: cache.lock(0),
        "try_alloc_device": lambda: cache.try_alloc_device(4),
        "admit": lambda: cache.admit([1, 2, 3, 4]),
        "begin_load_back": lambda: cache.begin_load_back(lb_match),
        "cache_finished_req": lambda: cache.cache_finished_req(req),
        "cache_unfinished_req": lambda: cache.cache_unfinished_req(req),
        "abort_req": lambda: cache.abort_req(req),
    }


def _async_calls(cache, req, lb_match):
    return {
        "alloc_device": lambda: cache.alloc_device(4),
        "evict_async": lambda: cache.evict_async(4),
        "load_back": lambda: cache.load_back(lb_match),
        "extend": lambda: cache.extend(req, 4),
    }


async def test_calls_before_start_and_after_close_raise_closed_error(make_cache, kit):
    from asynccache.tree import MatchResult

    fresh = await make_cache(start=False, write_policy="write_through")
    host_match = MatchResult(np.empty(0, dtype=np.int64), 0, 0, 1, 8)
    # A request object as a running cache would have made it.
    live = await make_cache(write_policy="write_through")
    model = kit.KVModel.of(live)
    req = await kit.serve(live, model, list(range(1, 9)), finish=False)
    for name, call in _calls(fresh, req, host_match).items():
        with pytest.raises(ClosedError, match="new"):
            call()
        assert name
    for name, make in _async_calls(fresh, req, host_match).items():
        with pytest.raises(ClosedError):
            await asyncio.wait_for(make(), kit.TIMEOUT)
        assert name
    live.cache_finished_req(req)
    await kit.quiesce_and_check(live)

    async with HierarchicalCache(kit.config(write_policy="write_through")) as cache:
        req = await kit.serve(cache, kit.KVModel.of(cache), list(range(1, 9)), finish=False)
        cache.cache_finished_req(req)
        req2 = cache.admit(list(range(1, 13)))
        await cache.extend(req2, 4)
    assert cache.state == "closed"
    for name, call in _calls(cache, req2, host_match).items():
        with pytest.raises(ClosedError, match="closed"):
            call()
        assert name
    for name, make in _async_calls(cache, req2, host_match).items():
        with pytest.raises(ClosedError):
            await asyncio.wait_for(make(), kit.TIMEOUT)
        assert name
    with pytest.raises(ClosedError):
        await cache.start()  # no restart
    await cache.aclose()  # idempotent


async def test_start_twice_and_close_unstarted(make_cache, kit):
    cache = await make_cache()
    with pytest.raises(ClosedError, match="running"):
        await cache.start()
    never = await make_cache(start=False)
    await never.aclose()
    assert never.state == "closed"
    with pytest.raises(ClosedError):
        never.match_prefix([1, 2, 3, 4])
    await kit.quiesce_and_check(cache)


async def test_async_with_lifecycle_leaves_nothing(kit):
    baseline = kit.copy_threads()
    cache = HierarchicalCache(kit.config(write_policy="write_through", enable_kv_events=True))
    assert cache.copy_engine is None
    async with cache as c:
        assert c is cache
        engine_threads = list(cache.copy_engine.threads)
        assert engine_threads and all(t.is_alive() for t in engine_threads)
        model = kit.KVModel.of(cache)
        for i in range(5):
            await kit.serve(cache, model, [100 * i + j for j in range(1, 14)])
        assert cache.in_flight == 5
        await cache.flush()
        await cache.evict_async(10**6)
        lb = cache.begin_load_back(cache.match_prefix([j for j in range(1, 14)]))
        assert lb is not None  # still copying when the block exits
    # aclose waited for the load-back, committed it and freed everything.
    assert lb.handle.finished and lb.error is None
    assert cache.device_pool.allocator.used_size == 0
    assert cache.host_pool.allocator.used_size == 0
    assert cache.tree.node_count == 0 and cache.tree.held_locks == 0
    assert not [t for t in engine_threads if t.is_alive()]
    assert not (kit.copy_threads() - baseline)


async def test_close_with_backups_in_flight(make_cache, kit):
    cache = await make_cache(write_policy="write_through")
    model = kit.KVModel.of(cache)
    for i in range(6):
        await kit.serve(cache, model, [100 * i + j for j in range(1, 10)])
    assert cache.in_flight == 6
    await kit.close_and_check(cache)
    assert cache.in_flight == 0


async def test_close_while_write_back_eviction_awaits(make_cache, kit):
    """aclose() while another task is inside evict_async: both finish, nothing leaks."""
    cache = await make_cache(write_policy="write_back", device_tokens=32)
    model = kit.KVModel.of(cache)
    for i in range(4):
        await kit.serve(cache, model, [1000 * (i + 1) + j for j in range(8)])
    ev = asyncio.ensure_future(cache.evict_async(32))
    await asyncio.sleep(0)
    assert cache.in_flight >= 1
    await asyncio.wait_for(cache.aclose(), kit.TIMEOUT)
    await asyncio.wait({ev}, timeout=kit.TIMEOUT)
    assert ev.done()
    assert cache.device_pool.allocator.used_size == 0
    assert cache.host_pool.allocator.used_size == 0


async def test_bad_inputs(make_cache, kit):
    cache = await make_cache(write_policy="write_through")
    model = kit.KVModel.of(cache)
    req = cache.admit(list(range(1, 9)))
    with pytest.raises(InvalidInputError, match="-1"):
        await cache.extend(req, -1)
    new = await cache.extend(req, 8)
    with pytest.raises(InvalidInputError):
        cache.write_kv(new, model.expected(list(range(1, 9)))[:, :, :4])  # 4 tokens for 8 slots
    cache.write_kv(new, model.expected(list(range(1, 9))))
    cache.cache_finished_req(req)
    with pytest.raises(InvalidInputError, match=req.rid):
        cache.cache_finished_req(req)  # twice
    with pytest.raises(InvalidInputError):
        cache.admit([1, -2, 3])
    with pytest.raises(InvalidInputError):
        cache.evict(-1)
    await kit.quiesce_and_check(cache)


async def test_bind_compute_stream_checks_the_stream_and_reaches_every_copier(make_cache):
    """The cache's copies all wait for the bound compute stream (the fence contract); a value
    that is not a stream of the copiers' kind is a ConfigError naming it."""
    cache = await make_cache(host_tokens=128, sliding_window=8, mamba_states=4)
    engines = [cache.copy_engine, cache.hybrid.tier.swa_engine, cache.hybrid.tier.states.engine]
    with pytest.raises(ConfigError, match="not-a-stream"):
        cache.bind_compute_stream("not-a-stream")
    assert all(e.compute_stream is None for e in engines)
    cache.bind_compute_stream(None)
    assert all(e.compute_stream is None for e in engines)
