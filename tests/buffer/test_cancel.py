"""Cancelling a buffer-mode request or flush at any await, or detaching mid-flight, leaks nothing:
no host staging, no device slot, no lock; accounting balances and later requests are served
bit for bit."""

from __future__ import annotations

import asyncio
from typing import Any

from asynccache.l3 import StoragePolicy
from asynccache.testing.cancel import sweep_cancellations

POLICY = StoragePolicy(prefetch_threshold=16)
N = 600  # 150 pages: two read batches (128 + 22)


async def _stored(kit, make_cache, make_file_backend, seqs) -> None:
    w = await make_cache()
    w.attach_storage(await make_file_backend(w), POLICY)
    await kit.write_sequences(w, seqs)
    await kit.quiesce(w)
    await w.detach_storage()
    await w.aclose()


async def _settled(c) -> None:
    """Wait for storage threads abandoned by a cancelled read (while they run the file backend
    answers new calls as "unavailable"), then for copies and writes."""
    async def drained() -> None:
        while c.storage.backend.stats()["stuck_threads"]:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(drained(), 10.0)
    await asyncio.sleep(0)


async def test_cancel_a_request_at_every_await(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(50, N)
    await _stored(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), POLICY)
    results: list[tuple[int, int]] = []

    async def serve() -> tuple[int, int]:
        return await kit.serve_plain(c, s)

    async def check(outcome: Any) -> None:
        await _settled(c)
        await kit.quiesce(c)
        assert c.storage.staged_requests == 0
        if outcome.completed:
            results.append(outcome.result)
        c.evict(10**6)  # the next run fetches again
        kit.assert_at_rest(c)
        assert c.tree.device_size == 0

    # Every await of the request's own coroutine (the storage I/O runs in the fetch task)...
    outcomes = await sweep_cancellations(serve, check=check)
    assert results[-1] == (N, N)
    assert sum(o.cancelled for o in outcomes) == len(outcomes) - 1 >= 3
    # ...and after k loop turns, which lands inside the fetch task's hit query and read batches
    # and inside the H->D copy.
    seen: dict[str, int] = {}
    k = 0
    while True:
        task = asyncio.ensure_future(serve())
        for _ in range(k):
            if task.done():
                break
            await asyncio.sleep(0)
        if task.done():
            assert task.result() == (N, N)
            await check(type("Done", (), {"completed": False})())
            break
        state = _state(c)
        seen[state] = seen.get(state, 0) + 1
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=kit.TIMEOUT)
        assert done and (task.cancelled() or task.result() == (N, N)), state
        await check(type("Cancelled", (), {"completed": False})())
        k = k + 1 if k < 64 else k + k // 8
    assert k > 3, seen
    # Nothing was ever written back: every page came from storage or was believed stored.
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 0


def _state(c) -> str:
    p = c.storage
    if p.reads._loads:
        return "loading"
    if not p.reads._fetches:
        return "between steps"
    op = next(iter(p.reads._fetches))
    if op.host_slots is None:
        return "querying storage"
    return f"reading ({op.completed_tokens} tokens in)"


async def test_cancel_flush_and_drain_at_every_await(kit, make_cache, make_file_backend) -> None:
    c = await make_cache()
    backend = await make_file_backend(c)
    c.attach_storage(backend, POLICY)
    written: list[list[str]] = []

    async def write_one() -> None:
        s = kit.tokens(100 + len(written), 64)
        written.append(kit.page_keys(s))
        slots = c.try_alloc_device(64)
        c.write_kv(slots, kit.expected(c, s))
        c.insert(s, slots)
        await c.flush()
        await c.storage.drain()

    async def check(outcome: Any) -> None:
        await kit.quiesce(c)  # a cancelled flush never stops the writes it started
        if outcome.k:  # (cancelled at k = 0, the coroutine never ran)
            assert await backend.exists_prefix(written[-1]) == 16
        kit.assert_at_rest(c)

    outcomes = await sweep_cancellations(write_one, check=check)
    assert len(outcomes) >= 3 and len(written) == len(outcomes) - 1
    assert kit.counter(c, "asynccache_storage_backup_tokens") == len(written) * 64


