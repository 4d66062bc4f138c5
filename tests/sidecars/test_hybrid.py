"""Sidecars on hybrid caches (SWA / Mamba): a draft model's KV and a KV-derived indexer, an SWA-derived sidecar (slots
of the SWA pool) and a Mamba-derived one (one row per state) ride backups, load-backs, the
state's copy-on-write, retraction and storage (``<key>.<name>`` objects next to ``.swa`` /
``.mamba``), bit for bit; a missing SWA- or state-sidecar object makes its component count as
not stored (the prefetch falls back like for a missing ``.swa`` / ``.mamba``)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from asynccache.l3 import StoragePolicy
from asynccache.transfers.sidecars import SidecarSpec

INDEXER = SidecarSpec(name="indexer", source="kv", token_shape=(4,), dtype="float32")
DRAFT = SidecarSpec(name="draft", source="kv", token_shape=(2, 2, 8), dtype="float16",
                    num_layers=1)  # a draft model's KV (what register_draft_pools makes)
SWA_SIDE = SidecarSpec(name="swa_side", source="swa", token_shape=(3,), dtype="float16",
                       num_layers=2, hit_policy="trailing_pages")
STATE_SIDE = SidecarSpec(name="state_side", source="mamba", token_shape=(5,), dtype="float32",
                         hit_policy="trailing_pages")

COMBOS = {
    "full+swa": {"sliding_window": 4, "swa_tokens": 32},
    "full+mamba": {"mamba_states": 4, "mamba_state_shape": (3, 5)},
    "full+swa+mamba": {"sliding_window": 4, "swa_tokens": 32, "mamba_states": 4,
                       "mamba_state_shape": (3, 5)},
}
HOST = {"page_size": 2, "device_tokens": 32, "host_tokens": 64, "write_policy": "write_through",
        "load_back_threshold": 0}
TOKENS = list(range(100, 112))


def specs(cfg: dict[str, Any]) -> list[SidecarSpec]:
    out = [DRAFT, INDEXER]
    if cfg.get("sliding_window"):
        out.append(SWA_SIDE)
    if cfg.get("mamba_states"):
        out.append(STATE_SIDE)
    return out


def randomize(cache: Any, seed: int) -> None:
    """Seeded random values in every device pool, the sidecars' included."""
    g = torch.Generator().manual_seed(seed)
    hy = cache.hybrid
    pools = [cache.device_pool.kv, *(s.device.data for s in cache.sidecars)]
    if hy.swa_pool is not None:
        pools.append(hy.swa_pool.kv)
    if hy.mamba_pool is not None:
        pools.append(hy.mamba_pool.states)
    for t in pools:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def zero_device(cache: Any) -> None:
    hy = cache.hybrid
    for t in (cache.device_pool.kv, *(s.device.data for s in cache.sidecars),
              *([hy.swa_pool.kv] if hy.swa_pool is not None else []),
              *([hy.mamba_pool.states] if hy.mamba_pool is not None else [])):
        t.zero_()


def served(cache: Any, slots: np.ndarray, swa_tail: int, state: int | None) -> dict[str, Any]:
    """What the cache holds for ``slots`` (FULL), the SWA of their last ``swa_tail`` tokens and
    Mamba state ``state``: every pool, every sidecar."""
    hy = cache.hybrid
    swa_full = slots[len(slots) - swa_tail :]
    out: dict[str, Any] = {"full": cache.device_pool.read_slots(slots)}
    if hy.swa_map is not None:
        out["swa"] = hy.swa_pool.read_slots(hy.swa_map.translate(swa_full))
    if state is not None:
        out["mamba"] = hy.mamba_pool.states[state].clone()
    for s in cache.sidecars:
        if s.spec.source == "kv":
            idx = slots
        elif s.spec.source == "swa":
            idx = hy.swa_map.translate(swa_full)
        else:
            idx = np.array([state])
        out[s.name] = s.device.read_slots(idx)
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


async def _make(make_cache: Any, combo: str, **kw: Any) -> Any:
    cfg = {**HOST, **COMBOS[combo], **kw}
    return await make_cache(sidecars=specs(cfg), **cfg)


