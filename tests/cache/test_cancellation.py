"""Cancellation at every await point: the coroutine under test runs as a task that is cancelled
after k loop iterations, for k = 0, 1, 2, ... until it completes on its own. After each try the
cache is flushed and must hold no lock the test did not take, balance its pools
(``sanity_check``) and still serve a bit-exact hit."""

from __future__ import annotations

import asyncio

import pytest

MAX_K = 400


class Sweep:
    """Bookkeeping of one k-sweep: how each try ended and whether a copy was in flight."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []
        self.cancelled_in_flight = 0

    async def run(self, cache, kit, make, k):
        seen: list[int] = []
        outcome, result = await kit.run_cancelled(make, k, lambda: seen.append(cache.in_flight))
        if outcome == "cancelled" and seen and seen[0]:
            self.cancelled_in_flight += 1
        self.outcomes.append(outcome)
        return outcome, result

    @property
    def done(self) -> bool:
        return bool(self.outcomes) and self.outcomes[-1] == "completed"

    def check(self, *, need_in_flight: bool = True) -> None:
        assert self.done, f"never completed in {len(self.outcomes)} tries"
        assert "cancelled" in self.outcomes
        if need_in_flight:
            assert self.cancelled_in_flight >= 1, self.outcomes


async def _host_only(cache, kit, model, tokens):
    """Make ``tokens`` cached on host only (back up, then evict everything from the device)."""
    r = await kit.serve(cache, model, tokens)
    assert r.finished
    await cache.flush()
    await cache.evict_async(10**6)
    await cache.flush()
    m = cache.match_prefix(tokens)
    cached = len(tokens) - len(tokens) % cache.page_size
    assert (m.device_prefix_len, m.host_hit_length) == (0, cached)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
async def test_cancel_load_back_request(make_cache, kit, policy):
    cache = await make_cache(write_policy=policy, device_tokens=64, host_tokens=128)
    model = kit.KVModel.of(cache)
    tokens = list(range(7, 33))  # 24 cached tokens + a tail
    if policy == "write_through_selective":
        await kit.serve(cache, model, tokens)  # first hit; the second (below) backs it up
    sweep = Sweep()
    for k in range(MAX_K):
        await _host_only(cache, kit, model, tokens)
        req = cache.admit(tokens)
        assert req.host_hit_length == 24
        outcome, n = await sweep.run(cache, kit, lambda req=req: cache.load_back_request(req), k)
        if outcome == "completed":
            assert n == 24 and req.prefix_len == 24
            model.check(cache, tokens, req.slots)
        else:
            assert req.prefix_len == 0 and req.computed == 0
        # Only the request's own pins: its device lock, plus the pin on its host hit while that
        # was not loaded (a request cancelled before load_back_request ran keeps it until finish).
        assert cache.tree.held_locks == 1 + (req.host_receipt is not None)
        cache.cache_finished_req(req)
        await kit.quiesce_and_check(cache)
        again = await kit.serve(cache, model, tokens, finish=False)
        assert again.prefix_len == 24  # loaded (or already loaded by the cancelled try)
        cache.cache_finished_req(again)
        await kit.quiesce_and_check(cache)
        if sweep.done:
            break
    sweep.check()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_cancel_load_back(make_cache, kit, policy):
    cache = await make_cache(write_policy=policy)
    model = kit.KVModel.of(cache)
    tokens = list(range(300, 320))
    sweep = Sweep()
    for k in range(MAX_K):
        await _host_only(cache, kit, model, tokens)
        m = cache.match_prefix(tokens)
        outcome, lb = await sweep.run(cache, kit, lambda m=m: cache.load_back(m), k)
        if outcome == "completed":
            assert lb is not None and lb.receipt is not None
            assert cache.tree.held_locks == 1
            model.check(cache, tokens, lb.device_indices)
            cache.release_load(lb)
        await kit.quiesce_and_check(cache)
        m2 = cache.match_prefix(tokens)
        # The copy was never cancelled: it completed and committed even if its awaiter did not.
        assert m2.device_prefix_len + m2.host_hit_length == 20
        again = await kit.serve(cache, model, tokens)
        assert again.finished
        await kit.quiesce_and_check(cache)
        if sweep.done:
            break
    sweep.check()


async def test_cancel_while_awaiting_a_layer(make_cache, kit):
    """A forward pass waiting on ``lb.layer(i)`` is cancelled: the load still completes."""
    cache = await make_cache(write_policy="write_through", num_layers=4)
    model = kit.KVModel.of(cache)
    tokens = list(range(60, 80))
    await _host_only(cache, kit, model, tokens)
    lb = cache.begin_load_back(cache.match_prefix(tokens))
    assert lb is not None
    async def forward():
        return await lb.layer(3)

    waiter = asyncio.ensure_future(forward())
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.wait({waiter}, timeout=kit.TIMEOUT)
    assert waiter.cancelled() or waiter.result().layer == 3
    await asyncio.wait_for(lb.wait(), kit.TIMEOUT)
    model.check(cache, tokens, lb.device_indices)
    cache.release_load(lb)
    await kit.quiesce_and_check(cache)


async def test_cancel_waiting_for_another_requests_load(make_cache, kit):
    """load_back_request waiting on a load someone else started (``pending_loads``)."""
    cache = await make_cache(write_policy="write_through")
    model = kit.KVModel.of(cache)
    tokens = list(range(90, 110))
    sweep = Sweep()
    for k in range(MAX_K):
        await _host_only(cache, kit, model, tokens)
        lb = cache.begin_load_back(cache.match_prefix(tokens))
        assert lb is not None
        req = cache.admit(tokens)  # sees the loading prefix as a host hit with a pending load
        assert (req.prefix_len, req.host_hit_length) == (0, 20)
        assert req.pending_loads == (lb.op_id,)
        outcome, n = await sweep.run(cache, kit, lambda req=req: cache.load_back_request(req), k)
        if outcome == "completed":
            assert n == 20 and req.prefix_len == 20 and req.pending_loads == ()
            model.check(cache, tokens, req.slots)
        cache.cache_finished_req(req)
        await asyncio.wait_for(lb.wait(), kit.TIMEOUT)
        cache.release_load(lb)
        await kit.quiesce_and_check(cache)
        again = await kit.serve(cache, model, tokens)
        assert again.finished
        if sweep.done:
            break
    sweep.check()


async def _fill_unbacked(cache, kit, model, seqs):
    """Write-back: wipe both tiers, then fill the device with un-backed (never copied) KV."""
    await cache.flush()
    await cache.evict_async(10**6)
    cache.evict_host(10**6)
    assert cache.tree.node_count == 0
    for s in seqs:
        await kit.serve(cache, model, s)
    assert cache.host_size == 0 and cache.in_flight == 0
    assert cache.device_available == 0


def _wb_seqs():
    return [[1000 * (i + 1) + j for j in range(8)] for i in range(4)]


async def _verify_all(cache, kit, model, seqs):
    for s in seqs:
        m = cache.match_prefix(s)
        assert m.device_prefix_len + m.host_hit_length == 8, "write-back lost KV (host had room)"
        # served bit-exact, loaded back or (see test_bugs: write-back load skip) recomputed
        await kit.serve(cache, model, s)
        await kit.quiesce_and_check(cache)


async def test_cancel_alloc_device_write_back(make_cache, kit):
    cache = await make_cache(write_policy="write_back", device_tokens=32, host_tokens=128)
    model = kit.KVModel.of(cache)
    seqs = _wb_seqs()
    sweep = Sweep()
    for k in range(MAX_K):
        await _fill_unbacked(cache, kit, model, seqs)
        outcome, slots = await sweep.run(cache, kit, lambda: cache.alloc_device(16), k)
        held = cache.device_pool.allocator.used_size - cache.tree.device_size
        if outcome == "completed":
            assert len(slots) == 16 and held == 16
            cache.free_device(slots)
        else:
            assert held == 0  # a cancelled allocation hands out nothing
        await kit.quiesce_and_check(cache)
        await _verify_all(cache, kit, model, seqs)
        if sweep.done:
            break
    sweep.check()


async def test_cancel_extend_write_back(make_cache, kit):
    cache = await make_cache(write_policy="write_back", device_tokens=32, host_tokens=128)
    model = kit.KVModel.of(cache)
    seqs = _wb_seqs()
    fresh = list(range(5000, 5014))
    sweep = Sweep()
    for k in range(MAX_K):
        await _fill_unbacked(cache, kit, model, seqs)
        req = cache.admit(fresh)
        outcome, new = await sweep.run(cache, kit, lambda req=req: cache.extend(req, 14), k)
        if outcome == "completed":
            assert len(new) == 14 and req.computed == 14
            cache.write_kv(new, model.expected(fresh))
            cache.cache_finished_req(req)
        else:
            assert req.computed == 0
            cache.abort_req(req)
        await kit.quiesce_and_check(cache)
        await _verify_all(cache, kit, model, seqs)
        if sweep.done:
            break
    sweep.check()


async def test_cancel_evict_async_write_back(make_cache, kit):
    cache = await make_cache(write_policy="write_back", device_tokens=32, host_tokens=128)
    model = kit.KVModel.of(cache)
    seqs = _wb_seqs()
    sweep = Sweep()
    for k in range(MAX_K):
        await _fill_unbacked(cache, kit, model, seqs)
        outcome, n = await sweep.run(cache, kit, lambda: cache.evict_async(16), k)
        if outcome == "completed":
            assert n == 16
            assert cache.device_available == 16
        await kit.quiesce_and_check(cache)
        # Copies of a cancelled call still commit: those nodes are backed up (not lost).
        assert cache.tree.device_size + cache.device_available == 32
        await _verify_all(cache, kit, model, seqs)
        if sweep.done:
            break
    sweep.check()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_cancel_flush(make_cache, kit, policy):
    cache = await make_cache(write_policy=policy, device_tokens=64, host_tokens=256)
    model = kit.KVModel.of(cache)
    sweep = Sweep()
    for k in range(MAX_K):
        tokens = [7000 + 50 * k + j for j in range(16)]
        await cache.evict_async(10**6)  # only the new, un-backed tokens stay on device
        await kit.serve(cache, model, tokens)
        if policy == "write_back":
            cache.evict(16)  # starts write-back copies, demoted by a later evict
        assert cache.in_flight >= 1
        outcome, _ = await sweep.run(cache, kit, cache.flush, k)
        if outcome == "completed":
            assert cache.in_flight == 0
        await kit.quiesce_and_check(cache)
        assert cache.host_size >= 16
        await cache.evict_async(10**6)
        r = await kit.serve(cache, model, tokens, finish=False)
        assert r.prefix_len == 16
        cache.cache_finished_req(r)
        await kit.quiesce_and_check(cache)
        if sweep.done:
            break
    sweep.check()


async def test_cancel_before_first_step_leaves_nothing(make_cache, kit):
    """k = 0 for every coroutine at once: none ever ran, nothing changed."""
    cache = await make_cache(write_policy="write_back", device_tokens=32)
    model = kit.KVModel.of(cache)
    seqs = _wb_seqs()
    await _fill_unbacked(cache, kit, model, seqs)
    before = (cache.tree.device_size, cache.host_size, cache.device_available)
    for make in (lambda: cache.alloc_device(8), lambda: cache.evict_async(8), cache.flush):
        outcome, _ = await kit.run_cancelled(make, 0)
        assert outcome == "cancelled"
    assert (cache.tree.device_size, cache.host_size, cache.device_available) == before
    await kit.quiesce_and_check(cache)
