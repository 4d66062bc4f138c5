"""Storage faults under the engine: a FaultInjectingBackend wrapping a real FileBackend.

Faults are injected below the page format (where real disks and networks fail), so the
backend's own checksum and degrade paths are what runs. Whatever fails, the engine serves zero
wrong KV (every prefetched and loaded page is compared bit for bit with the deterministic KV),
keeps working, and its accounting balances.
"""

from __future__ import annotations

import numpy as np
import pytest

from asynccache.l3 import StoragePolicy
from asynccache.storage.faults import FaultKind, FaultRule

# One page clears the bar; the write breaker stays shut (random faults can fail a few small
# batches in a row; tests/l3/test_alloc_waits_for_storage.py tests the breaker).
POLICY = StoragePolicy(prefetch_threshold=4, write_failure_threshold=10**6)
J = 5  # the page that faults


def _no_temp_files(root) -> None:
    left = [p.name for p in root.rglob("*") if p.is_file() and p.name.endswith(".tmp")]
    assert not left, f"temp files left behind: {left}"


@pytest.mark.parametrize(
    ("kind", "write_fails", "at_rest_bad"),
    [
        (FaultKind.EIO, True, False),
        (FaultKind.ENOSPC, True, False),
        (FaultKind.DROP, True, False),
        (FaultKind.PARTIAL_WRITE, False, True),
        (FaultKind.FLIP_BYTES, False, True),
        (FaultKind.DELAY, False, False),
    ],
)
async def test_write_fault_on_one_page(kit, make_cache, make_file_backend, storage_dir, kind,
                                       write_fails, at_rest_bad) -> None:
    s = kit.tokens(11, 64)
    keys = kit.page_keys(s)
    a = await make_cache()
    faulty = await make_file_backend(
        a, [FaultRule(kind, ops=frozenset({"write"}), keys=frozenset({keys[J]}), delay_s=0.01)])
    a.attach_storage(faulty, POLICY)
    await kit.write_sequences(a, [s])
    assert faulty.injected_total() == 1
    failed = 1 if write_fails else 0
    assert kit.counter(a, "asynccache_storage_backup_tokens") == (16 - failed) * kit.PS
    assert kit.counter(a, "asynccache_storage_backup_skipped_tokens",
                       reason="failed") == failed * kit.PS
    _no_temp_files(storage_dir)
    assert kit.object_path(faulty.inner, keys[J]).exists() != write_fails

    # A fresh cache on the same directory: only the pages before the bad one are served.
    b = await make_cache()
    b.attach_storage(await make_file_backend(b), POLICY)
    good = J if (write_fails or at_rest_bad) else 16
    r = await kit.serve(b, s)
    assert (r.fetched, r.loaded) == (good * kit.PS, good * kit.PS)
    if write_fails:  # the existence query stops at the missing page
        assert kit.outcomes(b) == {"issued": 1, "completed": 1}
        assert kit.counter(b, "asynccache_storage_prefetch_miss_tokens") == (16 - J) * kit.PS
    elif at_rest_bad:  # found, fetched, rejected by the checksum: a shorter prefix
        assert kit.outcomes(b) == {"issued": 1, "partial": 1}
        assert not kit.object_path(faulty.inner, keys[J]).exists()  # the bad object is removed
    else:
        assert kit.outcomes(b) == {"issued": 1, "completed": 1}
    await kit.quiesce(b)

    # B computed the pages it could not fetch and wrote them through: storage is whole again.
    assert kit.object_path(faulty.inner, keys[J]).exists()
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), POLICY)
    r = await kit.serve(c, s)
    assert (r.fetched, r.loaded) == (64, 64)


@pytest.mark.parametrize(
    ("kind", "object_survives"),
    [
        (FaultKind.EIO, True),
        (FaultKind.DROP, True),
        (FaultKind.SHORT_READ, False),
        (FaultKind.FLIP_BYTES, False),
        (FaultKind.DELAY, True),
    ],
)
async def test_read_fault_on_one_page(kit, make_cache, make_file_backend, kind,
                                      object_survives) -> None:
    s = kit.tokens(12, 64)
    keys = kit.page_keys(s)
    a = await make_cache()
    a.attach_storage(await make_file_backend(a), POLICY)
    await kit.write_sequences(a, [s])

    # B backs up only on a second hit, so it does not write the pages it recomputes.
    b = await make_cache(write_policy="write_through_selective")
    faulty = await make_file_backend(
        b, [FaultRule(kind, ops=frozenset({"read"}), keys=frozenset({keys[J]}), times=1,
                      delay_s=0.01)])
    b.attach_storage(faulty, POLICY)
    r = await kit.serve(b, s)
    assert faulty.injected_total() == 1
    good = 16 if kind is FaultKind.DELAY else J
    assert (r.fetched, r.loaded) == (good * kit.PS, good * kit.PS)
    assert kit.outcomes(b) == ({"issued": 1, "completed": 1} if good == 16
                               else {"issued": 1, "partial": 1})
    await kit.quiesce(b)
    assert kit.counter(b, "asynccache_storage_backup_tokens") == 0
    # A corrupt read (checksum) removes the object; an I/O error or a drop leaves it alone.
    assert kit.object_path(faulty.inner, keys[J]).exists() == object_survives

    # The engine keeps working: a fresh cache (no faults left) gets what storage still holds.
    c = await make_cache()
    c.attach_storage(await make_file_backend(c), POLICY)
    again = 16 if object_survives else J
    r = await kit.serve(c, s)
    assert (r.fetched, r.loaded) == (again * kit.PS, again * kit.PS)


