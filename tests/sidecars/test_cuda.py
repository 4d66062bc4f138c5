"""Sidecars on CUDA pools (the staged copy engine, pinned host pools, fences): the round trips
of the CPU tests, bit-exact; skipped without CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asynccache.l3 import StoragePolicy

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOKENS = list(range(1000, 1042))  # 10 pages + 2


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_cuda_backup_and_layerwise_load_back(make_cache, kit, policy):
    cache = await make_cache(device="cuda", write_policy=policy, device_tokens=256,
                             host_tokens=512)
    assert all(s.device.device.type == "cuda" and s.host.pinned for s in cache.sidecars)
    model = kit.SidecarModel(cache)
    await kit.serve(cache, model, TOKENS)
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    await asyncio.wait_for(cache.evict_async(10**6), kit.TIMEOUT)
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    model.clobber()
    m = cache.match_prefix(TOKENS)
    lb = cache.begin_load_back(m)
    assert lb is not None
    await asyncio.wait_for(lb.sidecar_layer("draft", 0), kit.TIMEOUT)
    await asyncio.wait_for(lb.wait(), kit.TIMEOUT)
    model.check(TOKENS, lb.device_indices, "CUDA load-back")
    cache.release_load(lb)


async def test_cuda_retraction(make_cache, kit):
    cache = await make_cache(device="cuda", retraction_backup=True, device_tokens=128,
                             host_tokens=128)
    model = kit.SidecarModel(cache)
    req = cache.admit(TOKENS)
    new = await cache.extend(req, len(TOKENS))
    model.write(new, TOKENS, 0, len(TOKENS))
    await asyncio.wait_for(cache.retract(req), kit.TIMEOUT)
    await kit.clobber_device(cache, model)
    await asyncio.wait_for(cache.restore(req), kit.TIMEOUT)
    model.check(TOKENS, req.slots, "CUDA restore")
    cache.cache_finished_req(req)


async def test_cuda_storage_round_trip(make_cache, kit, make_file_backend):
    policy = StoragePolicy(prefetch_threshold=4)
    a = await make_cache(device="cuda", write_policy="write_through", device_tokens=256,
                         host_tokens=512, host_layout="page_first")
    a.attach_storage(await make_file_backend(a), policy)
    await kit.serve(a, kit.SidecarModel(a), TOKENS)
    await asyncio.wait_for(a.flush(), kit.TIMEOUT)
    await asyncio.wait_for(a.storage.drain(), kit.TIMEOUT)
    await a.detach_storage()
    await a.aclose()
    b = await make_cache(device="cuda", write_policy="write_through", device_tokens=256,
                         host_tokens=512, host_layout="page_first")
    b.attach_storage(await make_file_backend(b), policy)
    req, fetched = await kit.fetch_and_serve(b, kit.SidecarModel(b), TOKENS)
    assert fetched == 40 and req.prefix_len == 40
