"""Storage faults under the buffer-only host: a FaultInjectingBackend wrapping a real
FileBackend. Failed writes are not believed stored (so they are retried on the next qualifying
hit); failed or corrupt reads are misses; the served KV is always bit for bit the computed KV."""

from __future__ import annotations

import pytest

from asynccache.l3 import StoragePolicy
from asynccache.storage.faults import FaultKind, FaultRule

POLICY = StoragePolicy(prefetch_threshold=4)
J = 5  # the page that faults


@pytest.mark.parametrize("kind", [FaultKind.EIO, FaultKind.ENOSPC, FaultKind.DROP])
async def test_failed_write_is_not_believed_and_is_retried(kit, make_cache, make_file_backend,
                                                           kind) -> None:
    s = kit.tokens(11, 64)
    keys = kit.page_keys(s)
    c = await make_cache()
    faulty = await make_file_backend(
        c, [FaultRule(kind, ops=frozenset({"write"}), keys=frozenset({keys[J]}))])
    c.attach_storage(faulty, POLICY)
    p = c.storage
    await kit.write_sequences(c, [s])
    assert faulty.injected_total() == 1
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 15 * kit.PS
    assert kit.counter(c, "asynccache_storage_backup_skipped_tokens", reason="failed") == kit.PS
    assert p.existence.missing(keys) == [J]
    assert await faulty.exists_prefix(keys) == J
    kit.assert_at_rest(c)
    # The next hit qualifies the node again; only the missing page is staged and written.
    faulty.clear_rules()
    await kit.write_sequences(c, [s])
    assert kit.counter(c, "asynccache_storage_backup_tokens") == 16 * kit.PS
    assert await faulty.exists_prefix(keys) == 16
    assert p.existence.covered(keys)


@pytest.mark.parametrize("kind", [FaultKind.FLIP_BYTES, FaultKind.SHORT_READ, FaultKind.EIO])
async def test_read_fault_is_a_miss_and_serves_correct_kv(kit, make_cache, make_file_backend,
                                                          kind) -> None:
    s = kit.tokens(12, 64)
    keys = kit.page_keys(s)
    w = await make_cache()
    w.attach_storage(await make_file_backend(w), POLICY)
    await kit.write_sequences(w, [s])
    await kit.quiesce(w)
    await w.detach_storage()
    await w.aclose()

    c = await make_cache()
    faulty = await make_file_backend(
        c, [FaultRule(kind, ops=frozenset({"read"}), keys=frozenset({keys[J]}), times=1)])
    c.attach_storage(faulty, POLICY)
    r = await kit.serve(c, s)  # verifies every served token bit for bit
    assert (r.fetched, r.loaded) == (J * kit.PS, J * kit.PS)
    assert faulty.injected_total() == 1
    assert kit.outcomes(c) == {"issued": 1, "partial": 1}
    # Beliefs past the failed page are dropped; the recomputed pages are written (again).
    assert c.storage.existence.missing(keys) == list(range(J, 16))
    await kit.quiesce(c)
    assert c.storage.existence.missing(keys) == []
    assert kit.counter(c, "asynccache_storage_backup_tokens") == (16 - J) * kit.PS
    assert await faulty.exists_prefix(keys) == 16
    faulty.clear_rules()
    c.evict(10**6)
    r = await kit.serve(c, s)
    assert (r.fetched, r.loaded) == (64, 64)


async def test_all_reads_failing_degrades_to_recompute(kit, make_cache, make_file_backend) -> None:
    s = kit.tokens(13, 64)
    w = await make_cache()
    w.attach_storage(await make_file_backend(w), POLICY)
    await kit.write_sequences(w, [s])
    await kit.quiesce(w)
    await w.detach_storage()
    await w.aclose()
    c = await make_cache()
    faulty = await make_file_backend(c, [FaultRule(FaultKind.EIO, ops=frozenset({"read"}))])
    c.attach_storage(faulty, POLICY)
    r = await kit.serve(c, s)
    assert (r.fetched, r.loaded, r.prefix) == (0, 0, 0)
    kit.assert_at_rest(c)