WRITE_RULES = [
    FaultRule(FaultKind.EIO, rate=0.08, ops=frozenset({"write"})),
    FaultRule(FaultKind.ENOSPC, rate=0.08, ops=frozenset({"write"})),
    FaultRule(FaultKind.DROP, rate=0.05, ops=frozenset({"write"})),
    FaultRule(FaultKind.PARTIAL_WRITE, rate=0.08, ops=frozenset({"write"})),
    FaultRule(FaultKind.FLIP_BYTES, rate=0.08, ops=frozenset({"write"})),
    FaultRule(FaultKind.DELAY, rate=0.05, ops=frozenset({"write"}), delay_s=0.002),
]
READ_RULES = [
    FaultRule(FaultKind.EIO, rate=0.05, ops=frozenset({"read"})),
    FaultRule(FaultKind.DROP, rate=0.05, ops=frozenset({"read"})),
    FaultRule(FaultKind.SHORT_READ, rate=0.05, ops=frozenset({"read"})),
    FaultRule(FaultKind.FLIP_BYTES, rate=0.05, ops=frozenset({"read"})),
    FaultRule(FaultKind.DELAY, rate=0.05, ops=frozenset({"read"}), delay_s=0.002),
    FaultRule(FaultKind.EIO, rate=0.05, ops=frozenset({"exists"})),
]


async def test_random_faults_never_serve_wrong_kv(kit, make_cache, make_file_backend,
                                                  storage_dir) -> None:
    """Many sequences with shared prefixes through seeded random write and read faults of every
    kind: every served token is verified, every request completes, accounting balances, and
    the engine's counters agree with what the injector did."""
    base = [kit.tokens(100 + i, 48) for i in range(3)]
    seqs = [np.concatenate([base[i % 3], kit.tokens(200 + i, 40 + 4 * i + i % 3)])
            for i in range(12)]

    a = await make_cache()
    wfaulty = await make_file_backend(a, WRITE_RULES, seed=7)
    a.attach_storage(wfaulty, POLICY)
    await kit.write_sequences(a, seqs)
    inj = wfaulty.stats()["injected"]
    for kind in ("eio", "enospc", "drop", "partial_write", "flip_bytes", "delay"):
        assert inj.get(f"write.{kind}", 0) > 0, (kind, inj)
    # (an injected ENOSPC is capacity pressure: the backend evicts and retries once, so some of
    # those pages are stored after all; count what the backend says failed)
    faults = wfaulty.stats()["faults"]
    failed_pages = sum(faults.get(f"set.{r}", 0) for r in ("io_error", "no_space", "connection"))
    # the 12-page prefixes are shared by 4 sequences each and written once
    total_pages = sum(len(s) // kit.PS for s in seqs) - 12 * 9
    assert kit.counter(a, "asynccache_storage_backup_skipped_tokens",
                       reason="failed") == failed_pages * kit.PS
    assert kit.counter(a, "asynccache_storage_backup_tokens") == (
        total_pages - failed_pages) * kit.PS
    _no_temp_files(storage_dir)
    await kit.quiesce(a)

    # Two more caches read it all back through read faults; every token served is verified.
    seen: dict[str, int] = {}
    for round_, seed in enumerate((1, 2)):
        b = await make_cache()
        rfaulty = await make_file_backend(b, READ_RULES, seed=seed)
        b.attach_storage(rfaulty, POLICY)
        fetched = 0
        for s in seqs:
            r = await kit.serve(b, s)
            fetched += r.fetched
        await kit.quiesce(b)
        assert rfaulty.injected_total() > 0, round_
        for k, v in rfaulty.stats()["injected"].items():
            seen[k] = seen.get(k, 0) + v
        assert kit.counter(b, "asynccache_prefetched_tokens") == fetched
        o = kit.outcomes(b)
        ends = sum(o.get(k, 0) for k in ("completed", "partial", "revoked_insufficient",
                                         "revoked_no_host_memory"))
        assert ends == o.get("issued", 0)
        assert fetched > 0
    for kind in ("eio", "drop", "short_read", "flip_bytes", "delay"):
        assert seen.get(f"read.{kind}", 0) > 0, (kind, seen)
