"""The buffer-only write path: intents -> one D->H batch into staging -> storage -> free.

Sequences are inserted with ``put`` (synchronous: no loop turn passes), so intents stay queued
until the test lets the loop run or calls ``flush``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from asynccache.l3 import StoragePolicy


def put(kit, c, toks):
    """Compute ``toks`` (whole pages) into fresh device slots and insert them; no await."""
    slots = c.try_alloc_device(len(toks))
    assert slots is not None and len(slots) == len(toks)
    c.write_kv(slots, kit.expected(c, toks))
    return c.insert(toks, slots)


def stored_keys(root: Path) -> set[str]:
    return {p.name.split(".")[0] for p in root.rglob("*.kv")}


def intents(kit, c, outcome: str) -> int:
    return int(kit.counter(c, "asynccache_buffer_write_intents", outcome=outcome))


async def _cache(kit, make_cache, make_file_backend, **overrides):
    c = await make_cache(**overrides)
    backend = await make_file_backend(c)
    c.attach_storage(backend, StoragePolicy(prefetch_threshold=8))
    return c, backend


async def test_write_through_node_written_once_through_staging(kit, make_cache,
                                                              make_file_backend) -> None:
    c, backend = await _cache(kit, make_cache, make_file_backend)
    p = c.storage
    s = kit.tokens(1, 64)
    res = put(kit, c, s)
    assert res.intents == [res.last_node] and res.backups == []
    assert p.queued_intents == 1 and c.in_flight == 0
    assert c.host_pool.allocator.used_size == 0  # nothing staged while queued
    await asyncio.sleep(0)  # one loop turn: the queued intents are launched as one batch
    assert p.queued_intents == 0 and p.write_staged == 64
    assert c.host_pool.allocator.used_size == 64
    await p.drain()
    assert stored_keys(backend.root) == set(kit.page_keys(s))
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 64
    assert kit.counter(c, "asynccache_backup_tokens") == 64  # the D->H copy
    assert (intents(kit, c, "queued"), intents(kit, c, "staged")) == (1, 1)
    assert len(p.existence) == 16 and p.existence.covered(kit.page_keys(s))
    assert c.host_size == 0 and c.host_pool.allocator.used_size == 0
    kit.assert_at_rest(c)
    # A hit qualifies the node again: it is believed stored, so nothing is queued or written.
    res = c.insert(s, c.match_prefix(s).device_indices, prev_prefix_len=len(s))
    assert res.intents == [res.last_node] and p.queued_intents == 0
    assert intents(kit, c, "covered") == 1
    assert kit.counter(c, "asynccache_storage_backup_skipped_tokens", reason="exists") == 64
    await p.drain()
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 64


async def test_selective_writes_on_the_second_hit(kit, make_cache, make_file_backend) -> None:
    c, backend = await _cache(kit, make_cache, make_file_backend,
                              write_policy="write_through_selective")
    s = kit.tokens(2, 32)
    assert put(kit, c, s).intents == []
    await c.flush()
    await c.storage.drain()
    assert stored_keys(backend.root) == set()
    res = c.insert(s, c.match_prefix(s).device_indices, prev_prefix_len=len(s))
    assert res.intents == [res.last_node]
    await c.flush()
    await c.storage.drain()
    assert stored_keys(backend.root) == set(kit.page_keys(s))
    kit.assert_at_rest(c)


async def test_split_intent_is_repaired_and_the_batch_is_one_copy(kit, make_cache,
                                                                 make_file_backend) -> None:
    c, backend = await _cache(kit, make_cache, make_file_backend)
    a = kit.tokens(3, 32)
    b = np.concatenate([a[:16], kit.tokens(4, 16)])
    ra = put(kit, c, a)
    rb = put(kit, c, b)  # splits a's node after 4 pages: the prefix is a new node
    prefix = c.tree.match_prefix(a[:16]).last_device_node
    assert ra.intents == [ra.last_node]
    assert rb.intents == [prefix, rb.last_node] and prefix != ra.last_node
    d2h = c.copy_engine.stats["d2h"].ops
    await c.flush()
    await c.storage.drain()
    assert c.copy_engine.stats["d2h"].ops == d2h + 1
    want = set(kit.page_keys(a)) | set(kit.page_keys(b))
    assert len(want) == 12 and stored_keys(backend.root) == want
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 48
    # a's intent covered the split-off prefix (its pages were being written): skipped.
    assert [intents(kit, c, o) for o in ("queued", "staged", "covered")] == [3, 2, 1]
    kit.assert_at_rest(c)


async def test_evicted_intent_is_stale_and_swept(kit, make_cache, make_file_backend) -> None:
    c, backend = await _cache(kit, make_cache, make_file_backend)
    a = kit.tokens(5, 32)
    put(kit, c, a)
    assert c.evict(10**6) == 32  # eviction wins over the queued intent
    await c.flush()
    await c.storage.drain()
    assert stored_keys(backend.root) == set()
    assert intents(kit, c, "stale") == 1
    assert kit.counter(c, "asynccache_storage_backup_skipped_tokens", reason="stale") == 32
    kit.assert_at_rest(c)


async def test_backlog_cap_sweeps_stale_intents(kit, make_cache, make_file_backend) -> None:
    c, backend = await _cache(kit, make_cache, make_file_backend, device_tokens=64)
    p = c.storage
    assert p.backlog_cap == 128
    seqs = [kit.tokens(10 + i, 64) for i in range(3)]
    for s in seqs[:2]:
        put(kit, c, s)
        assert c.evict(10**6) == 64
    assert p.queued_intents == 2  # 128 tokens queued: at the cap, stale but not swept yet
    put(kit, c, seqs[2])  # over the cap: the two stale intents are swept, this one queued
    assert p.queued_intents == 1 and intents(kit, c, "stale") == 2
    assert intents(kit, c, "backlog") == 0
    await p.drain()
    assert stored_keys(backend.root) == set(kit.page_keys(seqs[2]))
    kit.assert_at_rest(c)


async def test_write_window_limits_staging(kit, make_cache, make_file_backend) -> None:
    c, backend = await _cache(kit, make_cache, make_file_backend, host_tokens=256)
    p = c.storage
    # pool 256: window = max(256 - 0 - 25, 51) = 231 tokens -> 57 whole pages
    assert p.write_window() == 231
    s = kit.tokens(6, 400)
    put(kit, c, s)
    assert p.launch_writes() == 228
    assert p.write_staged == 228 and p.queued_intents == 1  # the rest waits at the head
    await p.drain()
    d2h = c.copy_engine.stats["d2h"]
    assert (d2h.ops, d2h.tokens) == (2, 400)  # 57 pages, then the remaining 43
    assert stored_keys(backend.root) == set(kit.page_keys(s))
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 400
    kit.assert_at_rest(c)
