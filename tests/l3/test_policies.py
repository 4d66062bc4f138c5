"""Prefetch stop policies, the timeout formula, the threshold, the rate limit, revocation and
host-memory pressure, with exact expected values (behavior.md §1.16)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.l3 import StoragePolicy
from asynccache.storage.faults import FaultKind, FaultRule

# -- the policy object --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "tokens", "want"),
    [
        ({}, 4096, 2.0),  # the default: 1 s + 0.25 s per 1 Ki tokens
        ({}, 0, 1.0),
        ({}, 1024, 1.25),
        ({}, 512, 1.125),
        ({"timeout_base_s": 0.5, "timeout_per_ki_token_s": 2.0}, 512, 1.5),
        ({"timeout_base_s": 0, "timeout_per_ki_token_s": 0.25}, 100 * 1024, 25.0),
        ({"timeout_base_s": 3, "timeout_per_ki_token_s": 0}, 1 << 20, 3.0),
    ],
)
def test_timeout_formula(kwargs, tokens, want) -> None:
    assert StoragePolicy(**kwargs).timeout_s(tokens) == want


def test_policy_defaults() -> None:
    p = StoragePolicy()
    assert (p.prefetch_threshold, p.prefetch_policy, p.timeout_base_s, p.timeout_per_ki_token_s,
            p.prefetch_capacity_fraction) == (256, "best_effort", 1.0, 0.25, 0.5)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"prefetch_policy": "eager"}, "prefetch_policy"),
        ({"prefetch_threshold": -1}, "prefetch_threshold"),
        ({"prefetch_threshold": 1.5}, "prefetch_threshold"),
        ({"prefetch_threshold": True}, "prefetch_threshold"),
        ({"timeout_base_s": -0.1}, "timeout_base_s"),
        ({"timeout_per_ki_token_s": "1"}, "timeout_per_ki_token_s"),
        ({"prefetch_capacity_fraction": 0}, "prefetch_capacity_fraction"),
        ({"prefetch_capacity_fraction": 1.5}, "prefetch_capacity_fraction"),
        ({"write_concurrency": 0}, "write_concurrency"),
    ],
)
def test_bad_policy_values_are_named(kwargs, named) -> None:
    with pytest.raises(ConfigError, match=named):
        StoragePolicy(**kwargs)


async def test_bad_stop_policy_at_call_time(kit, make_cache, make_file_backend) -> None:
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), StoragePolicy(prefetch_threshold=4))
    s = kit.tokens(1, 32)
    await _store(kit, make_cache, make_file_backend, [s])
    op = c.start_prefetch(s, c.match_prefix(s))
    assert op is not None
    with pytest.raises(ConfigError, match="whenever"):
        await c.storage.finish_prefetch(op, "whenever")
    assert await c.storage.finish_prefetch(op, "wait_complete") == 32
    with pytest.raises(InvalidInputError, match="already finished"):
        await c.storage.finish_prefetch(op)
    kit.assert_at_rest(c)


# -- helpers ------------------------------------------------------------------------------------


async def _store(kit, make_cache, make_file_backend, seqs) -> None:
    """Write ``seqs`` to the shared storage directory with a throw-away cache."""
    w = await make_cache(device_tokens=2048, host_tokens=4096)
    w.attach_storage(await make_file_backend(w), StoragePolicy(prefetch_threshold=4))
    await kit.write_sequences(w, seqs)
    await kit.quiesce(w)
    await w.detach_storage()
    await w.aclose()


async def _until(pred, what: str) -> None:
    async def poll() -> None:
        while not pred():
            await asyncio.sleep(0.002)

    try:
        await asyncio.wait_for(poll(), 10.0)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def _host_pages(cache, slots) -> list[torch.Tensor]:
    ps = cache.page_size
    return [cache.host_pool.read_page(int(f)).clone() for f in np.asarray(slots)[::ps]]


# -- stop policies ------------------------------------------------------------------------------


async def test_wait_complete_returns_every_page_of_a_slow_backend(kit, make_cache,
                                                                  make_file_backend) -> None:
    s = kit.tokens(2, 600)  # 150 pages, two batches
    keys = kit.page_keys(s)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    slow = await make_file_backend(c, [FaultRule(
        FaultKind.DELAY, ops=frozenset({"read"}), keys=frozenset(keys[i] for i in (0, 127, 128, 149)),
        delay_s=0.05)])
    c.attach_storage(slow, StoragePolicy(prefetch_threshold=16, prefetch_policy="wait_complete"))
    r = await kit.serve(c, s, policy=None)  # the attached policy's default
    assert (r.fetched, r.loaded) == (600, 600)
    assert slow.injected_total() == 4
    assert kit.outcomes(c) == {"issued": 1, "completed": 1}


async def test_best_effort_right_away_takes_nothing_and_releases_everything(
        kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(3, 64)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), StoragePolicy(prefetch_threshold=16))
    req = c.admit(s)
    got = await asyncio.wait_for(c.prefetch_request(req), kit.TIMEOUT)  # best_effort default
    assert got == 0
    assert req.host_hit_length == 0
    kit.assert_at_rest(c, own_receipts=1)  # only the request's own device lock
    c.abort_req(req)
    o = kit.outcomes(c)
    assert o["issued"] == 1 and sum(o.values()) == 2  # issued plus exactly one end
    # Later requests are not affected.
    r = await kit.serve(c, s)
    assert (r.fetched, r.loaded) == (64, 64)


async def test_best_effort_takes_the_batches_that_arrived(kit, make_cache,
                                                          make_file_backend) -> None:
    """150 pages read in batches of 128; the second batch is stuck on a slow page. Best effort
    takes exactly the first batch, frees the host pages of the second, and the stuck read can
    never write into them afterwards."""
    s = kit.tokens(4, 600)
    keys = kit.page_keys(s)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache(host_layout="page_first")  # the backend reads straight into the pool
    slow = await make_file_backend(c, [FaultRule(
        FaultKind.DELAY, ops=frozenset({"read"}), keys=frozenset({keys[128]}), times=1,
        delay_s=0.5)])
    c.attach_storage(slow, StoragePolicy(prefetch_threshold=16))
    op = c.start_prefetch(s, c.match_prefix(s))
    assert op is not None and op.requested_tokens == 600
    await _until(lambda: op.completed_tokens == 512, "the first batch")
    await _until(lambda: slow.injected_total() == 1, "the second batch to start")
    released = op.host_slots[512:].copy()
    assert len(released) == 88
    got = await asyncio.wait_for(c.storage.finish_prefetch(op, "best_effort"), kit.TIMEOUT)
    assert got == 512
    assert kit.outcomes(c) == {"issued": 1, "partial": 1}
    assert kit.counter(c, "asynccache_prefetched_tokens") == 512
    kit.assert_at_rest(c)
    assert c.match_prefix(s).host_hit_length == 512
    before = _host_pages(c, released)
    await asyncio.sleep(0.6)  # past the stuck read's delay
    after = _host_pages(c, released)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True)), \
        "a cancelled read wrote into host pages it no longer owns"
    # The fetched prefix is correct, and the rest can still be fetched.
    r = await kit.serve(c, s)
    assert (r.device, r.host, r.fetched, r.loaded) == (0, 512, 88, 600)


@pytest.mark.parametrize(("per_ki", "delay", "want"), [(40.0, 0.05, 512), (0.02, 0.3, 0)])
async def test_timeout_policy_uses_base_plus_per_ki_tokens(kit, make_cache, make_file_backend,
                                                           per_ki, delay, want) -> None:
    """128 pages (512 tokens), the first one slow: with 40 s per 1 Ki tokens the deadline is
    20 s and everything arrives; with 0.02 s it is 10 ms, before anything can arrive."""
    s = kit.tokens(5, 512)
    keys = kit.page_keys(s)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    slow = await make_file_backend(c, [FaultRule(
        FaultKind.DELAY, ops=frozenset({"read"}), keys=frozenset({keys[0]}), times=1,
        delay_s=delay)])
    policy = StoragePolicy(prefetch_threshold=16, prefetch_policy="timeout", timeout_base_s=0,
                           timeout_per_ki_token_s=per_ki)
    assert policy.timeout_s(512) == per_ki / 2
    c.attach_storage(slow, policy)
    r = await kit.serve(c, s, policy=None)
    assert (r.fetched, r.loaded) == (want, want)
    assert kit.outcomes(c) == {"issued": 1, "completed" if want else "partial": 1}
    await kit.quiesce(c)
    if not want:  # the engine goes on: the pages it computed are correct and cached
        r = await kit.serve(c, s)
        assert (r.device, r.fetched) == (512, 0)


# -- threshold, revocation, rate limit, host pressure -------------------------------------------


async def test_threshold_declines_short_prompts(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(6, 128)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), StoragePolicy(prefetch_threshold=64))
    r = await kit.serve(c, s[:63])  # 15 whole pages = 60 tokens < 64
    assert r.fetched == 0
    assert kit.outcomes(c) == {"declined_too_short": 1}
    assert kit.counter(c, "asynccache_storage_prefetch_hit_tokens") == 0
    r = await kit.serve(c, s[:64])  # the first 15 pages are now on device: 4 tokens uncached
    assert (r.device, r.fetched) == (60, 0)
    assert kit.outcomes(c) == {"declined_too_short": 2}
    r = await kit.serve(c, s)  # 128 - 64 = 64 uncached: just enough
    assert (r.device, r.fetched, r.loaded) == (64, 64, 64)
    assert kit.outcomes(c) == {"declined_too_short": 2, "issued": 1, "completed": 1}


async def test_threshold_zero_still_needs_a_whole_page(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(7, 8)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), StoragePolicy(prefetch_threshold=0))
    assert (await kit.serve(c, s[:3])).fetched == 0
    assert kit.outcomes(c) == {"declined_too_short": 1}
    assert (await kit.serve(c, s[:4])).fetched == 4
    assert kit.outcomes(c) == {"declined_too_short": 1, "issued": 1, "completed": 1}


async def test_revoked_when_storage_holds_too_little(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(8, 128)
    await _store(kit, make_cache, make_file_backend, [s[:32]])  # 8 pages of 32
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), StoragePolicy(prefetch_threshold=64))
    r = await kit.serve(c, s)
    assert (r.fetched, r.loaded) == (0, 0)
    assert kit.outcomes(c) == {"issued": 1, "revoked_insufficient": 1}
    assert kit.counter(c, "asynccache_storage_prefetch_hit_tokens") == 32
    assert kit.counter(c, "asynccache_storage_prefetch_miss_tokens") == 96
    # A complete miss is revoked too.
    r = await kit.serve(c, kit.tokens(9, 128))
    assert r.fetched == 0
    assert kit.outcomes(c) == {"issued": 2, "revoked_insufficient": 2}
    assert kit.counter(c, "asynccache_storage_prefetch_hit_tokens") == 32
    assert kit.counter(c, "asynccache_storage_prefetch_miss_tokens") == 96 + 128
    assert kit.counter(c, "asynccache_prefetched_tokens") == 0


async def test_rate_limit_by_host_occupancy(kit, make_cache, make_file_backend) -> None:
    """Host pool of 256 tokens, half of it for prefetches (limit 128). Pages found and being
    read count against the limit: a prefetch is declined while they fill it, a second reader
    gets only the room left, and a prompt storage mostly lacks does not hold capacity."""
    x, y, z = kit.tokens(10, 96), kit.tokens(11, 64), kit.tokens(12, 16)
    missing = kit.tokens(13, 400)
    await _store(kit, make_cache, make_file_backend, [x, y, z, missing[:32]])
    c = await make_cache(host_tokens=256)
    slow = await make_file_backend(c, [FaultRule(FaultKind.DELAY, ops=frozenset({"read"}),
                                                 delay_s=0.05)])
    c.attach_storage(slow, StoragePolicy(prefetch_threshold=4))
    tier = c.storage
    big = c.start_prefetch(missing, c.match_prefix(missing))  # 400 asked, 32 found
    op1 = c.start_prefetch(x, c.match_prefix(x))
    assert big is not None and op1 is not None and tier._occupied == 0  # nothing read yet
    await _until(lambda: big.reserved_tokens and op1.reserved_tokens, "two hit queries")
    assert (big.reserved_tokens, op1.reserved_tokens, tier._occupied) == (32, 96, 128)
    assert c.start_prefetch(z, c.match_prefix(z)) is None  # 128 >= 128: full
    assert await tier.finish_prefetch(big, "wait_complete") == 32
    assert tier._occupied == 96
    op2 = c.start_prefetch(y, c.match_prefix(y))  # admitted: 96 < 128, but only 32 fit
    assert op2 is not None
    await _until(lambda: op2.reserved_tokens, "the third hit query")
    assert op2.reserved_tokens == 32 and tier._occupied == 128
    assert await tier.finish_prefetch(op1, "wait_complete") == 96
    assert await tier.finish_prefetch(op2, "wait_complete") == 32
    assert tier._occupied == 0
    op3 = c.start_prefetch(z, c.match_prefix(z))
    assert op3 is not None and await tier.finish_prefetch(op3, "wait_complete") == 16
    assert kit.outcomes(c) == {"issued": 4, "declined_rate_limited": 1, "completed": 4}
    kit.assert_at_rest(c)
    for s, cached in ((x, 96), (y, 32), (z, 16), (missing, 32)):  # what was fetched is correct
        r = await kit.serve(c, s)  # (serve verifies every token it loads, bit for bit)
        assert r.host == cached


async def test_a_reader_that_would_not_clear_the_bar_is_revoked(kit, make_cache,
                                                              make_file_backend) -> None:
    """Limit 128 with 120 being read: a second prefetch gets room for 8 tokens, under its
    threshold of 16, so it is revoked as rate limited and holds nothing."""
    a, b = kit.tokens(18, 120), kit.tokens(19, 64)
    await _store(kit, make_cache, make_file_backend, [a, b])
    c = await make_cache(host_tokens=256)
    slow = await make_file_backend(c, [FaultRule(FaultKind.DELAY, ops=frozenset({"read"}),
                                                 delay_s=0.05)])
    c.attach_storage(slow, StoragePolicy(prefetch_threshold=16))
    tier = c.storage
    op1 = c.start_prefetch(a, c.match_prefix(a))
    await _until(lambda: op1.reserved_tokens == 120, "the first hit query")
    op2 = c.start_prefetch(b, c.match_prefix(b))
    assert op2 is not None
    await _until(lambda: tier.tasks_of(op2).task.done(), "the second prefetch")
    assert op2.reserved_tokens == 0 and tier._occupied == 120
    assert await tier.finish_prefetch(op2, "wait_complete") == 0
    assert await tier.finish_prefetch(op1, "wait_complete") == 120
    assert kit.outcomes(c) == {"issued": 2, "revoked_rate_limited": 1, "completed": 1}
    kit.assert_at_rest(c)


async def test_rate_limit_admits_a_large_prefetch_when_nothing_is_in_flight(
        kit, make_cache, make_file_backend) -> None:
    """Regression: the limit was applied to occupancy *plus* the new prefetch, so a prompt
    longer than the limit was never prefetched (behavior.md §1.16 declines only when full)."""
    s = kit.tokens(13, 160)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache(host_tokens=256)  # limit 128 tokens
    c.attach_storage(await make_file_backend(c), StoragePolicy(prefetch_threshold=4))
    r = await kit.serve(c, s)
    assert (r.fetched, r.loaded) == (160, 160)


async def test_host_pressure_fetches_a_shorter_prefix(kit, make_cache, make_file_backend) -> None:
    """Host pool of 64 pages, 32 of them pinned: a 48-page prefetch takes the 32 that fit."""
    p, s = kit.tokens(14, 128), kit.tokens(15, 192)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache(host_tokens=256)
    c.attach_storage(await make_file_backend(c), StoragePolicy(
        prefetch_threshold=16, prefetch_capacity_fraction=1.0, prefetch_policy="wait_complete"))
    await kit.write_sequences(c, [p])  # device + host copy
    c.evict(10**6)  # p is host only now
    assert c.host_size == 128
    pinned = c.admit(p)  # pins p's host pages until it is loaded or dropped
    assert pinned.host_hit_length == 128
    r = await kit.serve(c, s)
    assert (r.fetched, r.loaded) == (128, 128)
    assert kit.outcomes(c) == {"issued": 1, "completed": 1}
    c.abort_req(pinned)


async def test_no_host_memory_revokes(kit, make_cache, make_file_backend) -> None:
    """Host pool full of pinned pages: the prefetch is revoked and releases everything."""
    p, q, t = kit.tokens(14, 128), kit.tokens(16, 128), kit.tokens(17, 64)
    await _store(kit, make_cache, make_file_backend, [t])
    c = await make_cache(host_tokens=256)
    c.attach_storage(await make_file_backend(c), StoragePolicy(
        prefetch_threshold=16, prefetch_capacity_fraction=1.0, prefetch_policy="wait_complete"))
    await kit.write_sequences(c, [p, q])
    c.evict(10**6)
    pins = [c.admit(p), c.admit(q)]
    assert [r.host_hit_length for r in pins] == [128, 128]
    assert c.host_pool.allocator.available_size == 0
    r = await kit.serve(c, t)
    assert (r.fetched, r.loaded) == (0, 0)
    assert kit.outcomes(c) == {"issued": 1, "revoked_no_host_memory": 1}
    assert kit.counter(c, "asynccache_storage_prefetch_hit_tokens") == 64
    kit.assert_at_rest(c, own_receipts=4)  # the two pinning requests' device and host locks
    for req in pins:
        c.abort_req(req)
    await kit.quiesce(c)
    c.evict(10**6)
    c.evict_host(10**6)  # t (computed above) is gone from both tiers; storage still has it
    r = await kit.serve(c, t)
    assert (r.fetched, r.loaded) == (64, 64)


async def test_prefetch_request_does_not_refetch_what_the_tree_has(kit, make_cache,
                                                                   make_file_backend) -> None:
    s = kit.tokens(18, 64)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    backend = await make_file_backend(c)
    c.attach_storage(backend, StoragePolicy(prefetch_threshold=16,
                                            prefetch_policy="wait_complete"))
    stale = c.admit(s)  # admitted, then waits in the scheduler's queue
    r = await kit.serve(c, s)  # meanwhile another request fetches and caches the prompt
    assert (r.fetched, r.loaded) == (64, 64)
    reads = backend.stats()["pages"].get("get.hit", 0)
    host_before = stale.host_hit_length
    try:
        got = await asyncio.wait_for(c.prefetch_request(stale), kit.TIMEOUT)
        assert stale.prefix_len == 64  # it is on device now
        assert got == stale.host_hit_length - host_before == 0
        assert backend.stats()["pages"].get("get.hit", 0) == reads
        assert kit.counter(c, "asynccache_prefetched_tokens") == 64
    finally:
        c.abort_req(stale)


# -- a fetch begun at arrival -------------------------------------------------------------------


async def test_begun_at_arrival_best_effort_takes_what_arrived(kit, make_cache,
                                                               make_file_backend) -> None:
    """``begin_prefetch`` when the request arrives, ``prefetch_request`` when it is scheduled:
    best_effort then takes everything that arrived in between (called at once it gets 0)."""
    s = kit.tokens(20, 64)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), StoragePolicy(prefetch_threshold=16))
    req = c.admit(s)
    assert c.begin_prefetch(req) is True and c.begin_prefetch(req) is True  # idempotent
    op = req.prefetch
    # the scheduler is busy elsewhere
    await _until(lambda: c.storage.tasks_of(op).task.done(), "the fetch")
    assert await c.prefetch_request(req, policy="best_effort") == 64
    assert req.prefetch is None and req.host_hit_length == 64
    assert await c.load_back_request(req) == 64
    kit.assert_kv(c, s, req.slots, "prefetched at arrival")
    c.cache_finished_req(req)
    assert kit.outcomes(c) == {"issued": 1, "completed": 1}
    kit.assert_at_rest(c)


async def test_pages_cached_meanwhile_are_not_counted_as_fetched(kit, make_cache,
                                                                  make_file_backend) -> None:
    """A fetch returns (and counts) the tokens it added to host memory. Pages another request
    cached on host while it ran are given back, as SGLang's ``loaded_from_storage`` (the
    fetched tokens minus the prefix the host tree already held) leaves them out."""
    s = kit.tokens(24, 64)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), StoragePolicy(prefetch_threshold=16))
    req = c.admit(s)
    assert c.begin_prefetch(req)
    await _until(lambda: c.storage.tasks_of(req.prefetch).task.done(), "the fetch")
    await kit.write_sequences(c, [s[:32]])  # another request caches the first half meanwhile
    assert await c.prefetch_request(req, policy="best_effort") == 32
    assert kit.counter(c, "asynccache_prefetched_tokens") == 32
    assert req.prefix_len == 32 and req.host_hit_length == 32
    assert await c.load_back_request(req) == 32
    kit.assert_kv(c, s, req.slots, "half cached, half fetched")
    c.cache_finished_req(req)
    kit.assert_at_rest(c)


async def test_a_request_ending_before_its_fetch_releases_it(kit, make_cache,
                                                             make_file_backend) -> None:
    s = kit.tokens(21, 64)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    slow = await make_file_backend(c, [FaultRule(FaultKind.DELAY, ops=frozenset({"read"}),
                                                 delay_s=0.05)])
    c.attach_storage(slow, StoragePolicy(prefetch_threshold=16))
    req = c.admit(s)
    assert c.begin_prefetch(req)
    c.abort_req(req)  # e.g. the client went away while the fetch was running
    assert req.prefetch is None
    await _until(lambda: not c.storage._prefetches and not c.storage._aborts, "the release")
    assert kit.outcomes(c) == {"issued": 1, "aborted": 1}
    kit.assert_at_rest(c)
    # Nothing attached, or a request that already computed: nothing to begin.
    other = c.admit(kit.tokens(22, 64))
    new = await c.extend(other, 4)
    c.write_kv(new, kit.expected(c, kit.tokens(22, 64), 0, 4))
    assert c.begin_prefetch(other) is False
    c.abort_req(other)


async def test_detach_waits_for_background_releases(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(23, 64)
    await _store(kit, make_cache, make_file_backend, [s])
    c = await make_cache()
    slow = await make_file_backend(c, [FaultRule(FaultKind.DELAY, ops=frozenset({"read"}),
                                                 delay_s=0.05)])
    c.attach_storage(slow, StoragePolicy(prefetch_threshold=16))
    req = c.admit(s)
    assert c.begin_prefetch(req)
    c.abort_req(req)
    tier = c.storage
    assert await c.detach_storage() is True  # right away: the release is still running
    assert not tier._aborts and not tier._prefetches
    kit.assert_at_rest(c)
