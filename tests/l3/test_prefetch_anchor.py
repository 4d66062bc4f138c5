"""A prefetch from an anchor without a host copy (behavior.md 1.16, 1.17).

Under the write-through policies the tree drops a host insert below a node that is neither the
root nor backed up (``RadixTree.insert_host``: the host copies stay prefix-closed), so the tier
does not start such a prefetch (outcome ``declined_unbacked``), as the reference's scheduler
does not. Under write-back the tree keeps it (a host-only node below a device node).

A first cache writes the sequence to storage; a second one, on the same directory, caches its
first two pages on device (inserted once: not backed up under ``write_through_selective``) and
then serves the whole sequence.
"""

from __future__ import annotations

import pytest

from asynccache.l3 import StoragePolicy


async def _reader(kit, make_cache, make_file_backend, write_policy: str):
    writer = await make_cache(write_policy="write_through")
    backend = await make_file_backend(writer)
    writer.attach_storage(backend, StoragePolicy(prefetch_threshold=4))
    s = kit.tokens(9, 32)
    await kit.write_sequences(writer, [s])
    cache = await make_cache(write_policy=write_policy)
    cache.attach_storage(await make_file_backend(cache), StoragePolicy(prefetch_threshold=4))
    return cache, s


def _declined(kit, cache) -> int:
    return int(kit.counter(cache, "asynccache_prefetch_outcomes", outcome="declined_unbacked"))


@pytest.mark.parametrize(
    ("write_policy", "fetched"),
    [("write_through_selective", 0), ("write_through", 24), ("write_back", 24)],
)
async def test_a_prefetch_below_an_unbacked_anchor(kit, make_cache, make_file_backend,
                                                   write_policy: str, fetched: int) -> None:
    cache, s = await _reader(kit, make_cache, make_file_backend, write_policy)
    await kit.write_sequences(cache, [s[:8]])  # on device (backed up only by write_through)
    r = await kit.serve(cache, s)
    assert (r.device, r.host, r.fetched, r.loaded) == (8, 0, fetched, fetched)
    assert _declined(kit, cache) == (fetched == 0)
    assert kit.outcomes(cache) == ({"issued": 1, "completed": 1} if fetched else {})


async def test_the_selective_policy_prefetches_from_the_root(kit, make_cache,
                                                             make_file_backend) -> None:
    cache, s = await _reader(kit, make_cache, make_file_backend, "write_through_selective")
    r = await kit.serve(cache, s)
    assert (r.device, r.host, r.fetched, r.loaded) == (0, 0, 32, 32)
    assert _declined(kit, cache) == 0


async def test_the_selective_policy_prefetches_from_a_backed_up_anchor(
        kit, make_cache, make_file_backend) -> None:
    cache, s = await _reader(kit, make_cache, make_file_backend, "write_through_selective")
    await kit.write_sequences(cache, [s[:8], s[:8]])  # its second hit backs it up
    r = await kit.serve(cache, s)
    assert (r.device, r.host, r.fetched, r.loaded) == (8, 0, 24, 24)
    assert _declined(kit, cache) == 0
