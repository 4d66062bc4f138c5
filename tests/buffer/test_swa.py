"""Buffer-only host mode with an SWA component (FULL+SWA; Mamba is refused): the write path
stores ``<key>.swa`` next to each KV page still SWA-live, the read path restores the KV of the
whole prefix and the SWA of its trailing window only, with exact fallbacks when a window page
is missing; cancellation at any await leaks nothing in either pool."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asynccache import CacheConfig
from asynccache.errors import ConfigError, PoolExhaustedError
from asynccache.l3 import StoragePolicy
from asynccache.storage.faults import FaultKind, FaultRule
from asynccache.testing.cancel import sweep_cancellations

WINDOW = 8  # tokens: two pages of 4
SWA = {"sliding_window": WINDOW}
POLICY = StoragePolicy(prefetch_threshold=16)  # 4 pages


# -- helpers -------------------------------------------------------------------------------------


def stored(backend: Any) -> set[str]:
    """Every object name (page key, or ``<key>.swa``) in a file backend."""
    suffix = backend.layout.object_suffix
    return {p.name[: -len(suffix)] for p in Path(backend.root).rglob("*" + suffix)}


def swa_of(cache: Any, full_slots: Any) -> torch.Tensor:
    hy = cache.hybrid
    return hy.swa_pool.read_slots(hy.swa_map.translate(np.asarray(full_slots)))


def tokens_of(kv: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens ``[start, end)`` of a (layers, K/V, tokens, heads, dim) read, as raw bytes."""
    return kv[:, :, start:end].contiguous().view(torch.uint8)


def randomize_swa(cache: Any, seed: int) -> None:
    kv = cache.hybrid.swa_pool.kv
    g = torch.Generator().manual_seed(seed)
    kv.copy_(torch.randn(kv.shape, generator=g).to(kv.dtype))


def assert_pools_idle(cache: Any) -> None:
    """No SWA slot is held on device or host beyond what the tree owns."""
    hy = cache.hybrid
    cache.sanity_check()
    assert hy.tier.inflight["swa"] == 0
    assert hy.tier.swa_host.allocator.used_size == cache.storage.swa.read_held == \
        cache.storage.reads.staged_swa_tokens
    assert hy.swa_map.swa.used_size == len(cache.tree.component_slots("swa"))


def put(kit: Any, c: Any, toks: Any, swa_floor: int = 0) -> Any:
    """Compute ``toks`` into fresh slots; free the SWA of the first ``swa_floor`` tokens (slid
    out of the window) and insert; no await."""
    slots = c.try_alloc_device(len(toks))
    c.write_kv(slots, kit.expected(c, toks))
    if swa_floor:
        c.free_swa(c.hybrid.swa_map.translate(slots[:swa_floor]))
    return c.insert(toks, slots, swa_evicted_seqlen=swa_floor)


async def write_store(kit: Any, make_cache: Any, make_file_backend: Any, seqs: list[Any],
                      **cfg: Any) -> dict[int, torch.Tensor]:
    """A buffer-only FULL+SWA writer stores ``seqs``; returns each sequence's SWA (the whole
    prefix, from the writer's device) by index."""
    a = await make_cache(**SWA, **cfg)
    randomize_swa(a, 7)
    a.attach_storage(await make_file_backend(a), POLICY)
    await kit.write_sequences(a, seqs)
    want = {}
    for i, s in enumerate(seqs):
        m = a.match_prefix(s)
        want[i] = swa_of(a, m.device_indices)
    await kit.quiesce(a)
    assert_pools_idle(a)
    await a.detach_storage()
    await a.aclose()
    return want


def check_loaded(c: Any, toks: Any, want_swa: torch.Tensor, window_from: int) -> None:
    """``c`` holds ``toks``'s whole pages: KV bit for bit, SWA of the window bit for bit, and no
    SWA before ``window_from`` (loaded below the floor)."""
    n = len(toks) - len(toks) % 4
    m = c.match_prefix(toks)
    assert m.device_prefix_len == n
    got = swa_of(c, m.device_indices[window_from:n])
    assert torch.equal(tokens_of(got, 0, n - window_from), tokens_of(want_swa, window_from, n))
    assert (c.hybrid.swa_map.full_to_swa[m.device_indices[:window_from]] == -1).all()


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{"mamba_states": 2},
                                   {"mamba_states": 2, "sliding_window": 8}])
