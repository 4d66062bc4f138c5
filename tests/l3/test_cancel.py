"""Aborting or cancelling a prefetch at any point leaks nothing.

After every cancellation: no lock is held but the request's own, no prefetch is registered, the
prefetch occupancy is zero, nothing half-fetched is in the tree, host accounting balances
(``sanity_check``), and a later request still fetches and serves correct KV.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asynccache.l3 import StoragePolicy
from asynccache.storage.faults import FaultKind, FaultRule

N = 600  # 150 pages: two read batches (128 + 22)


async def _prepared(kit, make_cache, make_file_backend, **policy: Any):
    s = kit.tokens(21, N)
    w = await make_cache()
    w.attach_storage(await make_file_backend(w), StoragePolicy(prefetch_threshold=16))
    await kit.write_sequences(w, [s])
    await kit.quiesce(w)
    await w.detach_storage()
    await w.aclose()
    c = await make_cache()
    backend = await make_file_backend(c, [])  # a fault injector without rules (yet)
    c.attach_storage(backend, StoragePolicy(prefetch_threshold=16, **policy))
    return c, s, backend


def _state(c) -> str:
    ops = list(c.storage._prefetches)
    if not ops:
        return "no prefetch yet"
    op = ops[0]
    if op.host_slots is None:
        return "querying storage"
    if op.completed_tokens == 0:
        return "reading batch 1"
    if op.completed_tokens < N:
        return "reading batch 2"
    return "fetched, not inserted"


def _own_receipts(req) -> int:
    return (req.receipt is not None) + (req.host_receipt is not None)


async def _cancel_after(c, req, policy: str, turns: int, when=None) -> tuple[str, Any, str]:
    """Run ``prefetch_request`` as a task; after ``turns`` loop turns (or once ``when()``
    holds) cancel it. Returns (how it ended, its result, where it was when cancelled)."""
    task = asyncio.ensure_future(c.prefetch_request(req, policy=policy))
    if when is None:
        for _ in range(turns):
            if task.done():
                break
            await asyncio.sleep(0)
    else:
        async def until() -> None:
            while not when() and not task.done():
                await asyncio.sleep(0.001)

        await asyncio.wait_for(until(), 10.0)
    if task.done():
        return "done", task.result(), "done"
    state = _state(c)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=20.0)
    assert done, "a cancelled prefetch_request did not finish"
    if task.cancelled():
        return "cancelled", None, state
    return "completed after cancel", task.result(), state


async def _reset(c) -> None:
    """Drop everything from host and device so the next round fetches again, once the storage
    threads abandoned by a cancelled read are done (while they run, the file backend fails
    new calls fast as "unavailable": a miss, by design, which is not what this test is about)."""
    async def drained() -> None:
        while c.storage.backend.stats()["stuck_threads"]:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(drained(), 10.0)
    await c.flush()
    c.evict(10**6)
    c.evict_host(10**6)
    assert c.host_size == 0 and c.tree.device_size == 0


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
async def test_cancel_prefetch_request_at_every_await(kit, make_cache, make_file_backend,
                                                      policy) -> None:
    c, s, _ = await _prepared(kit, make_cache, make_file_backend, timeout_base_s=60.0)
    seen: dict[str, int] = {}
    k = 0
    for _ in range(5000):
        req = c.admit(s)
        assert _own_receipts(req) == 1
        how, got, state = await _cancel_after(c, req, policy, k)
        seen[state] = seen.get(state, 0) + 1
        # A cancel is never swallowed: the task either finished first or is cancelled.
        assert how in ("cancelled", "done"), (k, how, state)
        if how == "cancelled":
            # Nothing inserted, nothing held but the request's own lock.
            assert req.host_hit_length == 0
            assert c.host_size == 0
        else:
            assert got == N, (k, got, state, kit.outcomes(c))
            assert c.host_size == N
        kit.assert_at_rest(c, own_receipts=_own_receipts(req))
        c.abort_req(req)
        kit.assert_at_rest(c)
        await _reset(c)
        if how == "done":
            break
        k = k + 1 if k < 64 else k + k // 8
    else:
        raise AssertionError("the prefetch never completed")
    assert seen.get("done") == 1
    for where in ("no prefetch yet", "querying storage", "reading batch 1"):
        assert seen.get(where, 0) > 0, (where, seen)
    # A later request still works.
    r = await kit.serve(c, s, policy=policy)
    assert (r.fetched, r.loaded) == (N, N)


async def test_cancel_between_batches(kit, make_cache, make_file_backend) -> None:
    """Cancelled while batch 2 is stuck on a slow page: batch 1's pages are released too."""
    c, s, backend = await _prepared(kit, make_cache, make_file_backend)
    keys = kit.page_keys(s)
    backend.add_rule(FaultRule(FaultKind.DELAY, ops=frozenset({"read"}),
                               keys=frozenset({keys[128]}), times=1, delay_s=0.5))
    req = c.admit(s)
    how, _, state = await _cancel_after(
        c, req, "wait_complete", 0,
        when=lambda: bool(c.storage._prefetches)
        and next(iter(c.storage._prefetches)).completed_tokens == 512)
    assert (how, state) == ("cancelled", "reading batch 2")
    assert c.host_size == 0
    kit.assert_at_rest(c, own_receipts=1)
    c.abort_req(req)
    assert kit.outcomes(c) == {"issued": 1, "aborted": 1}
    r = await kit.serve(c, s)
    assert (r.fetched, r.loaded) == (N, N)


