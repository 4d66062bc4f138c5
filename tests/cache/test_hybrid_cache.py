"""HierarchicalCache with SWA and Mamba components: per-pool frees and accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asynccache import CacheConfig
from asynccache.errors import ConfigError, InvalidInputError

HYBRID = {"host_tokens": 0, "page_size": 2, "device_tokens": 32, "sliding_window": 4,
          "swa_tokens": 24, "mamba_states": 4, "mamba_state_shape": (3,)}


def used(cache) -> tuple[int, int, int]:
    hy = cache.hybrid
    return (cache.device_pool.allocator.used_size, hy.swa_pool.allocator.used_size,
            hy.mamba_pool.used_size)


async def test_hybrid_cache_frees_every_component_into_its_own_pool(make_cache) -> None:
    cache = await make_cache(**HYBRID)
    states = cache.hybrid.mamba_pool.states
    a = list(range(12))
    slots = cache.try_alloc_device(12)
    st = cache.alloc_mamba_state()
    states[st] = torch.tensor([1.0, 2.0, 3.0])
    res = cache.insert(a, slots, mamba_value=st)
    cache.sanity_check()
    assert (res.cached_len, used(cache)) == (12, (12, 12, 1))
    m = cache.match_prefix([*a, 99], cow_mamba=True)
    assert (m.device_prefix_len, m.mamba_cow_slot) == (12, st)
    mine = cache.mamba_copy_on_write(m.mamba_cow_slot)
    assert mine is not None and mine != st
    assert torch.equal(states[mine], states[st])
    r = cache.lock(m.last_device_node)
    assert (r.swa_span, r.mamba_locked) == (4, True)
    cache.sanity_check()
    # Decode moved past the window: the SWA pins go; SWA eviction tombstones the prefix.
    cache.release_swa(r)
    assert cache.evict(0, swa_num_tokens=100) == 0
    # FULL stays pinned; all SWA is freed and, by cascade, the tree's state with it.
    assert used(cache) == (12, 0, 1)
    assert cache.match_prefix(a).device_prefix_len == 0
    cache.sanity_check()
    # The request finishes: 14 tokens cached, the last window re-inserted from its slots.
    more = cache.try_alloc_device(2)
    value = np.concatenate([m.device_indices, more])
    # The decode already freed the SWA slots of its first 10 tokens (out of the window).
    res = cache.insert([*a, 99, 98], value, prev_prefix_len=12, swa_evicted_seqlen=10,
                       mamba_value=mine)
    cache.unlock(r)
    cache.sanity_check()
    assert res.prefix_len == 12 and res.mamba_exist is False
    assert used(cache) == (14, 2, 1)
    # The 2 fresh tokens hold the only live SWA: a window of 4 is not live yet.
    assert cache.match_prefix([*a, 99, 98]).device_prefix_len == 0
    assert cache.evict(100) == 14
    assert used(cache) == (0, 0, 0)
    cache.sanity_check()


async def test_allocation_evicts_swa_when_the_swa_pool_runs_short(make_cache) -> None:
    cache = await make_cache(**HYBRID)
    for i in range(3):  # 3 x 8 tokens fill the 24-slot SWA pool (device has 32)
        key = [100 * i + t for t in range(8)]
        cache.insert(key, cache.try_alloc_device(8), mamba_value=cache.alloc_mamba_state())
    assert used(cache) == (24, 24, 3)
    cache.sanity_check()
    got = cache.try_alloc_device(8)  # FULL has 8 free, SWA none: SWA eviction makes room
    assert got is not None and len(got) == 8
    assert cache.hybrid.swa_pool.allocator.used_size <= 24
    cache.sanity_check()
    cache.free_device(got)
    cache.sanity_check()
    # States: the pool (4) is full once more are taken; an unpinned state is evicted.
    taken = [cache.alloc_mamba_state() for _ in range(2)]
    assert None not in taken
    assert len(cache.tree.component_slots("mamba")) == 2  # one unpinned state was evicted
    cache.sanity_check()
    for s in taken:
        cache.free_mamba_state(s)
    cache.sanity_check()


async def test_hybrid_cache_closes_with_every_pool_empty(make_cache) -> None:
    cache = await make_cache(**HYBRID)
    cache.insert(list(range(10)), cache.try_alloc_device(10), mamba_value=cache.alloc_mamba_state())
    pools = (cache.device_pool.allocator, cache.hybrid.swa_pool.allocator,
             cache.hybrid.mamba_pool.allocator)
    assert [p.used_size for p in pools] == [10, 10, 1]
    await cache.aclose()
    assert [p.used_size for p in pools] == [0, 0, 0]


def test_hybrid_config_errors() -> None:
    CacheConfig(device_tokens=16, host_tokens=16, sliding_window=4, host_mode="buffer_only")
    with pytest.raises(ConfigError, match="Mamba is not supported in buffer_only mode"):
        CacheConfig(device_tokens=16, host_tokens=16, mamba_states=2, host_mode="buffer_only")
    CacheConfig(device_tokens=16, host_tokens=16, mamba_states=2, retraction_backup=True)
    with pytest.raises(ConfigError, match="mamba_state_shape"):
        CacheConfig(device_tokens=16, mamba_states=2, mamba_state_shape=(0,))
    with pytest.raises(ConfigError, match="sliding_window"):
        CacheConfig(device_tokens=16, sliding_window=-1)


async def test_component_calls_on_a_full_only_cache_are_refused(make_cache) -> None:
    cache = await make_cache(host_tokens=0)
    with pytest.raises(InvalidInputError, match="no SWA / Mamba"):
        cache.alloc_mamba_state()
    with pytest.raises(InvalidInputError, match="no SWA / Mamba"):
        cache.free_swa([0, 1])