def test_buffer_only_refuses_mamba(kit, extra) -> None:
    with pytest.raises(ConfigError, match=r"Mamba is not supported in buffer_only mode "
                                          r"\(mamba_states=2, sliding_window=\d+\)"):
        CacheConfig(**{**kit.BASE, **extra})
    cfg = CacheConfig(**{**kit.BASE, "sliding_window": 8})
    assert cfg.host_mode == "buffer_only" and cfg.hybrid
    CacheConfig(**{**kit.BASE, "mamba_states": 2, "host_mode": "cache"})


async def test_host_swa_pool_must_hold_a_window(kit, make_cache) -> None:
    c = await make_cache(**SWA, swa_host_tokens=4)
    with pytest.raises(ConfigError, match=r"swa_host_tokens=4\) must hold at least 8 tokens"):
        c.attach_storage(object())
    assert c.storage is None


# -- writes --------------------------------------------------------------------------------------


async def test_writes_kv_and_live_swa_pages(kit, make_cache, make_file_backend) -> None:
    c = await make_cache(**SWA)
    backend = await make_file_backend(c)
    c.attach_storage(backend, POLICY)
    p = c.storage
    a = kit.tokens(1, 64)  # 16 pages, every one SWA-live: a 14-page node and a window leaf
    b = kit.tokens(2, 48)  # 12 pages, the SWA of the first 6 already freed
    ra = put(kit, c, a)
    rb = put(kit, c, b, swa_floor=24)
    assert len(ra.intents) == 2 and len(rb.intents) == 3  # cap-split: every new node
    await c.flush()
    await p.drain()
    ka, kb = kit.page_keys(a), kit.page_keys(b)
    want = set(ka) | set(kb) | {f"{k}.swa" for k in ka} | {f"{k}.swa" for k in kb[6:]}
    assert stored(backend) == want
    assert kit.counter(c, "asynccache_storage_backup_tokens") == (16 + 12) * 4
    # The existence beliefs are per pool: b's first six pages are stored, their SWA is not.
    assert p.existence.covered(ka + kb)
    assert p.swa.existence.covered(ka + kb[6:])
    assert [k in p.swa.existence for k in kb[:6]] == [False] * 6
    assert_pools_idle(c)

    # b again, SWA-live this time: its KV is believed stored, only the missing SWA is written.
    c.evict(10**6)
    assert c.tree.device_size == 0
    put(kit, c, b)
    await c.flush()
    await p.drain()
    assert stored(backend) == want | {f"{k}.swa" for k in kb[:6]}
    assert kit.counter(c, "asynccache_storage_backup_tokens") == (16 + 12) * 4
    assert p.swa.existence.covered(kb)
    kit.assert_at_rest(c)
    assert_pools_idle(c)


async def test_intent_split_while_queued_leaves_the_unpinned_swa_to_a_later_intent(
        kit, make_cache, make_file_backend) -> None:
    c = await make_cache(**SWA)
    backend = await make_file_backend(c)
    c.attach_storage(backend, POLICY)
    a = kit.tokens(6, 64)
    ka = kit.page_keys(a)
    ra = put(kit, c, a)
    top = ra.intents[0]  # the 14-page node, queued
    m = c.match_prefix(a[:8])  # splits [0, 8) off it: the intent's node is now [8, 56)
    assert m.device_prefix_len == 8 and m.last_device_node != top
    await c.flush()
    await c.storage.drain()
    # Its lock pins its own 12 pages (and the leaf's 2): the SWA of [0, 8) is not pinned.
    assert stored(backend) == set(ka) | {f"{k}.swa" for k in ka[2:]}
    # An insert through [0, 8) names it again: its KV is believed stored, its SWA is written.
    b = np.concatenate([a[:8], kit.tokens(7, 16)])
    slots = c.try_alloc_device(16)
    c.write_kv(slots, kit.expected(c, b, 8, 24))
    rb = c.insert(b, np.concatenate([m.device_indices, slots]), prev_prefix_len=8)
    assert rb.intents[0] == m.last_device_node
    await c.flush()
    await c.storage.drain()
    kb = kit.page_keys(b)
    assert stored(backend) == set(ka) | set(kb) | {f"{k}.swa" for k in ka + kb}
    assert kit.counter(c, "asynccache_storage_backup_tokens") == (16 + 4) * 4
    kit.assert_at_rest(c)
    assert_pools_idle(c)


