"""Retraction backup on hybrid caches (behavior.md 1.18 with the SWA / Mamba components of 1.7):
``retract`` parks the FULL KV, the SWA KV of the last window and the request's own Mamba state
in the host pools (all or nothing), ``restore`` brings all of it back bit-exact with the right
SWA floor, ``discard`` frees every host part; cancellation at any await point leaks nothing."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import numpy as np
import pytest
import torch

from asynccache.errors import ConfigError, InvalidInputError, PoolExhaustedError
from tests.hybrid_driver import randomize

COMBOS = {
    "full+swa": {"sliding_window": 4, "swa_tokens": 48},
    "full+mamba": {"mamba_states": 4, "mamba_state_shape": (3, 5)},
    "full+swa+mamba": {"sliding_window": 4, "swa_tokens": 48, "mamba_states": 4,
                       "mamba_state_shape": (3, 5)},
}
BASE = {"page_size": 2, "device_tokens": 48, "host_tokens": 64, "retraction_backup": True,
        "load_back_threshold": 0}
TOKENS = list(range(300, 340))
GARBAGE = 7.0


async def running(make_cache: Any, combo: str, *, cached: int = 12, computed: int = 21,
                  seed: int = 3, **kw: Any) -> tuple[Any, Any]:
    """A cache with random pool contents and a request mid-flight: its first ``cached`` tokens
    in the tree (with a Mamba checkpoint), ``computed`` tokens computed, a fresh state value."""
    cache = await make_cache(**{**BASE, **COMBOS[combo], **kw})
    g = randomize(cache, seed)
    hy = cache.hybrid
    req = cache.admit(TOKENS)
    await cache.extend(req, cached)
    cache.cache_unfinished_req(req)
    await cache.extend(req, computed - cached)
    if req.mamba_state is not None:
        hy.mamba_pool.states[req.mamba_state] = torch.randn(
            hy.mamba_pool.states.shape[1:], generator=g).to(hy.mamba_pool.states.dtype)
    cache.sanity_check()
    return cache, req


def rows(tensor: torch.Tensor, slots: Any, dim: int = 2) -> torch.Tensor:
    """A copy of the entries of ``slots`` along the slot dimension of a pool tensor."""
    return tensor.index_select(dim, torch.from_numpy(np.array(slots, dtype=np.int64))).clone()


def snapshot(cache: Any, req: Any, swa_from: int) -> dict[str, torch.Tensor]:
    """The request's KV as the pools hold it: FULL of every computed token, SWA of the tokens
    from ``swa_from``, its Mamba state."""
    hy = cache.hybrid
    out = {"full": rows(cache.device_pool.kv, req.slots)}
    if hy.swa_map is not None:
        out["swa"] = rows(hy.swa_pool.kv, hy.swa_map.translate(req.slots[swa_from:]))
    if hy.mamba_pool is not None:
        out["mamba"] = hy.mamba_pool.states[req.mamba_state].clone()
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, name
        assert torch.equal(got[name].view(torch.uint8), w.view(torch.uint8)), name


def clobber_free(cache: Any) -> None:
    """Overwrite every free device slot, SWA slot and state (reused memory must not leak in)."""
    hy = cache.hybrid
    pools = [(cache.device_pool.allocator, cache.device_pool.kv, 2)]
    if hy.swa_pool is not None:
        pools.append((hy.swa_pool.allocator, hy.swa_pool.kv, 2))
    if hy.mamba_pool is not None:
        pools.append((hy.mamba_pool.allocator, hy.mamba_pool.states, 0))
    for alloc, tensor, dim in pools:
        n = alloc.available_size
        if not n:
            continue
        slots = alloc.alloc(n)
        tensor.index_fill_(dim, torch.from_numpy(slots), GARBAGE)
        alloc.free(slots)


def used(cache: Any) -> tuple[int, int, int]:
    hy = cache.hybrid
    return (cache.device_pool.allocator.used_size,
            hy.swa_pool.allocator.used_size if hy.swa_pool is not None else 0,
            hy.mamba_pool.used_size if hy.mamba_pool is not None else 0)


def host_parts(cache: Any) -> tuple[int, int, int]:
    """Host slots owned by operations (retracted requests here): FULL, SWA, Mamba."""
    tier = cache.hybrid.tier
    return cache.host_in_flight, tier.inflight["swa"], tier.inflight["mamba"]


def expected_swa_from(cache: Any, computed: int) -> int:
    w = cache.config.sliding_window
    return max(0, computed - w) // cache.page_size * cache.page_size if w else 0


@pytest.mark.parametrize("cached", [12, 20], ids=["window-own", "window-in-tree"])
@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_round_trip_is_bit_exact_and_the_request_finishes(make_cache, combo, cached):
    cache, req = await running(make_cache, combo, cached=cached)
    hy = cache.hybrid
    swa, mamba = hy.swa_map is not None, hy.mamba_pool is not None
    swa_from = expected_swa_from(cache, 21)
    want = snapshot(cache, req, swa_from)
    tree_used = (cache.tree.device_size,
                 len(cache.tree.component_slots("swa")) if swa else 0,
                 len(cache.tree.component_slots("mamba")) if mamba else 0)
    assert used(cache) == (22, 22 if swa else 0, 2 if mamba else 0)  # 21 computed + 1 spare

    backup = await asyncio.wait_for(cache.retract(req), 10)
    assert (backup.num_tokens, len(backup.host_slots), backup.swa_from) == (21, 22, swa_from)
    assert len(backup.swa_host_slots) == (22 - swa_from if swa else 0)
    assert (backup.mamba_host_slot is not None) == mamba
    assert host_parts(cache) == (22, len(backup.swa_host_slots), int(mamba))
    assert req.retracted is backup and req.computed == 0 and req.mamba_state is None
    assert cache.tree.held_locks == 0
    assert used(cache) == tree_used  # the request's own FULL + SWA slots and state are freed
    cache.sanity_check()

    clobber_free(cache)
    await asyncio.wait_for(cache.restore(req), 10)
    assert req.retracted is None and backup.state == "restored"
    assert (req.prefix_len, req.computed, len(req.spare)) == (0, 21, 1)
    assert req.swa_evicted == swa_from
    assert host_parts(cache) == (0, 0, 0)
    # FULL-only slots below the SWA floor, FULL+SWA pairs from it; one fresh state.
    all_slots = np.concatenate([req.slots, req.spare])
    if swa:
        assert (hy.swa_map.full_to_swa[all_slots[:swa_from]] == -1).all()
        assert (hy.swa_map.full_to_swa[all_slots[swa_from:]] >= 0).all()
    assert used(cache) == (tree_used[0] + 22, tree_used[1] + (22 - swa_from if swa else 0),
                           tree_used[2] + int(mamba))
    assert_same(snapshot(cache, req, swa_from), want)
    cache.sanity_check()

    # It carries on: two more tokens (page-aligned: the state goes to the tree at the end).
    new = await cache.extend(req, 3)
    g = torch.Generator().manual_seed(11)
    kv = torch.randn((cache.shape.num_layers, 2, 3, cache.shape.num_heads, cache.shape.head_dim),
                     generator=g).to(cache.shape.dtype)
    cache.write_kv(new, kv)
    want["full"] = torch.cat([want["full"], kv], dim=2)
    if swa:
        swa_new = torch.randn((cache.config.swa_layers, 2, 3, cache.shape.num_heads,
                               cache.shape.head_dim), generator=g).to(cache.shape.dtype)
        hy.swa_pool.kv.index_copy_(2, torch.from_numpy(hy.swa_map.translate(new)), swa_new)
        want["swa"] = torch.cat([want["swa"], swa_new], dim=2)
    if mamba:
        hy.mamba_pool.states[req.mamba_state] += 1
        want["mamba"] = hy.mamba_pool.states[req.mamba_state].clone()
    cache.cache_finished_req(req)
    cache.sanity_check()
    assert cache.tree.held_locks == 0
    m = cache.match_prefix(TOKENS[:24], cow_mamba=mamba)
    assert m.device_prefix_len == 24
    got = {"full": rows(cache.device_pool.kv, m.device_indices)}
    assert torch.equal(got["full"].view(torch.uint8), want["full"].view(torch.uint8))
    if swa:
        # The tree learnt the floor: below it no SWA (the tree's own prefix keeps its own).
        tree_swa = hy.swa_map.full_to_swa[m.device_indices]
        assert (tree_swa[cached:swa_from] == -1).all() and (tree_swa[swa_from:] >= 0).all()
        served = rows(hy.swa_pool.kv, tree_swa[swa_from:])
        assert torch.equal(served.view(torch.uint8), want["swa"].view(torch.uint8))
    if mamba:
        assert torch.equal(hy.mamba_pool.states[m.mamba_cow_slot].view(torch.uint8),
                           want["mamba"].view(torch.uint8))
    assert used(cache) == (24, 24 - (swa_from - cached if swa_from > cached else 0) if swa else 0,
                           2 if mamba else 0)


async def test_released_window_and_tombstone_in_window(make_cache):
    """A request that freed SWA slots out of its window, and one whose window lost a page:
    only the live SWA tokens of the last window are backed up."""
    cache, req = await running(make_cache, "full+swa", cached=4, computed=30, device_tokens=64,
                               swa_tokens=64, host_tokens=64)
    hy = cache.hybrid
    assert cache.release_swa_window(req) == 20  # own [4, 24) slid out
    assert hy.swa_pool.allocator.used_size == 4 + 6  # the tree's [0, 4) and own [24, 30)
    backup = await cache.retract(req)
    assert backup.swa_from == 26 and len(backup.swa_host_slots) == 4
    assert hy.swa_pool.allocator.used_size == 4
    await cache.restore(req)
    assert req.swa_evicted == 26 and req.computed == 30
    cache.sanity_check()
    # Now free one page inside the window: the backup starts after it.
    cache.free_swa(hy.swa_map.translate(req.slots[26:28]))
    backup = await cache.retract(req)
    assert backup.swa_from == 28 and len(backup.swa_host_slots) == 2
    await cache.restore(req)
    assert req.swa_evicted == 28
    cache.sanity_check()
    cache.cache_finished_req(req)
    cache.sanity_check()


@pytest.mark.parametrize("short", ["full", "swa", "mamba", "swa+mamba"])
async def test_host_shortage_names_the_pool_and_changes_nothing(make_cache, short):
    cache, req = await running(make_cache, "full+swa+mamba")
    hy, tier = cache.hybrid, cache.hybrid.tier
    held = []  # host slots another operation owns, leaving too few for the retraction
    if "full" in short:
        held.append(("full", cache.take_host(64 - 20)))
    if "swa" in short:
        held.append(("swa", tier.take_host("swa", 64 - 4, cache.evict_host)))
    if "mamba" in short:
        held.append(("mamba", tier.take_host("mamba", 4, cache.evict_host)))
    before = (req.slots.copy(), req.spare.copy(), req.mamba_state, req.prefix_len, used(cache),
              host_parts(cache), cache.host_pool.allocator.used_size,
              tier.swa_host.allocator.used_size, tier.mamba_host.used_size)
    want = snapshot(cache, req, 16)
    with pytest.raises(PoolExhaustedError) as info:
        await cache.retract(req)
    msg = str(info.value)
    assert ("22 host slots needed, 20 free" in msg) == ("full" in short)
    assert ("6 host SWA slots needed, 4 free" in msg) == ("swa" in short)
    assert ("1 host Mamba state needed, 0 free" in msg) == ("mamba" in short)
    after = (req.slots, req.spare, req.mamba_state, req.prefix_len, used(cache),
             host_parts(cache), cache.host_pool.allocator.used_size,
             tier.swa_host.allocator.used_size, tier.mamba_host.used_size)
    assert [str(x) for x in after] == [str(x) for x in before]
    assert req.retracted is None and cache.tree.held_locks == 1
    assert_same(snapshot(cache, req, 16), want)
    cache.sanity_check()
    for name, slots in held:
        if name == "full":
            cache.free_host(slots)
        else:
            tier.give_host(name, slots, free=True)
    backup = await cache.retract(req)  # room again
    cache.discard_retracted(req)
    assert backup.state == "discarded" and host_parts(cache) == (0, 0, 0)
    cache.abort_req(req)
    assert hy.mamba_pool.used_size == 1  # the tree's checkpoint only


@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_discard_and_abort_free_every_host_part(make_cache, combo):
    cache, req = await running(make_cache, combo)
    tier = cache.hybrid.tier
    backup = await cache.retract(req)
    assert host_parts(cache) != (0, 0, 0)
    cache.discard_retracted(req)
    assert backup.state == "discarded" and host_parts(cache) == (0, 0, 0)
    with pytest.raises(InvalidInputError, match="no retracted KV"):
        await cache.restore(req)
    cache.abort_req(req)
    cache2_req = cache.admit(TOKENS[:16])
    await cache.extend(cache2_req, 16 - cache2_req.prefix_len)
    await cache.retract(cache2_req)
    cache.abort_req(cache2_req)  # aborting a retracted request drops its host parts too
    await cache.flush()
    assert host_parts(cache) == (0, 0, 0)
    assert cache.host_pool.allocator.used_size == cache.host_size
    if tier.swa_host is not None:
        assert tier.swa_host.allocator.used_size == len(cache.tree.component_host_slots("swa"))
    if tier.mamba_host is not None:
        assert tier.mamba_host.used_size == len(cache.tree.component_host_slots("mamba"))
    cache.sanity_check()


@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_capacity_is_validated_per_pool_at_start(make_cache, combo):
    kw = {**BASE, **COMBOS[combo]}
    cache = await make_cache(**kw)  # defaults: every host pool >= its device pool
    assert cache.hybrid.tier is not None
    if "sliding_window" in kw:
        with pytest.raises(ConfigError, match=r"16 host SWA slots .* < 48 device SWA slots"):
            await make_cache(**kw, swa_host_tokens=16)
    if "mamba_states" in kw:
        with pytest.raises(ConfigError, match=r"3 host states .* < 4 device states"):
            await make_cache(**kw, mamba_host_states=3)
    with pytest.raises(ConfigError, match="16 host slots < 48 device slots"):
        await make_cache(**{**kw, "host_tokens": 16})


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 6, 10, 500])
@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_cancelled_retract_leaves_the_request_intact(make_cache, kit, combo, k):
    cache, req = await running(make_cache, combo)
    want = snapshot(cache, req, 16)
    before = used(cache)
    outcome, _ = await kit.run_cancelled(lambda: cache.retract(req), k)
    await cache.flush()
    cache.sanity_check()
    if outcome == "cancelled":
        assert req.retracted is None and req.computed == 21 and used(cache) == before
        assert host_parts(cache) == (0, 0, 0)
        assert_same(snapshot(cache, req, 16), want)
    else:
        assert req.retracted is not None
        clobber_free(cache)
        await cache.restore(req)
        assert_same(snapshot(cache, req, 16), want)
    cache.abort_req(req)
    cache.sanity_check()


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 6, 10, 500])
@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_cancelled_restore_keeps_the_backup(make_cache, kit, combo, k):
    cache, req = await running(make_cache, combo)
    want = snapshot(cache, req, 16)
    backup = await cache.retract(req)
    after_retract, parts = used(cache), host_parts(cache)
    clobber_free(cache)
    outcome, _ = await kit.run_cancelled(lambda: cache.restore(req), k)
    await cache.flush()
    cache.sanity_check()
    if outcome == "cancelled":
        assert req.retracted is backup and backup.state == "held"
        assert used(cache) == after_retract and host_parts(cache) == parts
        clobber_free(cache)
        await cache.restore(req)
    assert_same(snapshot(cache, req, 16), want)
    cache.abort_req(req)
    cache.sanity_check()


async def test_restore_without_a_free_state_is_a_clear_error(make_cache):
    cache, req = await running(make_cache, "full+swa+mamba", mamba_states=2)
    hy = cache.hybrid
    await cache.retract(req)
    other = cache.admit([9, 9, 9, 9])  # takes the freed state
    pinned = cache.lock(cache.match_prefix(TOKENS[:12]).last_device_node)  # the tree's one
    before = used(cache)
    with pytest.raises(PoolExhaustedError, match="no Mamba state slot is free"):
        await cache.restore(req)
    assert req.retracted is not None and req.retracted.state == "held"
    assert used(cache) == before
    cache.sanity_check()
    cache.unlock(pinned)
    cache.abort_req(other)
    await cache.restore(req)
    assert req.mamba_state is not None and hy.mamba_pool.used_size == 2
    cache.abort_req(req)
    cache.sanity_check()


@pytest.mark.parametrize("seed", range(12))
async def test_random_lifecycle_with_retractions(make_cache, seed):
    """Requests admitted, computed, cached, windows released, retracted, restored, discarded,
    finished and aborted at random, with eviction pressure: every restore is bit-exact and the
    per-pool accounting holds after every step."""
    rnd = random.Random(seed)
    cache = await make_cache(**{**BASE, **COMBOS["full+swa+mamba"], "mamba_states": 6,
                                "device_tokens": 40, "swa_tokens": 40, "host_tokens": 40})
    hy = cache.hybrid
    g = torch.Generator().manual_seed(seed)
    for t in (cache.device_pool.kv, hy.swa_pool.kv, hy.mamba_pool.states):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    prefixes = [list(range(1000 * i, 1000 * i + 8)) for i in range(1, 4)]
    live: list[tuple[Any, list[int]]] = []
    parked: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
    stats = dict.fromkeys(("retract", "restore", "short"), 0)
    for step in range(150):
        op = rnd.choice(["admit", "admit", "extend", "extend", "extend", "unfinished", "window", "retract",
                         "retract", "restore", "restore", "discard", "finish", "evict"])
        running_ = [(r, t) for r, t in live if r.retracted is None]
        retracted = [(r, t) for r, t in live if r.retracted is not None]
        if op == "admit" and len(live) < 5:
            tokens = rnd.choice(prefixes) + [rnd.randrange(10**6) for _ in range(22)]
            with contextlib.suppress(PoolExhaustedError):
                live.append((cache.admit(tokens, f"r{step}"), tokens))
        elif op == "extend" and running_:
            r, t = rnd.choice(running_)
            n = min(rnd.randint(2, 12), len(t) - r.computed)
            with contextlib.suppress(PoolExhaustedError):
                await cache.extend(r, n)
        elif op == "unfinished" and running_:
            cache.cache_unfinished_req(rnd.choice(running_)[0])
        elif op == "window" and running_:
            cache.release_swa_window(rnd.choice(running_)[0])
        elif op == "retract" and running_:
            r, _ = rnd.choice(running_)
            swa_from = _swa_from(cache, r)
            want = snapshot(cache, r, swa_from)
            try:
                await cache.retract(r)
                parked[r.rid] = (swa_from, want)
                stats["retract"] += 1
            except PoolExhaustedError:
                stats["short"] += 1
                assert_same(snapshot(cache, r, swa_from), want)
        elif op == "restore" and retracted:
            r, _ = rnd.choice(retracted)
            clobber_free(cache)
            try:
                await cache.restore(r)
            except PoolExhaustedError:
                stats["short"] += 1
            else:
                swa_from, want = parked.pop(r.rid)
                assert r.swa_evicted == swa_from
                assert_same(snapshot(cache, r, swa_from), want)
                stats["restore"] += 1
        elif op == "discard" and retracted:
            r, _ = rnd.choice(retracted)
            cache.discard_retracted(r)
            parked.pop(r.rid)
            cache.abort_req(r)
            live.remove((r, _))
        elif op == "finish" and live:
            r, t = rnd.choice(live)
            parked.pop(r.rid, None)
            cache.cache_finished_req(r)  # a retracted one is dropped (its backup freed)
            live.remove((r, t))
        elif op == "evict":
            cache.evict(rnd.randint(0, 16), swa_num_tokens=rnd.randint(0, 8),
                        mamba_num=rnd.randint(0, 1))
        cache.sanity_check()
    for r, _ in live:
        cache.abort_req(r)
    await cache.flush()
    cache.sanity_check()
    assert host_parts(cache) == (0, 0, 0) and hy.mamba_pool.used_size == len(
        cache.tree.component_slots("mamba"))
    assert stats["retract"] and stats["restore"], stats


def failing_copy(*_args: Any) -> Any:
    """A state copy that fails once it runs (the copy thread reported an error)."""
    from asynccache.transfers.handles import CopyHandle

    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(RuntimeError("state copy failed"))
    return CopyHandle("d2h", fut, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), 0)


def refused_copy(*_args: Any) -> Any:
    raise RuntimeError("state copier refused the copy")


@pytest.mark.parametrize("how", [failing_copy, refused_copy], ids=["fails", "refused"])
async def test_a_failed_part_frees_everything_and_changes_nothing(make_cache, monkeypatch, how):
    from asynccache.errors import TransferError

    cache, req = await running(make_cache, "full+swa+mamba")
    states = cache.hybrid.tier.states
    want = snapshot(cache, req, 16)
    before = used(cache)
    monkeypatch.setattr(states, "submit_d2h", how)
    with pytest.raises(TransferError if how is failing_copy else RuntimeError):
        await cache.retract(req)
    await cache.flush()  # the FULL and SWA parts landed: their host slots are back
    assert req.retracted is None and used(cache) == before and host_parts(cache) == (0, 0, 0)
    assert_same(snapshot(cache, req, 16), want)
    cache.sanity_check()
    monkeypatch.undo()
    backup = await cache.retract(req)
    after_retract = used(cache)
    monkeypatch.setattr(states, "submit_h2d", how)
    clobber_free(cache)
    with pytest.raises(TransferError if how is failing_copy else RuntimeError):
        await cache.restore(req)
    await cache.flush()
    assert req.retracted is backup and backup.state == "held" and used(cache) == after_retract
    cache.sanity_check()
    monkeypatch.undo()
    clobber_free(cache)
    await cache.restore(req)
    assert_same(snapshot(cache, req, 16), want)
    cache.abort_req(req)


def _swa_from(cache, req) -> int:
    """Where a retraction's SWA window starts (this test's model of the rule): the request's
    last window from a page boundary, moved past its last token whose SWA slot is not live."""
    ps, window = cache.page_size, cache.config.sliding_window
    slots = np.concatenate([req.slots, req.spare])
    lo = max(0, req.computed - window) // ps * ps
    dead = np.flatnonzero(cache.hybrid.swa_map.full_to_swa[slots[lo:]] < 0)
    if len(dead):
        lo += -(-(int(dead[-1]) + 1) // ps) * ps
    return lo
