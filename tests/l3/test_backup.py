"""Storage backup (L2 -> L3), restarts of the file backend, and corruption at rest."""

from __future__ import annotations

import asyncio
import os

import numpy as np

from asynccache.l3 import StoragePolicy
from asynccache.storage.faults import FaultKind, FaultRule

POLICY = StoragePolicy(prefetch_threshold=4, prefetch_policy="wait_complete")


def _faults(backend, op: str) -> int:
    return sum(v for k, v in backend.stats()["faults"].items() if k.startswith(f"{op}."))


async def test_second_identical_backup_writes_nothing(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(31, 64)
    a = await make_cache()
    backend = await make_file_backend(a)
    a.attach_storage(backend, POLICY)
    await kit.write_sequences(a, [s])
    assert kit.counter(a, "asynccache_storage_backup_tokens") == 64
    assert kit.counter(a, "asynccache_storage_backup_skipped_tokens", reason="exists") == 0
    assert backend.stats()["pages"] == {"set.written": 16}

    a.evict(10**6)
    a.evict_host(10**6)
    assert a.host_size == 0 and a.tree.device_size == 0
    await kit.write_sequences(a, [s])  # computed again and backed up to host again
    await kit.quiesce(a)
    assert a.host_size == 64
    assert kit.counter(a, "asynccache_storage_backup_tokens") == 64
    assert kit.counter(a, "asynccache_storage_backup_skipped_tokens", reason="exists") == 64
    assert backend.stats()["pages"] == {"set.written": 16}  # not even asked


async def test_skipped_pages_of_a_partly_known_node_are_counted(kit, make_cache,
                                                                make_file_backend) -> None:
    s = kit.tokens(32, 64)
    a = await make_cache()
    backend = await make_file_backend(a)
    a.attach_storage(backend, POLICY)
    await kit.write_sequences(a, [s])
    a.evict(10**6)
    a.evict_host(10**6)
    s2 = np.concatenate([s[:32], kit.tokens(33, 32)])  # one node: 8 known pages + 8 new ones
    await kit.write_sequences(a, [s2])
    await kit.quiesce(a)
    assert backend.stats()["pages"] == {"set.written": 24}
    assert kit.counter(a, "asynccache_storage_backup_tokens") == 96
    assert kit.counter(a, "asynccache_storage_backup_skipped_tokens", reason="exists") == 32


async def test_backup_pins_host_pages_until_written(kit, make_cache, make_file_backend) -> None:
    """A page being written to storage cannot be evicted from host memory under the writer."""
    s = kit.tokens(34, 64)
    a = await make_cache()
    slow = await make_file_backend(a, [FaultRule(FaultKind.DELAY, ops=frozenset({"write"}),
                                                 delay_s=0.2)])
    a.attach_storage(slow, POLICY)
    req = a.admit(s)
    await kit.compute_rest(a, req)
    a.cache_finished_req(req)
    await asyncio.wait_for(a.flush(), kit.TIMEOUT)  # the D->H copy landed; the write is slow
    assert a.storage._writes
    a.evict(10**6)  # host only now
    assert a.evict_host(10**6) == 0  # pinned by the storage write
    assert a.host_size == 64
    await asyncio.wait_for(a.storage.drain(), kit.TIMEOUT)
    assert kit.counter(a, "asynccache_storage_backup_tokens") == 64
    assert a.evict_host(10**6) == 64
    kit.assert_at_rest(a)


async def test_restart_keeps_the_objects(kit, make_cache, make_file_backend, storage_dir) -> None:
    s1, s2, s3 = kit.tokens(35, 64), kit.tokens(36, 100), kit.tokens(37, 48)
    a = await make_cache()
    a.attach_storage(await make_file_backend(a), POLICY)
    await kit.write_sequences(a, [s1, s2])
    await kit.quiesce(a)
    await a.detach_storage()
    await a.aclose()

    b = await make_cache()
    backend_b = await make_file_backend(b)  # a new instance: its index is rebuilt from disk
    assert backend_b.stats()["objects"] == 16 + 25
    b.attach_storage(backend_b, POLICY)
    r = await kit.serve(b, s1)
    assert (r.fetched, r.loaded) == (64, 64)
    await kit.write_sequences(b, [s3])  # B adds pages of its own
    await kit.quiesce(b)
    await b.detach_storage()
    await b.aclose()

    c = await make_cache()
    backend_c = await make_file_backend(c)
    assert backend_c.stats()["objects"] == 16 + 25 + 12
    c.attach_storage(backend_c, POLICY)
    for s, n in ((s1, 64), (s2, 100), (s3, 48)):
        r = await kit.serve(c, s)
        whole = n - n % kit.PS
        assert (r.fetched, r.loaded) == (whole, whole)
    assert kit.outcomes(c) == {"issued": 3, "completed": 3}


async def test_corrupt_files_on_disk_are_misses(kit, make_cache, make_file_backend) -> None:
    """Five kinds of damage at rest, each to one page of its own sequence: a flipped payload
    byte, a flipped header byte, a truncated file, an empty file, and another page's (valid)
    object copied over it. Each is detected on read: the prefix before it is served, the bad
    object is removed, and the loss is counted."""
    seqs = [kit.tokens(40 + i, 64) for i in range(5)]
    bad_at = [5, 0, 9, 15, 3]
    a = await make_cache()
    backend = await make_file_backend(a)
    a.attach_storage(backend, POLICY)
    await kit.write_sequences(a, seqs)
    paths = [kit.object_path(backend, kit.page_keys(s)[j]) for s, j in zip(seqs, bad_at,
                                                                           strict=True)]

    def flip(path, offset: int) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))

    size = paths[0].stat().st_size
    flip(paths[0], size - 7)  # payload
    flip(paths[1], 13)  # header (payload length field)
    os.truncate(paths[2], size // 2)
    os.truncate(paths[3], 0)
    paths[4].write_bytes(kit.object_path(backend, kit.page_keys(seqs[0])[1]).read_bytes())

    b = await make_cache(write_policy="write_through_selective")  # writes nothing back here
    b_backend = await make_file_backend(b)
    b.attach_storage(b_backend, POLICY)
    fetched = []
    for s in seqs:
        r = await kit.serve(b, s)  # serve() verifies every served token bit for bit
        fetched.append(r.fetched)
    await kit.quiesce(b)
    assert fetched == [j * kit.PS for j in bad_at]
    assert not [p for p in paths if p.exists()]
    assert _faults(b_backend, "get") == 5
    assert kit.outcomes(b) == {"issued": 5, "partial": 5}


async def test_concurrent_prefetches_of_overlapping_prompts(kit, make_cache,
                                                            make_file_backend) -> None:
    bases = [kit.tokens(50 + i, 40) for i in range(2)]
    seqs = [np.concatenate([bases[i % 2], kit.tokens(60 + i, 24 + 4 * i)]) for i in range(8)]
    a = await make_cache()
    a.attach_storage(await make_file_backend(a), POLICY)
    await kit.write_sequences(a, seqs)
    await kit.quiesce(a)
    await a.detach_storage()
    await a.aclose()

    b = await make_cache()
    b.attach_storage(await make_file_backend(b), POLICY)
    results = await asyncio.wait_for(
        asyncio.gather(*(kit.serve(b, s) for s in seqs + seqs[:4])), kit.TIMEOUT)
    await kit.quiesce(b)
    for s, r in zip(seqs + seqs[:4], results, strict=True):
        assert r.prefix == len(s)  # every token came from some tier (and was verified)
    assert kit.counter(b, "asynccache_storage_backup_tokens") == 0