async def test_small_host_swa_pool_writes_in_batches(kit, make_cache, make_file_backend) -> None:
    c = await make_cache(**SWA, swa_host_tokens=16)  # four SWA pages of staging at a time
    backend = await make_file_backend(c)
    c.attach_storage(backend, POLICY)
    s = kit.tokens(5, 64)
    put(kit, c, s)
    await asyncio.sleep(0)  # one loop turn: the first batch, cut at the fifth SWA page
    assert c.storage.swa.write_staged == 16 and c.storage.write_staged == 16
    await c.flush()
    await c.storage.drain()
    keys = kit.page_keys(s)
    assert stored(backend) == set(keys) | {f"{k}.swa" for k in keys}
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 64
    kit.assert_at_rest(c)
    assert_pools_idle(c)


# -- reads ---------------------------------------------------------------------------------------


async def _round_trip(kit, make_cache, make_backend, layout: str) -> None:
    s1 = kit.tokens(11, 67)  # 16 pages + an unaligned tail
    s2 = np.concatenate([s1[:32], kit.tokens(12, 40)])  # 8 shared pages, 10 of its own
    want = await write_store(kit, make_cache, make_backend, [s1, s2], host_layout=layout)
    b = await make_cache(**SWA, host_layout=layout)
    b.attach_storage(await make_backend(b), POLICY)
    r1 = await kit.serve(b, s1)
    assert (r1.device, r1.fetched, r1.loaded) == (0, 64, 64)
    check_loaded(b, s1, want[0], 56)
    # s1's first 14 pages came without SWA: a prefix ending in them has no live window, so
    # s2 matches nothing on device and loads its whole 18 pages (window [16, 18)).
    r2 = await kit.serve(b, s2)
    assert (r2.device, r2.fetched, r2.loaded) == (0, 72, 72)
    check_loaded(b, s2, want[1], 64)
    assert kit.outcomes(b) == {"issued": 2, "completed": 2}
    await kit.quiesce(b)
    # Every KV page came from storage and is believed stored: no KV is written back. A window
    # query adds no belief (trailing-window policy), so each loaded window's SWA pages were
    # written again (SWA-only writes): now they are believed stored, and nothing else is.
    assert kit.counter(b, "asynccache_storage_backup_tokens") == 0
    k1, k2 = kit.page_keys(s1), kit.page_keys(s2)
    assert set(b.storage.swa.existence._lru) == set(k1[14:16]) | set(k2[16:18])
    assert_pools_idle(b)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_round_trip_file(kit, make_cache, make_file_backend, layout) -> None:
    await _round_trip(kit, make_cache, make_file_backend, layout)


@pytest.mark.seaweedfs
async def test_round_trip_seaweedfs(kit, make_cache, make_s3_backend, seaweed) -> None:
    prefix = kit.new_prefix()

    async def open_backend(cache):
        return make_s3_backend(seaweed, cache, prefix)

    await _round_trip(kit, make_cache, open_backend, "page_first")