async def _cached(make_cache: Any, combo: str, **kw: Any) -> tuple[Any, dict[str, Any]]:
    cache = await _make(make_cache, combo, **kw)
    randomize(cache, 7)
    slots = cache.try_alloc_device(len(TOKENS))
    state = cache.alloc_mamba_state() if cache.hybrid.mamba_pool is not None else None
    want = served(cache, slots, len(TOKENS), state)
    assert cache.insert(TOKENS, slots, mamba_value=state).cached_len == len(TOKENS)
    await cache.flush()
    cache.sanity_check()
    return cache, want


def _state(cache: Any) -> int | None:
    if cache.hybrid.mamba_pool is None:
        return None
    m = cache.match_prefix(TOKENS, cow_mamba=True)
    return int(m.mamba_cow_slot)


@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_backup_evict_load_back_is_bit_exact(make_cache, combo):
    cache, want = await _cached(make_cache, combo)
    assert cache.evict(len(TOKENS)) == len(TOKENS)  # backed up: demoted to host
    zero_device(cache)
    m = cache.match_prefix(TOKENS)
    assert (m.device_prefix_len, m.host_hit_length) == (0, len(TOKENS))
    lb = await cache.load_back(m)
    assert lb is not None and lb.error is None
    assert_same(served(cache, lb.device_indices, len(TOKENS), _state(cache)), want)
    await asyncio.wait_for(lb.sidecar_layer("indexer", 0), 20)
    cache.release_load(lb)
    stats = {s.name: (s.engine.stats["d2h"].ops, s.engine.stats["h2d"].ops
                      + s.engine.stats["h2d_layerwise"].ops) for s in cache.sidecars}
    assert all(d >= 1 and h >= 1 for d, h in stats.values()), stats


async def test_copy_on_write_copies_the_state_sidecar(make_cache):
    cache, want = await _cached(make_cache, "full+mamba")
    src = _state(cache)
    dst = cache.mamba_copy_on_write(src)
    assert dst is not None and dst != src
    side = cache.sidecar("state_side").device
    assert torch.equal(side.read_slots([dst]), want["state_side"])
    cache.free_mamba_state(dst)


@pytest.mark.parametrize("combo", ["full+swa", "full+swa+mamba"])
async def test_retraction_carries_every_sidecar(make_cache, combo):
    cache = await _make(make_cache, combo, retraction_backup=True, write_policy="write_back")
    randomize(cache, 11)
    toks = list(range(300, 318))
    req = cache.admit(toks)
    new = await cache.extend(req, 16)
    if cache.hybrid.mamba_pool is not None:
        req.mamba_state = cache.alloc_mamba_state()
    window = cache.config.sliding_window
    before = served(cache, np.asarray(req.slots), window, req.mamba_state)
    assert len(new) == 16
    await asyncio.wait_for(cache.retract(req), 20)
    zero_device(cache)
    await asyncio.wait_for(cache.restore(req), 20)
    after = served(cache, np.asarray(req.slots), window, req.mamba_state)
    for name in ("swa", "swa_side", "mamba", "state_side", "indexer"):
        if name in before:  # (FULL KV below the window is parked too: compared whole)
            assert torch.equal(after[name].view(torch.uint8), before[name].view(torch.uint8)), name
    assert torch.equal(after["full"].view(torch.uint8), before["full"].view(torch.uint8))
    cache.sanity_check()
    cache.abort_req(req)


# ---------------------------------------------------------------- storage
L3 = {"page_size": 4, "device_tokens": 256, "host_tokens": 512, "write_policy": "write_through",
      "load_back_threshold": 1}
L3_COMBOS = {
    "full+swa": {"sliding_window": 8, "swa_tokens": 128},
    "full+mamba": {"mamba_states": 4, "mamba_state_shape": (4, 3)},
    "full+swa+mamba": {"sliding_window": 8, "swa_tokens": 128, "mamba_states": 4,
                       "mamba_state_shape": (4, 3)},
}
SEQ = list(range(1000, 1064))  # 16 pages of 4
POLICY = StoragePolicy(prefetch_threshold=16, prefetch_policy="wait_complete")