async def test_detach_mid_flight_releases_everything(kit, make_cache, make_file_backend) -> None:
    seqs = [kit.tokens(60 + i, 160) for i in range(2)]
    await _stored(kit, make_cache, make_file_backend, seqs)
    c = await make_cache(host_tokens=256)
    backend = await make_file_backend(c)
    c.attach_storage(backend, POLICY)
    p = c.storage
    r0, r1 = c.admit(seqs[0]), c.admit(seqs[1])
    assert await c.prefetch_request(r0, policy="wait_complete") == 160  # parked bounce
    t1 = asyncio.ensure_future(c.prefetch_request(r1, policy="wait_complete"))

    async def parked() -> None:
        while not p.reads._parked:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(parked(), kit.TIMEOUT)
    z = kit.tokens(69, 40)
    slots = c.try_alloc_device(40)
    c.write_kv(slots, kit.expected(c, z))
    c.insert(z, slots)  # a queued write intent
    assert p.queued_intents == 1
    await asyncio.wait_for(c.detach_storage(), kit.TIMEOUT)
    assert await asyncio.wait_for(t1, kit.TIMEOUT) == 0
    assert c.storage is None and c.host_pool.allocator.used_size == 0
    assert await backend.exists_prefix(kit.page_keys(z)) == 10  # queued writes were flushed
    assert await c.load_back_request(r0) == 0  # its bounce went with the pipeline
    kit.assert_at_rest(c, own_receipts=2)
    c.abort_req(r0)
    c.abort_req(r1)
    kit.assert_at_rest(c)
    assert kit.outcomes(c) == {"issued": 2, "completed": 1, "aborted": 1}


async def test_aclose_with_staged_bounces_frees_the_pool(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(70, 64)
    await _stored(kit, make_cache, make_file_backend, [s])
    c = await make_cache(strict=False)
    c.attach_storage(await make_file_backend(c), POLICY)
    req = c.admit(s)
    assert await c.prefetch_request(req, policy="wait_complete") == 64
    await asyncio.wait_for(c.aclose(), kit.TIMEOUT)
    assert c.host_pool.allocator.used_size == 0 and c.device_pool.allocator.used_size == 0


async def test_cancelled_parked_fetch_leaves_the_line(kit, make_cache, make_file_backend) -> None:
    seqs = [kit.tokens(80 + i, 160) for i in range(3)]
    await _stored(kit, make_cache, make_file_backend, seqs)
    c = await make_cache(host_tokens=256)
    c.attach_storage(await make_file_backend(c), POLICY)
    p = c.storage
    reqs = [c.admit(s) for s in seqs]
    assert await c.prefetch_request(reqs[0], policy="wait_complete") == 160
    t1 = asyncio.ensure_future(c.prefetch_request(reqs[1], policy="wait_complete"))
    t2 = asyncio.ensure_future(c.prefetch_request(reqs[2], policy="wait_complete"))

    async def parked(n: int) -> None:
        while len(p.reads._parked) < n:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(parked(2), kit.TIMEOUT)
    t1.cancel()
    await asyncio.wait({t1}, timeout=kit.TIMEOUT)
    assert t1.cancelled()
    assert [op.key for op in p.reads._parked] == [reqs[2].key]
    assert await c.load_back_request(reqs[0]) == 160  # frees its bounce: request 2 is next
    assert await asyncio.wait_for(t2, kit.TIMEOUT) == 160
    assert await c.load_back_request(reqs[2]) == 160
    kit.assert_kv(c, seqs[2], reqs[2].slots, "request 2")
    for r in reqs:
        c.abort_req(r)
    kit.assert_at_rest(c)
    assert kit.outcomes(c) == {"issued": 3, "completed": 2, "aborted": 1}


async def test_cancelled_head_of_line_lets_a_smaller_fetch_through(kit, make_cache,
                                                                  make_file_backend) -> None:
    big, small, held = kit.tokens(85, 200), kit.tokens(86, 40), kit.tokens(87, 120)
    await _stored(kit, make_cache, make_file_backend, [big, small, held])
    c = await make_cache(host_tokens=256)  # reads: 230 tokens
    c.attach_storage(await make_file_backend(c), POLICY)
    p = c.storage
    r_held, r_big, r_small = c.admit(held), c.admit(big), c.admit(small)
    assert await c.prefetch_request(r_held, policy="wait_complete") == 120
    t_big = asyncio.ensure_future(c.prefetch_request(r_big, policy="wait_complete"))

    async def parked(n: int) -> None:
        while len(p.reads._parked) < n:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(parked(1), kit.TIMEOUT)  # 120 + 200 > 230: waits
    t_small = asyncio.ensure_future(c.prefetch_request(r_small, policy="wait_complete"))
    await asyncio.wait_for(parked(2), kit.TIMEOUT)  # 120 + 40 fits, but it is not first in line
    t_big.cancel()
    await asyncio.wait({t_big}, timeout=kit.TIMEOUT)
    assert t_big.cancelled()
    assert await asyncio.wait_for(t_small, kit.TIMEOUT) == 40  # no free needed to move on
    assert p.occupied == 160
    for r in (r_held, r_big, r_small):
        c.abort_req(r)
    kit.assert_at_rest(c)