async def test_cache_mode_writer_buffer_reader(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(21, 64)
    a = await make_cache(strict=False, host_mode="cache", **SWA)
    randomize_swa(a, 5)
    backend = await make_file_backend(a)
    a.attach_storage(backend, POLICY)
    await kit.write_sequences(a, [s])
    want = swa_of(a, a.match_prefix(s).device_indices)
    await a.flush()
    await a.storage.drain()
    keys = kit.page_keys(s)
    assert stored(backend) == set(keys) | {f"{k}.swa" for k in keys}
    await a.detach_storage()
    await a.aclose()

    b = await make_cache(**SWA)
    b.attach_storage(await make_file_backend(b), POLICY)
    r = await kit.serve(b, s)
    assert (r.fetched, r.loaded) == (64, 64)
    check_loaded(b, s, want, 56)
    await kit.quiesce(b)
    assert_pools_idle(b)


async def test_buffer_writer_cache_mode_reader(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(22, 64)
    want = await write_store(kit, make_cache, make_file_backend, [s])
    b = await make_cache(strict=False, host_mode="cache", **SWA)
    b.attach_storage(await make_file_backend(b), POLICY)
    r = await kit.serve(b, s)
    assert (r.fetched, r.loaded) == (64, 64)
    m = b.match_prefix(s)
    assert m.device_prefix_len == 64
    got = swa_of(b, m.device_indices[56:])
    assert torch.equal(tokens_of(got, 0, 8), tokens_of(want[0], 56, 64))
    await b.flush()
    await b.storage.drain()
    await b.detach_storage()


def _drop_swa(root: Path, kit: Any, keys: list[str], pages: list[int]) -> None:
    """Delete the ``.swa`` objects of ``pages`` (before a backend indexes the directory)."""
    for j in pages:
        (hit,) = root.glob(f"{keys[j][:2]}/{keys[j]}.swa.*")
        hit.unlink()


async def test_missing_window_page_falls_back_to_an_intact_window(kit, make_cache,
                                                                  make_file_backend,
                                                                  storage_dir) -> None:
    s = kit.tokens(31, 64)
    want = await write_store(kit, make_cache, make_file_backend, [s])
    b = await make_cache(**SWA)
    keys = kit.page_keys(s)
    _drop_swa(storage_dir, kit, keys, [14])  # the window of 16 pages is [14, 16)
    backend = await make_file_backend(b)
    b.attach_storage(backend, POLICY)
    req = b.admit(s)
    assert await b.prefetch_request(req, policy="wait_complete") == 56  # window [12, 14)
    assert await b.load_back_request(req) == 56
    assert kit.counter(b, "asynccache_hybrid_skipped", op="swa_window") == 1
    b.abort_req(req)
    check_loaded(b, s[:56], want[0], 48)
    assert b.match_prefix(s).device_prefix_len == 56
    await kit.quiesce(b)
    assert_pools_idle(b)


async def test_every_window_broken_is_a_miss(kit, make_cache, make_file_backend, storage_dir) -> None:
    s = kit.tokens(32, 64)
    await write_store(kit, make_cache, make_file_backend, [s])
    b = await make_cache(**SWA)
    keys = kit.page_keys(s)
    _drop_swa(storage_dir, kit, keys, list(range(1, 16, 2)))  # every two-page window broken
    backend = await make_file_backend(b)
    b.attach_storage(backend, POLICY)
    r = await kit.serve(b, s)
    assert (r.fetched, r.loaded) == (0, 0)
    assert kit.outcomes(b) == {"issued": 1, "revoked_insufficient": 1}
    # windows ending at 16, 15, 13, 11, 9, 7, 5 pages: seven fallbacks, then 3 < 4 pages
    assert kit.counter(b, "asynccache_hybrid_skipped", op="swa_window") == 7
    await kit.quiesce(b)
    # The computed request is written back: the KV is believed stored, its SWA is rewritten.
    assert stored(backend) >= {f"{k}.swa" for k in keys}
    assert_pools_idle(b)


async def test_window_shorter_than_threshold_after_fallback_is_a_miss(
        kit, make_cache, make_file_backend, storage_dir) -> None:
    s = kit.tokens(33, 64)
    await write_store(kit, make_cache, make_file_backend, [s])
    b = await make_cache(**SWA)
    _drop_swa(storage_dir, kit, kit.page_keys(s), [14])  # the intact window ends at 14 pages
    backend = await make_file_backend(b)
    b.attach_storage(backend, StoragePolicy(prefetch_threshold=60))  # 15 pages at least
    req = b.admit(s)
    assert await b.prefetch_request(req, policy="wait_complete") == 0
    assert await b.load_back_request(req) == 0
    b.abort_req(req)
    assert kit.outcomes(b) == {"issued": 1, "revoked_insufficient": 1}
    assert kit.counter(b, "asynccache_hybrid_skipped", op="swa_window") == 1
    await kit.quiesce(b)
    assert_pools_idle(b)


async def test_window_page_lost_after_the_query_falls_back(kit, make_cache, make_file_backend,
                                                           storage_dir) -> None:
    s = kit.tokens(34, 64)
    want = await write_store(kit, make_cache, make_file_backend, [s])
    b = await make_cache(**SWA)
    backend = await make_file_backend(b)  # indexes every object...
    _drop_swa(storage_dir, kit, kit.page_keys(s), [15])  # ...then one vanishes: the read fails
    b.attach_storage(backend, POLICY)
    req = b.admit(s)
    assert await b.prefetch_request(req, policy="wait_complete") == 60  # window [13, 15)
    assert await b.load_back_request(req) == 60
    b.abort_req(req)
    assert kit.outcomes(b) == {"issued": 1, "partial": 1}
    assert kit.counter(b, "asynccache_hybrid_skipped", op="swa_window") == 1
    assert kit.counter(b, "asynccache_prefetched_tokens") == 60
    check_loaded(b, s[:60], want[0], 52)
    await kit.quiesce(b)
    assert_pools_idle(b)


async def test_corrupt_window_page_read_falls_back(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(35, 64)
    want = await write_store(kit, make_cache, make_file_backend, [s])
    b = await make_cache(**SWA)
    bad = f"{kit.page_keys(s)[15]}.swa"
    backend = await make_file_backend(
        b, [FaultRule(FaultKind.FLIP_BYTES, ops=frozenset({"read"}), keys=frozenset({bad}))])
    b.attach_storage(backend, POLICY)
    r = await kit.serve(b, s)  # the checksum catches it: the window [13, 15) is whole
    assert (r.fetched, r.loaded) == (60, 60)
    assert kit.counter(b, "asynccache_hybrid_skipped", op="swa_window") == 1
    m = b.match_prefix(s)
    assert m.device_prefix_len == 64  # the request computed the last page itself
    got = swa_of(b, m.device_indices[52:60])
    assert torch.equal(tokens_of(got, 0, 8), tokens_of(want[0], 52, 60))
    await kit.quiesce(b)
    assert_pools_idle(b)


async def test_failed_swa_write_leaves_only_that_object_out(kit, make_cache,
                                                            make_file_backend) -> None:
    c = await make_cache(**SWA)
    s = kit.tokens(36, 64)
    keys = kit.page_keys(s)
    backend = await make_file_backend(
        c, [FaultRule(FaultKind.EIO, ops=frozenset({"write"}),
                      keys=frozenset({f"{keys[3]}.swa"}))])
    c.attach_storage(backend, POLICY)
    put(kit, c, s)
    await c.flush()
    await c.storage.drain()
    assert stored(backend.inner) == \
        set(keys) | {f"{k}.swa" for j, k in enumerate(keys) if j != 3}
    assert keys[3] in c.storage.existence and keys[3] not in c.storage.swa.existence
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 64
    kit.assert_at_rest(c)
    assert_pools_idle(c)


# -- cancellation --------------------------------------------------------------------------------


async def test_cancel_the_swa_read_path_at_every_await(kit, make_cache,
                                                       make_file_backend) -> None:
    s = kit.tokens(41, 600)  # 150 pages: two KV read batches, then the window
    want = await write_store(kit, make_cache, make_file_backend, [s])
    c = await make_cache(**SWA)
    c.attach_storage(await make_file_backend(c), POLICY)
    results: list[tuple[int, int]] = []

    async def serve() -> tuple[int, int]:
        return await kit.serve_plain(c, s)

    async def settle() -> None:
        async def drained() -> None:
            while c.storage.backend.stats()["stuck_threads"]:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(drained(), 10.0)
        await asyncio.sleep(0)
        await kit.quiesce(c)
        assert c.storage.staged_requests == 0
        assert_pools_idle(c)

    async def check(outcome: Any) -> None:
        await settle()
        if outcome.completed:
            results.append(outcome.result)
            check_loaded(c, s, want[0], 600 - WINDOW)
        c.evict(10**6)
        kit.assert_at_rest(c)
        assert c.tree.device_size == 0
        assert c.hybrid.swa_map.swa.used_size == 0

    outcomes = await sweep_cancellations(serve, check=check)
    assert results[-1] == (600, 600)
    assert sum(o.cancelled for o in outcomes) == len(outcomes) - 1 >= 3
    # ...and after k loop turns: inside the hit query, the KV reads, the window query and read,
    # and the H->D copies.
    k = 0
    seen: set[str] = set()
    while True:
        task = asyncio.ensure_future(serve())
        for _ in range(k):
            if task.done():
                break
            await asyncio.sleep(0)
        if task.done():
            assert task.result() == (600, 600)
            await settle()
            check_loaded(c, s, want[0], 600 - WINDOW)
            c.evict(10**6)
            break
        seen.add(_state(c))
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=kit.TIMEOUT)
        assert done and (task.cancelled() or task.result() == (600, 600))
        await settle()
        c.evict(10**6)
        kit.assert_at_rest(c)
        assert c.hybrid.swa_map.swa.used_size == 0
        k = k + 1 if k < 64 else k + k // 8
    assert k > 3, seen  # which steps the turns land in depends on the threads: no set asserted
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 0


async def test_cancel_while_the_window_is_read(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(42, 64)
    want = await write_store(kit, make_cache, make_file_backend, [s])
    c = await make_cache(**SWA)
    slow = f"{kit.page_keys(s)[14]}.swa"  # the first page of the window [14, 16)
    backend = await make_file_backend(c, [FaultRule(
        FaultKind.DELAY, ops=frozenset({"read"}), keys=frozenset({slow}), delay_s=0.5,
        times=1)])
    c.attach_storage(backend, POLICY)
    req = c.admit(s)
    task = asyncio.ensure_future(c.prefetch_request(req, policy="wait_complete"))

    async def in_window() -> None:
        while _state(c) != "reading the SWA window":
            await asyncio.sleep(0.001)

    await asyncio.wait_for(in_window(), kit.TIMEOUT)
    op = next(iter(c.storage.reads._fetches))
    assert op.completed_tokens == 64 and c.hybrid.tier.swa_host.allocator.used_size == 8
    task.cancel()
    await asyncio.wait({task}, timeout=kit.TIMEOUT)
    assert task.cancelled()
    c.abort_req(req)

    async def drained() -> None:
        while backend.stats()["stuck_threads"]:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(drained(), kit.TIMEOUT)
    await kit.quiesce(c)
    assert c.storage.staged_requests == 0 and c.host_pool.allocator.used_size == 0
    assert c.hybrid.tier.swa_host.allocator.used_size == 0
    assert kit.outcomes(c) == {"issued": 1, "aborted": 1}
    assert_pools_idle(c)
    r = await kit.serve(c, s)  # the delay was spent: served whole
    assert (r.fetched, r.loaded) == (64, 64)
    check_loaded(c, s, want[0], 56)
    await kit.quiesce(c)
    assert_pools_idle(c)


def _state(c: Any) -> str:
    reads = c.storage.reads
    if reads._loads:
        return "loading"
    if not reads._fetches:
        return "between steps"
    op = next(iter(reads._fetches))
    if op.host_slots is None:
        return "querying"  # the KV hit query, then the window's
    if op.completed_tokens < op.want_pages * 4:
        return "reading KV"
    return "reading the SWA window" if not op.swa_ready else "fetched"


async def test_cancel_swa_writes_at_every_await(kit, make_cache, make_file_backend) -> None:
    c = await make_cache(**SWA)
    backend = await make_file_backend(c)
    c.attach_storage(backend, POLICY)
    written: list[list[str]] = []

    async def write_one() -> None:
        s = kit.tokens(200 + len(written), 64)
        written.append(kit.page_keys(s))
        put(kit, c, s)
        await c.flush()
        await c.storage.drain()

    async def check(outcome: Any) -> None:
        await kit.quiesce(c)  # a cancelled flush never stops the writes it started
        if outcome.k:
            assert await backend.exists_prefix([f"{k}.swa" for k in written[-1]]) == 16
        kit.assert_at_rest(c)
        assert_pools_idle(c)

    outcomes = await sweep_cancellations(write_one, check=check)
    assert len(outcomes) >= 3 and len(written) == len(outcomes) - 1


# -- concurrency ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
async def test_concurrent_requests_under_staging_pressure(kit, make_cache, make_file_backend,
                                                          seed) -> None:
    rng = random.Random(seed)
    stems = [kit.tokens(700 + i, 4 * rng.randint(4, 20)) for i in range(6)]
    seqs = [np.concatenate([stems[rng.randrange(6)],
                            kit.tokens(800 + i, 4 * rng.randint(4, 20) + rng.randint(0, 3))])
            for i in range(40)]
    policy = StoragePolicy(prefetch_threshold=8, timeout_base_s=5.0)
    w = await make_cache(**SWA)
    w.attach_storage(await make_file_backend(w), policy)
    await kit.write_sequences(w, seqs[::2])  # half of them stored up front
    await kit.quiesce(w)
    await w.detach_storage()
    await w.aclose()

    c = await make_cache(**SWA, host_tokens=256, swa_host_tokens=32)
    c.attach_storage(await make_file_backend(c), policy)
    served: list[int] = []
    rejected: list[int] = []

    async def one(i: int, s: np.ndarray) -> None:
        await asyncio.sleep(rng.random() * 0.01)
        try:
            await kit.serve(c, s, policy=rng.choice(["wait_complete", "timeout"]))
        except PoolExhaustedError:
            rejected.append(i)
            return
        served.append(i)

    tasks = [asyncio.ensure_future(one(i, s)) for i, s in enumerate(seqs)]
    for t in rng.sample(tasks, 8):
        t.cancel()
    done, pending = await asyncio.wait(tasks, timeout=60.0)
    assert not pending
    for t in done:
        if not t.cancelled():
            assert t.exception() is None, repr(t.exception())
    assert len(served) + len(rejected) + sum(t.cancelled() for t in tasks) == len(seqs)
    assert len(served) >= 20
    await kit.quiesce(c)
    kit.assert_at_rest(c)
    assert_pools_idle(c)
    # A cache that lost its device copies serves every served prompt again, bit for bit (KV of
    # the prefix, SWA of the window), from what storage holds: intents whose node was evicted
    # while waiting for staging were dropped (eviction wins), so not every page is stored.
    backend = c.storage.backend
    for i in served:
        c.evict(10**6)
        keys = kit.page_keys(seqs[i])
        stored_pages = await backend.exists_prefix(keys)
        r = await kit.serve(c, seqs[i], policy="wait_complete")
        whole = len(seqs[i]) - len(seqs[i]) % kit.PS
        assert (r.device, r.prefix) == (0, r.loaded), f"prompt {i}"
        assert r.loaded == r.fetched <= stored_pages * kit.PS, f"prompt {i}"
        m = c.match_prefix(seqs[i])  # the request's own tokens were inserted SWA-live
        assert m.device_prefix_len == whole, f"prompt {i}"
        assert (c.hybrid.swa_map.full_to_swa[m.device_indices[r.loaded:]] >= 0).all()
    await kit.quiesce(c)
    assert_pools_idle(c)
