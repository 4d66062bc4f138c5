"""Cancellation sweeps with sidecars: a load-back or a storage prefetch cancelled after k loop
turns (k = 0, 1, 2, ... until the call completes first) leaks no lock, slot or host page, and
the next request is still served bit-exact (KV and sidecars)."""

from __future__ import annotations

import asyncio

import pytest

from asynccache.l3 import StoragePolicy

SEQ = list(range(7000, 7000 + 4 * 24 + 1))  # 24 pages
N = 96
POLICY = StoragePolicy(prefetch_threshold=4)
CONFIG = {"device_tokens": 256, "host_tokens": 512, "write_policy": "write_through",
          "host_layout": "page_first"}


async def _at_rest(cache):
    await asyncio.wait_for(cache.flush(), 20)
    if cache.storage is not None:
        await asyncio.wait_for(cache.storage.drain(), 20)
    cache.sanity_check()
    assert cache.in_flight == 0 and cache.tree.pending_ops == 0
    assert cache.host_in_flight == 0
    assert cache.tree.held_locks == 0


def _steps():
    k = 0
    while k < 2000:
        yield k
        k = k + 1 if k < 24 else k + k // 4


async def _sweep(cache, call, after_each):
    """Cancel ``call(req)`` after k turns for growing k until it completes first; returns
    the outcomes seen."""
    seen = {"cancelled": 0, "done": 0}
    for k in _steps():
        req = cache.admit(SEQ)
        task = asyncio.ensure_future(call(req))
        for _ in range(k):
            if task.done():
                break
            await asyncio.sleep(0)
        finished = task.done()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=20)
        assert done
        how = "cancelled" if task.cancelled() else "done"
        assert how == "done" or not finished
        seen[how] += 1
        cache.abort_req(req)
        await _at_rest(cache)
        await after_each()
        if how == "done" and finished:
            return seen
    raise AssertionError(f"the call never completed first: {seen}")


async def test_cancel_load_back_sweep(make_cache, kit):
    cache = await make_cache(**CONFIG)
    model = kit.SidecarModel(cache)
    await kit.serve(cache, model, SEQ)

    async def demote():
        await cache.evict_async(10_000)
        await cache.flush()
        model.clobber()

    await demote()
    seen = await _sweep(cache, cache.load_back_request, demote)
    assert seen["cancelled"] >= 1
    req = await kit.serve(cache, model, SEQ)  # loads back, checks KV and sidecars
    assert req.prefix_len == N


@pytest.mark.parametrize("host_mode", ["cache", "buffer_only"])
async def test_cancel_prefetch_sweep(make_cache, kit, make_file_backend, host_mode):
    a = await make_cache(**CONFIG, host_mode=host_mode)
    a.attach_storage(await make_file_backend(a), POLICY)
    await kit.serve(a, kit.SidecarModel(a), SEQ)
    await _at_rest(a)
    await a.detach_storage()
    await a.aclose()

    b = await make_cache(**CONFIG, host_mode=host_mode)
    backend = await make_file_backend(b)
    b.attach_storage(backend, POLICY)
    model = kit.SidecarModel(b)

    async def reset():
        async def drained():
            while backend.stats()["stuck_threads"]:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(drained(), 10)
        await b.flush()
        b.evict(10**6)
        b.evict_host(10**6)
        assert b.host_size == 0 and b.tree.device_size == 0

    seen = await _sweep(b, lambda req: b.prefetch_request(req, policy="wait_complete"), reset)
    assert seen["cancelled"] >= 3, seen
    model.clobber()
    req, fetched = await kit.fetch_and_serve(b, model, SEQ)
    assert fetched == N and req.prefix_len == N
