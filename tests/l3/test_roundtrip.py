"""Round trips through all three tiers: device -> host -> storage with one cache, storage -> host
-> device with a fresh cache on the same storage, bytes equal bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from asynccache.l3 import StoragePolicy
from asynccache.tree import RadixKey


def _seqs(kit):
    s1 = kit.tokens(1, 67)  # 16 pages + an unaligned tail of 3 (never stored)
    s2 = np.concatenate([s1[:32], kit.tokens(2, 40)])  # shares 8 pages with s1, 10 of its own
    s3 = kit.tokens(3, 600)  # 150 pages: two read batches (128 + 22)
    return s1, s2, s3


async def _round_trip(kit, make_cache, open_backend, layout: str) -> None:
    s1, s2, s3 = _seqs(kit)
    policy = StoragePolicy(prefetch_threshold=16)

    # Cache A writes through host to storage, then goes away.
    a = await make_cache(host_layout=layout)
    a.attach_storage(await open_backend(a), policy)
    await kit.write_sequences(a, [s1, s2, s3])
    assert kit.counter(a, "asynccache_storage_backup_tokens") == (16 + 10 + 150) * kit.PS
    assert kit.counter(a, "asynccache_storage_backup_skipped_tokens", reason="exists") == 0
    assert kit.counter(a, "asynccache_storage_backup_skipped_tokens", reason="failed") == 0
    await kit.quiesce(a)
    await a.detach_storage()
    await a.aclose()

    # Cache B starts empty on the same storage (a new backend instance).
    b = await make_cache(host_layout=layout)
    b.attach_storage(await open_backend(b), policy)
    r1 = await kit.serve(b, s1)
    assert (r1.device, r1.host, r1.fetched, r1.loaded) == (0, 0, 64, 64)
    r2 = await kit.serve(b, s2)  # its first 8 pages are on B's device now (from s1)
    assert (r2.device, r2.host, r2.fetched, r2.loaded) == (32, 0, 40, 40)
    r3 = await kit.serve(b, s3)
    assert (r3.device, r3.host, r3.fetched, r3.loaded) == (0, 0, 600, 600)

    assert kit.counter(b, "asynccache_prefetched_tokens") == 704
    assert kit.counter(b, "asynccache_storage_prefetch_hit_tokens") == 704
    assert kit.counter(b, "asynccache_storage_prefetch_miss_tokens") == 0
    assert kit.outcomes(b) == {"issued": 3, "completed": 3}
    # B found everything in storage and so wrote nothing back.
    await kit.quiesce(b)
    assert kit.counter(b, "asynccache_storage_backup_tokens") == 0

    # A fourth look: everything is now a device hit, nothing is fetched again.
    r4 = await kit.serve(b, s3)
    assert (r4.device, r4.fetched, r4.loaded) == (600, 0, 0)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_round_trip_file_backend(kit, make_cache, make_file_backend, layout) -> None:
    await _round_trip(kit, make_cache, make_file_backend, layout)


@pytest.mark.seaweedfs
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_round_trip_seaweedfs(kit, make_cache, make_s3_backend, seaweed, layout) -> None:
    prefix = kit.new_prefix()

    async def open_backend(cache):
        return make_s3_backend(seaweed, cache, prefix)

    await _round_trip(kit, make_cache, open_backend, layout)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_prefetch_continues_the_chain_below_device_and_host_hits(
        kit, make_cache, make_file_backend, layout) -> None:
    """A prefetch starts after the device prefix *and* the host hit: its page keys continue the
    hash chain of the anchor node, and the load-back brings host + fetched pages in one go."""
    s = kit.tokens(3, 600)
    a = await make_cache(host_layout=layout)
    a.attach_storage(await make_file_backend(a), StoragePolicy(prefetch_threshold=16))
    await kit.write_sequences(a, [s])
    await kit.quiesce(a)
    await a.detach_storage()

    b = await make_cache(host_layout=layout)
    b.attach_storage(await make_file_backend(b), StoragePolicy(prefetch_threshold=16))
    await kit.write_sequences(b, [s[:80]])  # device + host copy of [0, 80)
    b.evict(10**6)  # [0, 80) now host only
    await kit.write_sequences(b, [s[:40]])  # loads [0, 40) back: device [0, 40), host [40, 80)
    r = await kit.serve(b, s)
    assert (r.device, r.host, r.fetched, r.loaded) == (40, 40, 520, 560)
    assert kit.outcomes(b) == {"issued": 1, "completed": 1}
    assert kit.counter(b, "asynccache_storage_prefetch_hit_tokens") == 520


async def test_objects_are_named_by_the_independent_hash_chain(kit, make_cache,
                                                              make_file_backend) -> None:
    """Every stored page sits at ``<root>/<key[:2]>/<key>.<layout tag>.kv`` with ``key`` the
    SHA-256 page chain of behavior.md §1.14, computed here without the tree; a namespace
    changes every key, so namespaces never share storage objects."""
    s = kit.tokens(5, 64)
    a = await make_cache()
    backend = await make_file_backend(a)
    a.attach_storage(backend, StoragePolicy(prefetch_threshold=16))
    await kit.write_sequences(a, [s])
    keys = kit.page_keys(s)
    assert len(keys) == 16
    assert all(kit.object_path(backend, k).is_file() for k in keys)
    assert backend.stats()["objects"] == 16

    # Same tokens in a namespace: a storage miss, not somebody else's KV.
    b = await make_cache()
    b.attach_storage(await make_file_backend(b), StoragePolicy(prefetch_threshold=16))
    r = await kit.serve(b, RadixKey(s, extra_key="tenant-a"))
    assert (r.fetched, r.loaded) == (0, 0)
    assert kit.outcomes(b) == {"issued": 1, "revoked_insufficient": 1}
    await kit.quiesce(b)
    ns_keys = kit.page_keys(s, namespace="tenant-a")
    assert not set(ns_keys) & set(keys)
    assert all(kit.object_path(backend, k).is_file() for k in ns_keys)  # B wrote its own

    # A third cache finds the namespaced pages under the namespace only.
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), StoragePolicy(prefetch_threshold=16))
    r = await kit.serve(c, RadixKey(s, extra_key="tenant-a"))
    assert (r.fetched, r.loaded) == (64, 64)
