"""Buffer-only round trip on a CUDA device pool (pinned host staging); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from asynccache.l3 import StoragePolicy

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


async def test_cuda_buffer_round_trip_bit_exact(kit, make_cache, make_file_backend) -> None:
    policy = StoragePolicy(prefetch_threshold=16)
    s = kit.tokens(90, 600)
    a = await make_cache(device="cuda")
    assert a.host_pool.pinned
    a.attach_storage(await make_file_backend(a), policy)
    await kit.write_sequences(a, [s])
    assert kit.counter(a, "asynccache_storage_backup_tokens") == 600
    await kit.quiesce(a)
    await a.detach_storage()
    await a.aclose()
    b = await make_cache(device="cuda")
    b.attach_storage(await make_file_backend(b), policy)
    r = await kit.serve(b, s)  # verifies every token bit for bit
    assert (r.fetched, r.loaded) == (600, 600)
