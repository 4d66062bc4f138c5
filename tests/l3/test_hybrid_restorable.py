"""Hybrid (SWA / Mamba) prefetch restores the longest restorable prefix (asynccache/l3_hybrid.py).

A writer cache stores one conversation of 600 tokens (150 pages of 4) inserted in two turns, so
storage holds a Mamba state at the end of each turn (tokens 300 and 600) and the SWA pages of
both nodes. A fresh cache on the same storage then prefetches the conversation while parts of
it are missing, corrupt, slow or short of host memory, and must restore exactly the deepest
prefix every pool can restore — bit for bit (KV, the SWA window, the state) — or nothing, with
every host slot of every pool accounted for. File backend and a real SeaweedFS S3 server.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from asynccache.l3 import StoragePolicy

N = 600  # 150 pages: two read batches (128 + 22)
T1 = 300  # the first turn ends here (75 pages)
WINDOW = 8  # sliding window: 2 pages
MAMBA = {"mamba_states": 4, "mamba_state_shape": (4, 3)}
SWA = {"sliding_window": WINDOW, "swa_tokens": 1024}
COMBOS = {"full+swa": SWA, "full+mamba": MAMBA, "full+swa+mamba": {**SWA, **MAMBA}}
WITH_MAMBA = ["full+mamba", "full+swa+mamba"]
POLICY = StoragePolicy(prefetch_threshold=16, prefetch_policy="wait_complete")
FALLBACK = "asynccache_prefetch_component_fallback_tokens"


def _randomize(cache: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    hy = cache.hybrid
    for t in (cache.device_pool.kv, *([hy.swa_pool.kv] if hy.swa_pool is not None else []),
              *([hy.mamba_pool.states] if hy.mamba_pool is not None else [])):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def _snapshot(cache: Any, slots: Any, state: int | None) -> dict[str, torch.Tensor]:
    """What a cache holding ``slots`` (a prefix) and ``state`` must serve for it."""
    hy = cache.hybrid
    out = {"full": cache.device_pool.read_slots(slots).clone()}
    if hy.swa_map is not None:  # the last window is what a match needs (and storage keeps)
        out["swa"] = hy.swa_pool.read_slots(hy.swa_map.translate(slots[len(slots) - WINDOW :]))
    if state is not None:
        out["mamba"] = hy.mamba_pool.states[state].clone()
    return out


async def _store(kit: Any, make_cache: Any, open_backend: Any, combo: str,
                 ) -> tuple[list[int], dict[int, dict[str, torch.Tensor]]]:
    """Write the two-turn conversation; returns its tokens and what each turn must serve."""
    toks = [int(t) for t in kit.tokens(5, N)]
    a = await make_cache(**COMBOS[combo])
    a.attach_storage(await open_backend(a), POLICY)
    _randomize(a, 3)
    hy = a.hybrid
    slots = a.try_alloc_device(N)
    want: dict[int, dict[str, torch.Tensor]] = {}
    s1 = a.alloc_mamba_state() if hy.mamba_pool is not None else None
    want[T1] = _snapshot(a, slots[:T1], s1)
    a.insert(toks[:T1], slots[:T1], mamba_value=s1)
    await a.flush()
    s2 = a.alloc_mamba_state() if hy.mamba_pool is not None else None
    want[N] = _snapshot(a, slots, s2)
    a.insert(toks, slots, prev_prefix_len=T1, mamba_value=s2)
    await a.flush()
    await a.storage.drain()
    await a.detach_storage()
    await a.aclose()
    return toks, want


def _served(cache: Any, toks: list[int], slots: Any) -> dict[str, torch.Tensor]:
    hy = cache.hybrid
    p = len(slots)
    out = {"full": cache.device_pool.read_slots(slots)}
    if hy.swa_map is not None:
        out["swa"] = hy.swa_pool.read_slots(hy.swa_map.translate(slots[p - WINDOW :]))
    if hy.mamba_pool is not None:
        m = cache.match_prefix(toks, cow_mamba=True)
        assert m.device_prefix_len == p
        out["mamba"] = hy.mamba_pool.states[m.mamba_cow_slot].clone()
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


def _balanced(kit: Any, cache: Any, own_receipts: int = 0) -> None:
    """Nothing in flight in any pool (KV, SWA, Mamba) and the accounting balances."""
    kit.assert_at_rest(cache, own_receipts=own_receipts)
    assert all(v == 0 for v in cache.hybrid.tier.inflight.values()), cache.hybrid.tier.inflight


async def _serve(kit: Any, cache: Any, toks: list[int], want: dict[int, Any], expect: int,
                 policy: str | None = None) -> None:
    """Prefetch ``toks`` into a fresh request: exactly ``expect`` tokens come, bit for bit."""
    req = cache.admit([*toks, 1])
    assert (req.prefix_len, req.host_hit_length) == (0, 0)
    got = await asyncio.wait_for(cache.prefetch_request(req, policy=policy), kit.TIMEOUT)
    assert got == expect
    _balanced(kit, cache, own_receipts=(req.receipt is not None) + (req.host_receipt is not None))
    if expect:
        assert await asyncio.wait_for(cache.load_back_request(req), kit.TIMEOUT) == expect
        cache.sanity_check()
        _assert_same(_served(cache, toks, req.slots[:expect]), want[expect])
    else:
        assert cache.match_prefix(toks).host_hit_length == 0
    cache.abort_req(req)
    await kit.quiesce(cache)
    _balanced(kit, cache)


def _fallbacks(kit: Any, cache: Any) -> dict[str, int]:
    out = {}
    for reason in ("not_stored", "host_memory", "stopped", "fault"):
        v = int(kit.counter(cache, FALLBACK, reason=reason))
        if v:
            out[reason] = v
    return out


def _kv_pages_read(backend: Any) -> int:
    return sum(v for k, v in backend.stats()["pages"].items() if k == "get.hit")


# -- a missing state ---------------------------------------------------------------------------


async def _missing_last_state(kit: Any, make_cache: Any, open_backend: Any, combo: str) -> None:
    toks, want = await _store(kit, make_cache, open_backend, combo)
    keys = kit.page_keys(toks)
    b = await make_cache(**COMBOS[combo])
    backend = await open_backend(b)
    assert await backend.delete([f"{keys[-1]}.mamba"]) == 1
    b.attach_storage(backend, POLICY)
    before = _kv_pages_read(backend)
    await _serve(kit, b, toks, want, T1)
    # Only the restorable prefix was read: 75 KV pages, its window's SWA pages, one state.
    extra = (WINDOW // kit.PS if b.hybrid.swa_map is not None else 0) + 1
    assert _kv_pages_read(backend) - before == T1 // kit.PS + extra
    assert _fallbacks(kit, b) == {"not_stored": N - T1}
    assert kit.counter(b, "asynccache_storage_prefetch_hit_tokens") == T1
    assert kit.outcomes(b) == {"issued": 1, "completed": 1}


@pytest.mark.parametrize("combo", WITH_MAMBA)
async def test_missing_last_state_restores_the_first_turn_file(kit, make_cache, make_file_backend,
                                                                combo) -> None:
    await _missing_last_state(kit, make_cache, make_file_backend, combo)


@pytest.mark.seaweedfs
@pytest.mark.parametrize("combo", WITH_MAMBA)
async def test_missing_last_state_restores_the_first_turn_seaweedfs(
        kit, make_cache, make_s3_backend, seaweed, combo) -> None:
    prefix = kit.new_prefix()

    async def open_backend(cache: Any) -> Any:
        return make_s3_backend(seaweed, cache, prefix)

    await _missing_last_state(kit, make_cache, open_backend, combo)


@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_intact_store_restores_everything(kit, make_cache, make_file_backend,
                                                combo) -> None:
    toks, want = await _store(kit, make_cache, make_file_backend, combo)
    b = await make_cache(**COMBOS[combo])
    b.attach_storage(await make_file_backend(b), POLICY)
    await _serve(kit, b, toks, want, N)
    assert _fallbacks(kit, b) == {}
