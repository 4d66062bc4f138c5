"""Storage that loses pages is written again (issue 23 item 5): the tier's belief that a page is
stored is dropped when a prefetch finds it missing or a read of it fails."""

from __future__ import annotations

import asyncio

from asynccache.l3 import StoragePolicy


async def _drop_from_tree(cache, n: int) -> None:
    cache.evict(n)
    cache.evict_host(n)


async def test_pages_another_writer_deleted_are_written_again(kit, make_cache,
                                                              make_file_backend) -> None:
    cache = await make_cache()
    backend = await make_file_backend(cache)
    cache.attach_storage(backend, StoragePolicy(prefetch_threshold=4))
    s = kit.tokens(9, 80)  # 20 pages
    await kit.write_sequences(cache, [s])
    keys = kit.page_keys(s)
    assert all(kit.object_path(backend, k).is_file() for k in keys)
    other = await make_file_backend(cache)  # another writer of the directory
    assert await other.delete(keys) == 20
    await _drop_from_tree(cache, 80)
    r = await kit.serve(cache, s)
    assert r.fetched == 0
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    await asyncio.wait_for(cache.storage.drain(), kit.TIMEOUT)
    assert [kit.object_path(backend, k).is_file() for k in keys] == [True] * 20


async def test_a_page_that_fails_to_read_is_written_again(kit, make_cache,
                                                          make_file_backend) -> None:
    cache = await make_cache()
    backend = await make_file_backend(cache)
    cache.attach_storage(backend, StoragePolicy(prefetch_threshold=4))
    s = kit.tokens(10, 32)
    await kit.write_sequences(cache, [s])
    keys = kit.page_keys(s)
    path = kit.object_path(backend, keys[3])
    path.write_bytes(path.read_bytes()[:-7])  # truncated: a corrupt page
    await _drop_from_tree(cache, 32)
    r = await kit.serve(cache, s)
    assert r.fetched == 12  # the three pages before it
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    await asyncio.wait_for(cache.storage.drain(), kit.TIMEOUT)
    await _drop_from_tree(cache, 32)
    r = await kit.serve(cache, s)
    assert r.fetched == 32  # rewritten whole


async def test_pages_the_backend_evicts_are_forgotten_at_once(kit, make_cache, make_file_backend,
                                                              tmp_path) -> None:
    """The tier listens to its backend: pages the file backend evicts for capacity stop being
    believed stored right away (no prefetch miss needed), so the next backup writes them."""
    probe = await make_cache()
    probe_backend = await make_file_backend(probe, root=tmp_path / "probe")
    probe.attach_storage(probe_backend)
    await kit.write_sequences(probe, [kit.tokens(1, 4)])
    page_bytes = kit.object_path(probe_backend, kit.page_keys(kit.tokens(1, 4))[0]).stat().st_size
    cache = await make_cache()
    backend = await make_file_backend(cache, root=tmp_path / "small",
                                      capacity_bytes=30 * page_bytes)
    cache.attach_storage(backend, StoragePolicy(prefetch_threshold=4))
    first, second = kit.tokens(21, 80), kit.tokens(22, 80)  # 20 pages each
    await kit.write_sequences(cache, [first])
    assert cache.storage.known_keys == 20
    await kit.write_sequences(cache, [second])
    gone = [k for k in kit.page_keys(first) if not kit.object_path(backend, k).is_file()]
    assert len(gone) >= 10  # the backend made room for the second prompt
    assert cache.storage.known_keys == 40 - len(gone)
    await _drop_from_tree(cache, 160)
    r = await kit.serve(cache, first)
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    await asyncio.wait_for(cache.storage.drain(), kit.TIMEOUT)
    assert r.fetched < 80
    stored = [kit.object_path(backend, k).is_file() for k in kit.page_keys(first)]
    assert stored == [True] * 20