async def test_abort_prefetch_mid_flight(kit, make_cache, make_file_backend) -> None:
    c, s, backend = await _prepared(kit, make_cache, make_file_backend)
    keys = kit.page_keys(s)
    backend.add_rule(FaultRule(FaultKind.DELAY, ops=frozenset({"read"}),
                               keys=frozenset({keys[0]}), times=1, delay_s=0.5))
    op = c.start_prefetch(s, c.match_prefix(s))
    assert op is not None
    await asyncio.sleep(0.05)
    assert not c.storage.tasks_of(op).task.done()
    await asyncio.wait_for(c.storage.abort_prefetch(op), kit.TIMEOUT)
    assert op.finished
    await c.storage.abort_prefetch(op)  # a second abort is a no-op
    assert kit.outcomes(c) == {"issued": 1, "aborted": 1}
    assert c.host_size == 0
    kit.assert_at_rest(c)
    r = await kit.serve(c, s, policy="wait_complete")
    assert (r.fetched, r.loaded) == (N, N)


@pytest.mark.parametrize("how", ["detach_storage", "aclose"])
async def test_closing_with_an_unawaited_prefetch_in_flight(kit, make_cache, make_file_backend,
                                                            how) -> None:
    c, s, backend = await _prepared(kit, make_cache, make_file_backend)
    keys = kit.page_keys(s)
    backend.add_rule(FaultRule(FaultKind.DELAY, ops=frozenset({"read"}),
                               keys=frozenset({keys[0]}), times=1, delay_s=0.2))
    op = c.start_prefetch(s, c.match_prefix(s))
    assert op is not None
    await asyncio.sleep(0.02)
    await asyncio.wait_for(getattr(c, how)(), kit.TIMEOUT)
    assert op.finished
    assert kit.outcomes(c) == {"issued": 1, "aborted": 1}
    if how == "detach_storage":
        kit.assert_at_rest(c)
        assert c.storage is None


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete"])
async def test_cancel_during_release_is_not_swallowed(kit, make_cache, make_file_backend,
                                                     policy) -> None:
    """Regression: the release waited for the fetch task inside suppress(BaseException), so a
    cancel arriving there (best_effort: at prefetch_request's first await) was swallowed and
    prefetch_request returned 0. Now it releases everything and re-raises."""
    c, s, _ = await _prepared(kit, make_cache, make_file_backend)
    req = c.admit(s)
    how, _, _ = await _cancel_after(c, req, policy, 1)
    assert how == "cancelled"
    kit.assert_at_rest(c, own_receipts=1)
    c.abort_req(req)
    o = kit.outcomes(c)
    assert o["issued"] == 1 and sum(o.values()) == 2  # issued plus exactly one end


@pytest.mark.parametrize("how", ["detach_storage", "aclose"])
async def test_closing_while_a_prefetch_request_waits(kit, make_cache, make_file_backend,
                                                      how) -> None:
    """Regression: close released the in-flight prefetch, then the prefetch_request awaiting it
    released it again (DoubleFreeError, host accounting off by the prefetch's slots)."""
    s = kit.tokens(22, 64)
    w = await make_cache()
    w.attach_storage(await make_file_backend(w), StoragePolicy(prefetch_threshold=16))
    await kit.write_sequences(w, [s])
    await kit.quiesce(w)
    await w.detach_storage()
    c = await make_cache()
    slow = await make_file_backend(c, [FaultRule(FaultKind.DELAY, ops=frozenset({"read"}),
                                                 delay_s=0.5)])
    c.attach_storage(slow, StoragePolicy(prefetch_threshold=16, prefetch_policy="wait_complete"))
    req = c.admit(s)
    task = asyncio.ensure_future(c.prefetch_request(req))
    await asyncio.sleep(0.05)
    assert not task.done()
    await asyncio.wait_for(getattr(c, how)(), kit.TIMEOUT)
    (res,) = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), kit.TIMEOUT)
    assert res == 0, res  # the storage went away: nothing fetched, nothing double-freed
    assert kit.outcomes(c) == {"issued": 1, "aborted": 1}
    if how == "detach_storage":
        kit.assert_at_rest(c, own_receipts=1)
        c.abort_req(req)
        kit.assert_at_rest(c)
        r = await kit.serve(c, s)  # no storage any more: computed, and correct
        assert (r.device, r.fetched, r.loaded) == (0, 0, 0)
        r = await kit.serve(c, s)
        assert (r.device, r.fetched, r.loaded) == (64, 0, 0)


async def test_cancelled_drain_does_not_cancel_the_writes(kit, make_cache, make_file_backend) -> None:
    """A waiter of ``storage.drain()`` that is cancelled leaves the writes running: every page
    still lands in storage (found by the behaviour review of the buffer-only mode)."""
    c = await make_cache()
    slow = await make_file_backend(c, [FaultRule(FaultKind.DELAY, ops=frozenset({"write"}),
                                                 delay_s=0.05)])
    c.attach_storage(slow, StoragePolicy(prefetch_threshold=4))
    s = kit.tokens(7, 32)
    req = c.admit(s)
    await kit.compute_rest(c, req)
    c.cache_finished_req(req)
    await asyncio.wait_for(c.flush(), kit.TIMEOUT)  # the D->H copy commits: the writes start
    waiter = asyncio.ensure_future(c.storage.drain())
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.wait_for(c.storage.drain(), kit.TIMEOUT)
    assert all(kit.object_path(slow.inner, k).exists() for k in kit.page_keys(s))
    kit.assert_at_rest(c)
