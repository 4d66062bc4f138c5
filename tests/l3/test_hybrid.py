"""Storage (L3) for hybrid models: a cache writes KV pages, SWA pages and Mamba states; a
second cache on the same storage (a new backend instance) prefetches and loads them back, bit
for bit. File backend and a real SeaweedFS S3 server."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asynccache.l3 import StoragePolicy

COMBOS = {
    "full+swa": {"sliding_window": 8, "swa_tokens": 256},
    "full+mamba": {"mamba_states": 4, "mamba_state_shape": (4, 3)},
    "full+swa+mamba": {"sliding_window": 8, "swa_tokens": 256, "mamba_states": 4,
                       "mamba_state_shape": (4, 3)},
}
TOKENS = list(range(1000, 1064))  # 16 pages of 4
POLICY = StoragePolicy(prefetch_threshold=16, prefetch_policy="wait_complete")


def _served(cache: Any, slots: Any) -> dict[str, torch.Tensor]:
    hy = cache.hybrid
    out = {"full": cache.device_pool.read_slots(slots)}
    if hy.swa_map is not None:  # the last window is what a match needs (and storage keeps)
        out["swa"] = hy.swa_pool.read_slots(hy.swa_map.translate(slots[len(slots) - 8 :]))
    if hy.mamba_pool is not None:
        m = cache.match_prefix(TOKENS, cow_mamba=True)
        assert m.device_prefix_len == len(TOKENS)
        out["mamba"] = hy.mamba_pool.states[m.mamba_cow_slot].clone()
    return out


async def _round_trip(make_cache: Any, open_backend: Any, combo: str) -> None:
    cfg = {**COMBOS[combo], "write_policy": "write_through"}
    a = await make_cache(**cfg)
    a.attach_storage(await open_backend(a), POLICY)
    g = torch.Generator().manual_seed(3)
    hy = a.hybrid
    for t in (a.device_pool.kv, *([hy.swa_pool.kv] if hy.swa_pool is not None else []),
              *([hy.mamba_pool.states] if hy.mamba_pool is not None else [])):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    slots = a.try_alloc_device(len(TOKENS))
    state = a.alloc_mamba_state() if hy.mamba_pool is not None else None
    a.insert(TOKENS, slots, mamba_value=state)
    want = _served(a, slots)
    await a.flush()
    await a.storage.drain()
    await a.detach_storage()
    await a.aclose()

    b = await make_cache(**cfg)
    b.attach_storage(await open_backend(b), POLICY)
    req = b.admit([*TOKENS, 1])
    assert (req.prefix_len, req.host_hit_length) == (0, 0)
    assert await b.prefetch_request(req) == len(TOKENS)
    assert await b.load_back_request(req) == len(TOKENS)
    b.sanity_check()
    got = _served(b, req.slots)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name
    b.abort_req(req)
    await b.flush()
    b.sanity_check()


@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_hybrid_round_trip_file_backend(make_cache, make_file_backend, combo) -> None:
    await _round_trip(make_cache, make_file_backend, combo)


@pytest.mark.seaweedfs
@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_hybrid_round_trip_seaweedfs(kit, make_cache, make_s3_backend, seaweed,
                                           combo) -> None:
    prefix = kit.new_prefix()

    async def open_backend(cache: Any) -> Any:
        return make_s3_backend(seaweed, cache, prefix)

    await _round_trip(make_cache, open_backend, combo)