async def _l3_write(make_cache: Any, open_backend: Any, cfg: dict[str, Any]) -> tuple[Any, list[str]]:
    a = await make_cache(sidecars=specs(cfg), **cfg)
    a.attach_storage(await open_backend(a), POLICY)
    randomize(a, 3)
    slots = a.try_alloc_device(len(SEQ))
    state = a.alloc_mamba_state() if a.hybrid.mamba_pool is not None else None
    want = served(a, slots, 8, state)
    a.insert(SEQ, slots, mamba_value=state)
    await a.flush()
    await a.storage.drain()
    keys = a.tree.node_page_keys(a.match_prefix(SEQ).best_node)
    await a.detach_storage()
    await a.aclose()
    return want, keys


async def _l3_read(make_cache: Any, open_backend: Any, cfg: dict[str, Any],
                   delete: list[str] = ()) -> tuple[Any, int, Any]:
    b = await make_cache(sidecars=specs(cfg), **cfg)
    b.attach_storage(await open_backend(b), POLICY)
    if delete:
        assert await b.storage.backend.delete(list(delete)) == len(delete)
    req = b.admit([*SEQ, 1])
    fetched = await b.prefetch_request(req)
    return b, fetched, req


@pytest.mark.parametrize("host_mode", ["cache", "buffer_only"])
@pytest.mark.parametrize("combo", sorted(L3_COMBOS))
async def test_storage_round_trip(make_cache, make_file_backend, combo, host_mode):
    if host_mode == "buffer_only" and "mamba" in combo:
        pytest.skip("buffer_only mode has no Mamba states")
    cfg = {**L3, **L3_COMBOS[combo], "host_mode": host_mode}
    want, _ = await _l3_write(make_cache, make_file_backend, cfg)
    b, fetched, req = await _l3_read(make_cache, make_file_backend, cfg)
    assert fetched == len(SEQ)
    assert await b.load_back_request(req) == len(SEQ)
    got = served(b, np.asarray(req.slots), 8, _l3_state(b))
    assert_same(got, want)
    b.abort_req(req)


def _l3_state(cache: Any) -> int | None:
    if cache.hybrid.mamba_pool is None:
        return None
    m = cache.match_prefix(SEQ, cow_mamba=True)
    return int(m.mamba_cow_slot)


@pytest.mark.seaweedfs
async def test_storage_round_trip_s3(make_cache, make_s3_backend, seaweed):
    prefix = f"sidecars-hy-{np.random.default_rng().integers(1 << 40)}"

    async def open_backend(cache):
        return make_s3_backend(seaweed, cache, prefix)

    cfg = {**L3, **L3_COMBOS["full+swa+mamba"]}
    want, _ = await _l3_write(make_cache, open_backend, cfg)
    b, fetched, req = await _l3_read(make_cache, open_backend, cfg)
    assert fetched == len(SEQ)
    assert await b.load_back_request(req) == len(SEQ)
    assert_same(served(b, np.asarray(req.slots), 8, _l3_state(b)), want)
    b.abort_req(req)


@pytest.mark.parametrize("host_mode", ["cache", "buffer_only"])
async def test_missing_swa_sidecar_object_falls_back(make_cache, make_file_backend, host_mode):
    """The last page's SWA sidecar object is gone: the deepest prefix whose window is whole in
    every pool is one page shorter."""
    cfg = {**L3, **L3_COMBOS["full+swa"], "host_mode": host_mode}
    _, keys = await _l3_write(make_cache, make_file_backend, cfg)
    b, fetched, req = await _l3_read(make_cache, make_file_backend, cfg,
                                     delete=[f"{keys[-1]}.swa_side"])
    assert fetched == len(SEQ) - 4
    b.abort_req(req)


async def test_missing_state_sidecar_object_restores_nothing(make_cache, make_file_backend):
    """The only state's sidecar object is gone: no prefix has a whole state, nothing is kept."""
    cfg = {**L3, **L3_COMBOS["full+mamba"]}
    _, keys = await _l3_write(make_cache, make_file_backend, cfg)
    b, fetched, req = await _l3_read(make_cache, make_file_backend, cfg,
                                     delete=[f"{keys[-1]}.state_side"])
    assert fetched == 0
    b.abort_req(req)
