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


async def test_attach_refuses_a_backend_of_another_layout(kit, make_cache, make_file_backend,
                                                          backends, tmp_path) -> None:
    """A backend whose layout disagrees with the cache's ``storage_layout()`` in anything that
    changes a page's bytes, their meaning or its object name is refused before anything
    changes, naming the field, the backend's value and the cache's (before, only the page size
    was checked: a float16 cache wrote its KV under a bfloat16 layout's names, and a bfloat16
    cache then served those bytes as its KV)."""
    import dataclasses

    from asynccache.storage.file import FileBackend

    c = await make_cache()  # float16, page 4, 2 layers x 2 heads x 8
    own = c.storage_layout()
    assert (own.model, own.page_size, own.kv_dtype, own.kv_layout, own.extra) == (
        "model", 4, "float16", "page-major", "L2H2D8")

    async def backend(name: str, **changes) -> FileBackend:
        b = FileBackend(tmp_path / name, dataclasses.replace(own, **changes))
        await b.start()
        backends.append(b)
        return b

    bf16 = await make_cache(dtype="bfloat16")
    wrong_dtype = FileBackend(tmp_path / "bf16", bf16.storage_layout())  # the probe's case
    await wrong_dtype.start()
    backends.append(wrong_dtype)
    refused = [
        (wrong_dtype, "backend layout kv_dtype 'bfloat16' != cache kv_dtype 'float16'"),
        (await backend("model", model="other/model"),
         "backend layout model 'other/model' != cache model 'model'"),
        (await backend("page", page_size=8), "backend layout page_size 8 != cache page_size 4"),
        (await backend("kvlayout", kv_layout="layer_first"),
         "backend layout kv_layout 'layer_first' != cache kv_layout 'page-major'"),
        (await backend("geometry", extra="L2H4D4"),  # as many bytes per token, other heads
         "backend layout extra 'L2H4D4' != cache extra 'L2H2D8' (the cache's geometry, "
         "optionally followed by '-<tag>')"),
        (await backend("geometry-tag", extra="L4H2D8-replaykv2"),
         "backend layout extra 'L4H2D8-replaykv2' != cache extra 'L2H2D8' (the cache's "
         "geometry, optionally followed by '-<tag>')"),
        (await backend("tp", tp_rank=1, tp_size=2),
         "backend layout tp_rank 1 != cache tp_rank 0; backend layout tp_size 2 != cache "
         "tp_size 1"),
        (await backend("replicated", kv_replicated=True),
         "backend layout kv_replicated True != cache kv_replicated False"),
        (await backend("pp", pp_rank=1, pp_size=2),
         "backend layout pp_rank 1 != cache pp_rank 0; backend layout pp_size 2 != cache "
         "pp_size 1"),
        (await backend("several", kv_dtype="bfloat16", page_size=16),
         "backend layout page_size 16 != cache page_size 4; backend layout kv_dtype "
         "'bfloat16' != cache kv_dtype 'float16'"),
    ]
    for b, message in refused:
        with pytest.raises(ConfigError) as err:
            c.attach_storage(b, StoragePolicy(prefetch_threshold=4))
        assert str(err.value) == message
        assert c.storage is None  # nothing attached, nothing changed
        c.sanity_check()

    # The cache's own layout, and its geometry followed by a caller's tag (the replay names
    # its pages apart with one), attach and serve.
    for seed, name, changes in ((5, "same", {}), (6, "tagged", {"extra": "L2H2D8-replaykv2"})):
        seq = kit.tokens(seed, 32)
        b = await backend(name, **changes)
        c.attach_storage(b, StoragePolicy(prefetch_threshold=4))
        assert c.storage is not None and c.storage.backend is b
        await kit.write_sequences(c, [seq])
        await kit.quiesce(c)
        assert len(list((tmp_path / name).rglob("*.kv"))) == 8
        c.sanity_check()
        assert await c.detach_storage() is True
        c.sanity_check()
    kit.assert_at_rest(c)


async def test_attach_ignores_tp_fields_of_replicated_kv(make_cache, backends, tmp_path) -> None:
    """With ``kv_replicated`` (MLA: every TP rank holds the whole KV) the TP rank and size are
    neither in a page's bytes nor in its name: a layout built for another TP rank attaches."""
    from asynccache.storage.file import FileBackend

    c = await make_cache(kv_replicated=True)
    other_rank = c.storage_layout(tp_rank=1, tp_size=2)
    assert other_rank.tag == c.storage_layout().tag
    b = FileBackend(tmp_path / "mla", other_rank)
    await b.start()
    backends.append(b)
    c.attach_storage(b, StoragePolicy(prefetch_threshold=4))
    assert c.storage.backend is b
    c.sanity_check()
