"""The facade on a CUDA device pool (staged copy engine, pinned host pool); skipped without CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
async def test_cuda_round_trip_bit_exact(make_cache, kit, policy, dtype):
    cache = await make_cache(device="cuda", write_policy=policy, dtype=dtype,
                             device_tokens=256, host_tokens=512)
    assert cache.device_pool.device.type == "cuda"
    assert cache.host_pool.pinned
    model = kit.KVModel.of(cache)
    seqs = [list(range(1, 41)), list(range(1, 17)) + list(range(90, 111))]
    for s in seqs:
        await kit.serve(cache, model, s)
        if policy == "write_through_selective":
            await kit.serve(cache, model, s)
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    await asyncio.wait_for(cache.evict_async(10**6), kit.TIMEOUT)
    assert cache.tree.device_size == 0
    for s in seqs:
        req = cache.admit(s)
        await asyncio.wait_for(cache.load_back_request(req), kit.TIMEOUT)
        assert req.prefix_len == len(s) - len(s) % 4
        model.check(cache, s, req.slots)
        cache.cache_finished_req(req)
    await kit.quiesce_and_check(cache)


async def test_cuda_cancel_load_back(make_cache, kit):
    cache = await make_cache(device="cuda", write_policy="write_through")
    model = kit.KVModel.of(cache)
    tokens = list(range(5, 29))
    for k in range(200):
        await kit.serve(cache, model, tokens)
        await cache.flush()
        await cache.evict_async(10**6)
        req = cache.admit(tokens)
        outcome, _ = await kit.run_cancelled(lambda req=req: cache.load_back_request(req), k)
        cache.cache_finished_req(req)
        await kit.quiesce_and_check(cache)
        again = await kit.serve(cache, model, tokens, finish=False)
        assert again.prefix_len == 24
        cache.cache_finished_req(again)
        await kit.quiesce_and_check(cache)
        if outcome == "completed":
            break
    else:
        raise AssertionError("load_back_request never completed")


async def test_cuda_bound_compute_stream_orders_backups_after_a_side_stream_forward(make_cache,
                                                                                  kit):
    """The forward writes KV on a side stream; with the stream bound, the write-through backup
    waits for it, and the KV loaded back is bit exact (the fence contract)."""
    cache = await make_cache(device="cuda", write_policy="write_through", device_tokens=256,
                             host_tokens=512)
    side = torch.cuda.Stream()
    cache.bind_compute_stream(side)
    assert cache.copy_engine.compute_stream is side
    model = kit.KVModel.of(cache)
    s = list(range(1, 65))
    req = cache.admit(s)
    slots = await cache.extend(req, len(s))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # a slow kernel ahead of the write, on the side stream
        cache.write_kv(slots, model.expected(s))
    cache.cache_finished_req(req)  # starts the backup from this (default) stream
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    await asyncio.wait_for(cache.evict_async(10**6), kit.TIMEOUT)
    req = cache.admit(s)
    await asyncio.wait_for(cache.load_back_request(req), kit.TIMEOUT)
    model.check(cache, s, req.slots)
    cache.cache_finished_req(req)
    await kit.quiesce_and_check(cache)
