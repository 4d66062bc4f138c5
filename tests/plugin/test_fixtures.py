"""The fixtures themselves, used directly (auto mode): what they build and how to change it."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
import torch

from asynccache import CacheConfig, HierarchicalCache
from asynccache.errors import ConfigError
from asynccache.replay.kvgen import expected_kv
from asynccache.storage.factory import open_backend
from asynccache.testing import (
    DEFAULT_CONFIG,
    KVFactory,
    KVMismatchError,
    LeakError,
    S3Server,
    assert_quiescent,
    find_leaks,
    small_config,
)


async def test_the_default_cache(asynccache_cache: HierarchicalCache) -> None:
    cfg = asynccache_cache.config
    assert {k: getattr(cfg, k) for k in DEFAULT_CONFIG} == dict(DEFAULT_CONFIG)
    assert asynccache_cache.host_pool is not None
    assert asynccache_cache.device_available == cfg.device_tokens


@pytest.mark.parametrize(
    "asynccache_cache",
    [CacheConfig(page_size=2, device_tokens=32), {"host_tokens": 0, "eviction_policy": "fifo"}],
    indirect=True,
)
async def test_indirect_parameters(asynccache_cache: HierarchicalCache) -> None:
    cfg = asynccache_cache.config
    assert (cfg.page_size, cfg.host_enabled) in {(2, False), (4, False)}
    assert cfg.eviction_policy == ("fifo" if cfg.page_size == 4 else "lru")


@pytest.mark.asynccache_config(page_size=8, write_policy="write_back")
async def test_the_config_marker_and_the_factory(asynccache_cache: HierarchicalCache,
                                                 asynccache_cache_factory: Any) -> None:
    assert (asynccache_cache.page_size, asynccache_cache.config.write_policy) == (8, "write_back")
    other = await asynccache_cache_factory(page_size=16, device_bytes=1 << 16)
    assert (other.page_size, other.config.write_policy) == (16, "write_back")
    assert other.config.device_tokens is None
    unstarted = await asynccache_cache_factory(start=False)
    await unstarted.start()
    own = asynccache_cache_factory.track(HierarchicalCache(small_config(page_size=1)))
    await own.start()
    assert asynccache_cache_factory.caches == [asynccache_cache, other, unstarted, own]


def test_small_config() -> None:
    assert small_config().page_size == DEFAULT_CONFIG["page_size"]
    assert small_config(CacheConfig(device_tokens=8), head_dim=4).device_tokens == 8
    assert small_config({"host_bytes": 1 << 20}).host_tokens is None
    with pytest.raises(ConfigError, match="unknown config keys"):
        small_config(pages=3)


async def test_assert_quiescent_names_what_is_held(asynccache_cache: HierarchicalCache,
                                                   asynccache_kv: KVFactory) -> None:
    await assert_quiescent(asynccache_cache)
    req = asynccache_cache.admit(asynccache_kv.prompt(8))
    slots = await asynccache_cache.alloc_device(3)
    with pytest.raises(LeakError) as info:
        await assert_quiescent(asynccache_cache)
    assert info.value.problems == [
        "1 lock receipt still held: node 0 (device, the root: a request admitted with nothing "
        "cached) -- finish or abort every request (cache_finished_req / abort_req), "
        "release_load() every LoadBack, unlock() / unlock_host() every manual lock",
        "device pool: 4 slots handed out by alloc_device / extend never freed (free_device) or "
        "inserted into the tree",
    ]
    asynccache_cache.abort_req(req)
    asynccache_cache.free_device(slots)
    await assert_quiescent(asynccache_cache)


async def test_file_storage_is_laid_out_for_the_cache(asynccache_cache: HierarchicalCache,
                                                      asynccache_file_storage: Any,
                                                      tmp_path: Any) -> None:
    assert asynccache_file_storage.layout == asynccache_cache.storage_layout()
    assert asynccache_file_storage.root.is_relative_to(tmp_path)


async def test_the_s3_server(asynccache_s3: S3Server, asynccache_cache: HierarchicalCache) -> None:
    assert asynccache_s3.endpoint.startswith("http://127.0.0.1:")
    url = asynccache_s3.url("via-url")
    backend = await open_backend(url, asynccache_cache.storage_layout(),
                                 **asynccache_s3.backend_kwargs())
    try:
        key = "ab" * 32
        assert await backend.set_batch([key], [b"x" * 64]) == [True]
        assert await backend.exists_prefix([key]) == 1
        assert await backend.clear() == 1
    finally:
        await backend.aclose()


# ---------------------------------------------------------------------------- asynccache_kv
def test_prompts_are_deterministic(asynccache_kv: KVFactory, request: pytest.FixtureRequest) -> None:
    assert asynccache_kv.seed == zlib.crc32(request.node.nodeid.encode())
    a, b = KVFactory(seed=3), KVFactory(seed=3)
    assert a.prompt(10) == b.prompt(10) and a.prompt(5) == b.prompt(5)
    fam = a.family(6, [2, 3])
    assert fam[0][:6] == fam[1][:6] and [len(p) for p in fam] == [8, 9]
    assert a.prompt(2, prefix=[1, 2]) [:2] == [1, 2] and 0 not in a.prompt(500)


def test_expected_kv_is_kvgen_and_namespaces_differ(asynccache_kv: KVFactory) -> None:
    shape = small_config()
    from asynccache.transfers.pools import KVShape

    kvshape = KVShape(shape.num_layers, shape.num_heads, shape.head_dim, shape.torch_dtype)
    toks = asynccache_kv.prompt(6)
    plain = asynccache_kv.expected(kvshape, toks, 2)
    assert torch.equal(plain, expected_kv(kvshape, np.array(toks[2:]), np.arange(2, 6)))
    lora = asynccache_kv.expected(kvshape, toks, 2, extra_key="lora-1")
    assert not torch.equal(plain.view(torch.int16), lora.view(torch.int16))


async def test_check_names_wrong_positions_and_slots(asynccache_cache: HierarchicalCache,
                                                     asynccache_kv: KVFactory) -> None:
    toks = asynccache_kv.prompt(8)
    slots = await asynccache_cache.alloc_device(8)
    asynccache_kv.write(asynccache_cache, slots, toks)
    assert asynccache_kv.check(asynccache_cache, toks, slots) == 8
    swapped = slots.copy()
    swapped[[2, 5]] = slots[[5, 2]]
    with pytest.raises(KVMismatchError, match=(
        rf"probe: 2 of 8 tokens differ from the KV of their tokens: position 2 "
        rf"\(slot {slots[5]}\), position 5 \(slot {slots[2]}\)")):
        asynccache_kv.check(asynccache_cache, toks, swapped, what="probe")
    asynccache_cache.free_device(slots)


async def test_serve_chunks_namespaces_and_unfinished_requests(
    asynccache_cache: HierarchicalCache, asynccache_kv: KVFactory
) -> None:
    prompt = asynccache_kv.prompt(30)
    first = await asynccache_kv.serve(asynccache_cache, prompt, chunk=8)
    assert (first.computed, first.device_hit) == (30, 0)
    other_ns = await asynccache_kv.serve(asynccache_cache, prompt, extra_key="lora-7")
    assert other_ns.device_hit == 0  # namespaces never share KV
    again = await asynccache_kv.serve(asynccache_cache, prompt, finish=False)
    assert (again.device_hit, again.verified) == (28, 28)  # whole pages only
    assert asynccache_kv.check_request(asynccache_cache, again.request) == 30
    asynccache_cache.cache_finished_req(again.request)


@pytest.mark.asynccache_config(write_policy="write_through")
async def test_an_open_prefetch_is_named(asynccache_cache: HierarchicalCache,
                                         asynccache_file_storage: Any,
                                         asynccache_kv: KVFactory) -> None:
    from asynccache.l3 import StoragePolicy

    cache = asynccache_cache
    cache.attach_storage(asynccache_file_storage, StoragePolicy(prefetch_threshold=0))
    prompt = asynccache_kv.prompt(16)
    await asynccache_kv.serve(cache, prompt)
    await assert_quiescent(cache)  # copies and storage writes done
    cache.evict(cache.evictable_size)
    cache.evict_host(cache.host_size)  # only in storage now
    op = cache.start_prefetch(prompt, cache.match_prefix(prompt))
    assert op is not None and cache.storage is not None
    problems = await find_leaks(cache)
    assert problems[0].startswith(
        "1 lock receipt still held: node 0 (host, pinned by an unfinished storage prefetch)")
    assert problems[1] == ("1 storage prefetch started and never finished (call "
                           "storage.finish_prefetch() or abort_prefetch())")
    await cache.storage.abort_prefetch(op)
    assert await find_leaks(cache) == []
