"""Runtime storage administration (behavior.md §1.10): attach validates first and re-attaching
the same backend updates the policy; clear empties the backend and the known-key memory; detach
and clear report backend faults as results instead of raising; hashes of nodes cached before
the attach continue their chains."""

from __future__ import annotations

import pytest

from asynccache.errors import ConfigError
from asynccache.l3 import StoragePolicy


async def test_reattaching_the_same_backend_updates_the_policy(kit, make_cache,
                                                               make_file_backend) -> None:
    c = await make_cache()
    b = await make_file_backend(c)
    c.attach_storage(b, StoragePolicy(prefetch_threshold=4))
    tier = c.storage
    c.attach_storage(b, StoragePolicy(prefetch_threshold=64, prefetch_policy="wait_complete",
                                      prefetch_capacity_fraction=0.25, known_keys=3))
    assert c.storage is tier
    assert (tier.policy.prefetch_threshold, tier.policy.prefetch_policy) == (64, "wait_complete")
    assert tier._capacity_limit == 2048 // 4
    other = await make_file_backend(c, root=b.root.parent / "other")
    with pytest.raises(ConfigError, match="different storage backend"):
        c.attach_storage(other)
    with pytest.raises(ConfigError, match="StoragePolicy"):
        c.attach_storage(b, {"prefetch_threshold": 4})
    assert c.storage is tier and tier.policy.prefetch_threshold == 64
    kit.assert_at_rest(c)


async def test_clear_storage_removes_every_page(kit, make_cache, make_file_backend) -> None:
    seqs = [kit.tokens(1, 32), kit.tokens(2, 16)]
    w = await make_cache()
    b = await make_file_backend(w)
    w.attach_storage(b, StoragePolicy(prefetch_threshold=4))
    await kit.write_sequences(w, seqs)
    paths = [kit.object_path(b, k) for s in seqs for k in kit.page_keys(s)]
    assert all(p.exists() for p in paths) and len(paths) == 12
    assert w.storage.known_keys == 12
    assert await w.clear_storage() == 12
    assert not any(p.exists() for p in paths)
    assert w.storage.known_keys == 0
    fresh = await make_cache()
    fresh.attach_storage(await make_file_backend(fresh), StoragePolicy(prefetch_threshold=4))
    r = await kit.serve(fresh, seqs[0])
    assert r.fetched == 0
    kit.assert_at_rest(w)


async def test_backend_faults_are_results_not_crashes(kit, make_cache, make_file_backend) -> None:
    c = await make_cache()
    b = await make_file_backend(c)
    c.attach_storage(b, StoragePolicy(prefetch_threshold=4))
    await b.aclose()  # the backend dies under the engine
    assert await c.clear_storage() is None
    r = await kit.serve(c, kit.tokens(3, 32))  # the engine keeps serving (storage misses)
    assert r.fetched == 0
    await kit.quiesce(c)
    assert await c.detach_storage() is True
    assert await c.detach_storage() is True  # nothing attached: nothing to do
    with pytest.raises(ConfigError, match="no storage backend"):
        await c.clear_storage()


async def test_nodes_cached_before_attach_continue_their_chains(kit, make_cache,
                                                                make_file_backend) -> None:
    s = kit.tokens(4, 48)
    c = await make_cache()
    await kit.write_sequences(c, [s[:16]])  # cached (and on host) before storage exists
    b = await make_file_backend(c)
    c.attach_storage(b, StoragePolicy(prefetch_threshold=4))
    await kit.write_sequences(c, [s])  # extends the old prefix: only the new pages are written
    keys = kit.page_keys(s)
    assert [kit.object_path(b, k).exists() for k in keys] == [False] * 4 + [True] * 8
    assert c.tree.page_hashes(c.match_prefix(s).last_device_node) == keys
