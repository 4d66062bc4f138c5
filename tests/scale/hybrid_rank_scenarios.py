"""Code that runs inside the spawned rank processes of tests/scale/test_hybrid_ranks.py and
tests/scale/test_hybrid_l3_ranks.py (loaded by file path): a hybrid cache (FULL + SWA + Mamba)
with a host tier on every rank (the storage scenarios are at the end of the file).

Every rank drives the same seeded random workload (inserts, evictions, host evictions,
awaited and unawaited load-backs, write-back demotions, retraction and restore of requests) through its own cache; the ranks'
copies complete at different times (per-rank completion delays on the SWA, Mamba and FULL
copies, per-rank sleeps between calls), so only the agreement keeps their trees equal.
Every token's KV (FULL and SWA) and every Mamba state is a function of its prefix, so what
each rank serves is checked bit for bit, and ``sanity_check()`` (pool accounting of every
pool) runs after every step.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import sys
import zlib
from pathlib import Path
from typing import Any

import torch

# Loaded by file path in the rank processes: the repository root makes ``tests`` importable.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from tests.hybrid_driver import Driver, kv, tag  # noqa: E402

PS = 2
HYBRID = dict(sliding_window=4, swa_tokens=40, mamba_states=6, mamba_state_shape=(2, 3))


class RankDriver(Driver):
    """The shared driver as every rank runs it: a load-back that fails (here or on a peer)
    is logged, and requests are also retracted and restored."""

    def __init__(self, cache: Any, rng: random.Random) -> None:
        super().__init__(cache, rng, transfer_errors=True)

    async def retract_round(self) -> None:
        """A request is computed, retracted (FULL, SWA window and Mamba state to host),
        restored under pressure, checked bit for bit and cached."""
        from asynccache.errors import PoolExhaustedError, TransferError

        c, hy = self.cache, self.hy
        toks = self.key() + tuple(self.rng.randrange(3) for _ in range(2 * PS))
        try:
            req = c.admit(list(toks))
        except PoolExhaustedError:
            self.log.append(("retract", "no state"))
            return
        try:
            await c.load_back_request(req)
            new = await c.extend(req, len(toks) - req.computed)
        except PoolExhaustedError:
            c.abort_req(req)
            self.log.append(("retract", "no room"))
            return
        start = len(toks) - len(new)
        idx = torch.from_numpy(new.copy())
        c.device_pool.kv.index_copy_(2, idx, kv(c.device_pool, toks, start, len(toks)))
        swa = torch.from_numpy(hy.swa_map.translate(new).copy())
        hy.swa_pool.kv.index_copy_(2, swa, kv(hy.swa_pool, toks, start, len(toks)))
        hy.mamba_pool.states[req.mamba_state].fill_(tag(toks))
        try:
            backup = await c.retract(req)
        except (PoolExhaustedError, TransferError) as exc:  # the request is unchanged
            c.abort_req(req)
            self.log.append(("retract", type(exc).__name__))
            return
        c.evict(self.rng.randrange(0, 16), swa_num_tokens=self.rng.randrange(0, 6))
        try:
            await c.restore(req)
        except (PoolExhaustedError, TransferError) as exc:  # the backup is still held
            c.abort_req(req)
            self.log.append(("restore", type(exc).__name__))
            return
        got = c.device_pool.kv.index_select(2, torch.from_numpy(req.slots.copy()))
        assert torch.equal(got, kv(c.device_pool, toks, 0, len(toks))), toks
        lo = backup.swa_from
        swa = torch.from_numpy(hy.swa_map.translate(req.slots[lo:]).copy())
        assert torch.equal(hy.swa_pool.kv.index_select(2, swa),
                           kv(hy.swa_pool, toks, lo, len(toks))), toks
        assert bool((hy.mamba_pool.states[req.mamba_state] == tag(toks)).all())
        c.cache_finished_req(req)
        self.history.append(toks)
        self.log.append(("retract", len(toks), backup.num_tokens, lo))


def kv_digest(cache: Any) -> str:
    """SHA-256 over the bytes every tree node's slots hold, in every pool: FULL and SWA KV and
    Mamba states, on device and on host (slots nobody holds are not compared)."""
    hy, tier = cache.hybrid, cache.hybrid.tier
    tree = cache.tree
    h = hashlib.sha256()
    for n in sorted(tree.iter_nodes(), key=lambda n: n.id):
        parts = [(cache.device_pool, n.value), (cache.host_pool, n.host_value),
                 (hy.swa_pool, tree.component_slots_of(n.id, "swa")),
                 (tier.swa_host, tree.component_host_slots_of(n.id, "swa"))]
        for pool, v in ((hy.mamba_pool, tree.component_slots_of(n.id, "mamba")),
                        (tier.mamba_host, tree.component_host_slots_of(n.id, "mamba"))):
            if v is not None:
                h.update(pool.states.index_select(0, torch.from_numpy(v.copy()))
                         .contiguous().view(torch.uint8).numpy().tobytes())
        for pool, v in parts:
            if v is not None and len(v):
                h.update(pool.read_slots(v).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _counter(cache: Any, name: str, **labels: str) -> float:
    return float(cache.metrics.registry.get_sample_value(name, labels or None) or 0.0)


async def _workload(group: Any, policy: str, steps: int, fail_at: tuple[int, ...],
                    die_at: int | None) -> dict[str, Any]:
    from asynccache import CacheConfig, HierarchicalCache
    from asynccache.errors import RankGroupError
    from asynccache.testing.copyfaults import copy_faults
    from asynccache.testing.ranks import tree_digest

    rank = group.rank
    cfg = CacheConfig(page_size=PS, num_layers=2, num_heads=2, head_dim=4, dtype="float32",
                      device_tokens=40, host_tokens=48, write_policy=policy,
                      load_back_threshold=0, enable_kv_events=True, retraction_backup=True,
                      **HYBRID)
    cache = HierarchicalCache(cfg, ranks=group)
    await cache.start()
    tier = cache.hybrid.tier
    # Rank-local copy timing: every copier completes late, by a different amount per rank.
    slow = 0.002 * (1 + rank % 2)
    faults = [copy_faults(tier.states, delay_s=slow,
                          fail=set(fail_at) if rank == 1 else ()),
              copy_faults(tier.swa_engine, delay_s=slow * 0.7 if rank else 0.0),
              copy_faults(cache.copy_engine, delay_s=0.0 if rank else 0.001,
                          fail={5} if fail_at and rank == 0 else ())]
    d = RankDriver(cache, random.Random(f"hybrid-ranks/{policy}"))
    out: dict[str, Any] = {"rank": rank}
    try:
        for step in range(steps):
            if die_at is not None and step == die_at:
                await group.barrier()
                if rank == 1:
                    # Die with hybrid copies in flight (submitted, not yet retired anywhere).
                    d.insert()
                    await d.load(wait=False)
                    os._exit(3)
                try:
                    d.insert()
                    await d.load(wait=False)
                    await asyncio.wait_for(cache.flush(), 30)
                    await asyncio.wait_for(cache.sync(), 30)  # a tick even if nothing flew
                except RankGroupError as exc:
                    out["failure"] = str(exc)
                break
            op = d.rng.random()
            if op < 0.4:
                d.insert()
            elif op < 0.55:
                cache.evict(d.rng.randrange(0, 24), swa_num_tokens=d.rng.randrange(0, 6),
                            mamba_num=d.rng.randrange(0, 2))
            elif op < 0.62:
                cache.evict_host(d.rng.randrange(1, 12))
            elif op < 0.8:
                await d.load(wait=True)
            elif op < 0.85:
                await d.load(wait=False)
            elif op < 0.9:
                await d.retract_round()
            else:
                await d.settle()
                d.check_served()
            cache.sanity_check()
            if rank % 2 and step % 5 == 0:
                await asyncio.sleep(0.001 * (1 + step % 3))  # rank-local timing only
            if step % 9 == 8:
                await cache.sync()
        else:
            await d.settle()
            d.check_served()
            cache.sanity_check()
            out["digest"] = tree_digest(cache)
            out["kv"] = kv_digest(cache)
            out["events"] = [repr(e) for e in cache.take_events()]
            out["log"] = d.log
            out["ticks"] = cache.agreement.ticks
            out["held_back"] = cache.agreement.held_back
            out["failed_items"] = cache.agreement.failed_items
            out["skipped"] = {op: _counter(cache, "asynccache_hybrid_skipped_total", op=op)
                              for op in ("backup", "load_back")}
            out["load_backs"] = _counter(cache, "asynccache_load_back_tokens_total")
            out["backups"] = _counter(cache, "asynccache_backup_tokens_total")
            out["dropped"] = _counter(cache, "asynccache_dropped_tokens_total",
                                      reason="backup_failed")
            out["host_parts"] = (len(cache.tree.component_host_slots("swa")),
                                 len(cache.tree.component_host_slots("mamba")))
            out["injected_failures"] = faults[0].failed + faults[2].failed
            out["in_flight"] = (cache.in_flight, cache.host_in_flight, dict(tier.inflight),
                                cache.tree.held_locks)
    finally:
        for f in faults:
            f.remove()
        await cache.aclose()
    hy = cache.hybrid
    out["closed_clean"] = (cache.device_pool.allocator.used_size,
                           cache.host_pool.allocator.used_size, hy.swa_map.swa.used_size,
                           hy.mamba_pool.used_size, tier.swa_host.allocator.used_size,
                           tier.mamba_host.used_size) == (0, 0, 0, 0, 0, 0)
    return out


def hybrid_workload(rank: int, world_size: int, init_method: str, tp_size: int, policy: str,
                    steps: int, fail_at: tuple[int, ...] = (),
                    die_at: int | None = None) -> dict[str, Any]:
    from asynccache.ranks import TorchRankGroup

    torch.set_num_threads(1)
    group = TorchRankGroup.create(rank, world_size, init_method, tp_size=tp_size,
                                  timeout_s=20.0 if die_at is None else 12.0)
    try:
        return asyncio.run(_workload(group, policy, steps, fail_at, die_at))
    finally:
        group.close()


# ---------------------------------------------------------------------- storage (L3) on 2 ranks
# Used by tests/scale/test_hybrid_l3_ranks.py: a 2-rank hybrid cache writes conversations to a
# shared store (each TP rank its own objects: its bytes differ from the other rank's), then a
# fresh pair of caches prefetches them while the ranks' storage differs (timing, a deleted or
# unreadable component object on one rank only).

L3_PS = 2
L3_N = 600  # 300 pages: three KV read batches (128 + 128 + 44)
L3_HYBRID = dict(sliding_window=4, swa_tokens=2048, mamba_states=16, mamba_state_shape=(2, 3))


def l3_values(toks: list[int], rank: int) -> list[float]:
    """One value per token, a function of the prefix it ends and of the rank (exact in fp32)."""
    out, c = [], 0
    for t in toks:
        c = zlib.crc32(t.to_bytes(4, "little"), c)
        out.append(float(c % 100_003 + 200_000 * (rank + 1)))
    return out


def _l3_kv(pool: Any, vals: list[float]) -> torch.Tensor:
    L, _, _, H, D = pool.kv.shape
    return torch.tensor(vals, dtype=pool.kv.dtype).view(1, 1, -1, 1, 1).expand(
        L, 2, len(vals), H, D)


def _l3_config(**over: Any) -> Any:
    from asynccache import CacheConfig

    base: dict[str, Any] = dict(page_size=L3_PS, num_layers=2, num_heads=2, head_dim=4,
                                dtype="float32", device_tokens=2048, host_tokens=2048,
                                write_policy="write_through", load_back_threshold=0,
                                enable_page_hashes=True, **L3_HYBRID)
    base.update(over)
    return CacheConfig(**base)


async def _l3_write(group: Any, url: str, kwargs: dict[str, Any],
                    convs: list[tuple[list[int], tuple[int, ...]]]) -> None:
    """Every rank stores its own KV, SWA pages and a state at the end of each turn."""
    from asynccache import HierarchicalCache
    from asynccache.storage.factory import open_backend

    rank = group.rank
    cache = HierarchicalCache(_l3_config(), ranks=group)
    await cache.start()
    backend = await open_backend(url, cache.storage_layout(), **kwargs)
    try:
        from asynccache.l3 import StoragePolicy

        cache.attach_storage(backend, StoragePolicy(prefetch_threshold=16))
        hy = cache.hybrid
        for toks, turns in convs:
            vals = l3_values(toks, rank)
            slots = cache.try_alloc_device(len(toks))
            assert slots is not None
            idx = torch.from_numpy(slots.copy())
            cache.device_pool.kv.index_copy_(2, idx, _l3_kv(cache.device_pool, vals))
            swa = torch.from_numpy(hy.swa_map.translate(slots).copy())
            hy.swa_pool.kv.index_copy_(2, swa, _l3_kv(hy.swa_pool, vals))
            prev = 0
            for end in turns:
                state = cache.alloc_mamba_state()
                assert state is not None
                hy.mamba_pool.states[state].fill_(vals[end - 1])
                cache.insert(toks[:end], slots[:end], prev_prefix_len=prev, mamba_value=state)
                prev = end
                await cache.flush()
        await cache.flush()
        await cache.storage.drain()
        cache.sanity_check()
        await cache.detach_storage()
    finally:
        await cache.aclose()
        await backend.aclose()


def _l3_served(cache: Any, toks: list[int], n: int, rank: int) -> None:
    """The first ``n`` tokens are served on the device bit for bit as this rank wrote them:
    the FULL KV, the SWA window and the state."""
    hy = cache.hybrid
    vals = l3_values(toks[:n], rank)
    m = cache.match_prefix(toks[:n], cow_mamba=True)
    assert m.device_prefix_len == n, (m.device_prefix_len, n)
    idx = torch.from_numpy(m.device_indices.copy())
    got = cache.device_pool.kv.index_select(2, idx)
    assert torch.equal(got, _l3_kv(cache.device_pool, vals)), "FULL KV differs"
    w = L3_HYBRID["sliding_window"]
    swa = torch.from_numpy(hy.swa_map.translate(m.device_indices[n - w :]).copy())
    assert torch.equal(hy.swa_pool.kv.index_select(2, swa), _l3_kv(hy.swa_pool, vals[n - w :])), \
        "SWA window differs"
    assert bool((hy.mamba_pool.states[m.mamba_cow_slot] == vals[n - 1]).all()), "state differs"


async def _l3_read(group: Any, url: str, kwargs: dict[str, Any],
                   convs: list[tuple[list[int], tuple[int, ...]]], die: bool,
                   mamba_host: int) -> dict[str, Any]:
    from asynccache import HierarchicalCache
    from asynccache.errors import RankGroupError
    from asynccache.l3 import StoragePolicy
    from asynccache.storage.factory import open_backend
    from asynccache.storage.faults import FaultInjectingBackend, FaultKind, FaultRule
    from asynccache.testing.ranks import tree_digest

    rank = group.rank
    out: dict[str, Any] = {"rank": rank}
    cache = HierarchicalCache(_l3_config(device_tokens=1024, host_tokens=1536,
                                         mamba_host_states=mamba_host), ranks=group)
    await cache.start()
    inner = await open_backend(url, cache.storage_layout(), **kwargs)
    keys = [cache.tree.chain_keys(cache.tree.root_id, toks, 0) for toks, _ in convs]
    rules = [FaultRule(FaultKind.DELAY, rate=0.05 * (1 + rank), ops=frozenset({"read"}),
                       delay_s=0.002 * (1 + rank))]
    def last(conv: int, turn: int) -> str:  # the key of the last page of a turn
        return keys[conv][convs[conv][1][turn] // L3_PS - 1]

    # What the 2-rank backups wrote under this rank's names: every page's KV and SWA page,
    # and the state of every turn (each turn's node was backed up with its state).
    out["stored"] = [
        (await inner.exists_prefix(k), await inner.exists_prefix([f"{x}.swa" for x in k]),
         [await inner.exists_prefix([f"{last(c, t)}.mamba"]) for t in range(len(turns))])
        for c, (k, (_toks, turns)) in enumerate(zip(keys, convs, strict=True))]

    # Conversation 0 (turns 200 / 400 / 600): the state at 600 is gone on rank 1, the one at
    # 400 on rank 0 (the queries find 400 and 600: the MIN, 400, is not restorable on rank 0,
    # so the ranks ask again and agree on 200).
    # Conversation 1 (100 / 300 / 600): on rank 0 the state at 600 is listed but cannot be
    # read (its component read fails); on rank 1 the last SWA page of 300 is gone: 300 is
    # restorable on rank 0 only, 600 on rank 1 only (once the read failed): both end at 100.
    if rank == 1:
        assert await inner.delete([f"{last(0, 2)}.mamba", f"{last(1, 1)}.swa"]) == 2
    else:
        assert await inner.delete([f"{last(0, 1)}.mamba"]) == 1
        rules.append(FaultRule(FaultKind.EIO, ops=frozenset({"read"}),
                               keys=frozenset({f"{last(1, 2)}.mamba"})))
    backend = FaultInjectingBackend(inner, rules, seed=rank)
    try:
        cache.attach_storage(backend, StoragePolicy(prefetch_threshold=16))
        if die:
            req = cache.admit([*convs[0][0], 7])
            op = cache.start_prefetch(req.key, cache.match_prefix(req.key))
            assert op is not None
            while op.phase == "query":  # agreed: both ranks leave the loop at the same tick
                await cache.sync()
            if rank == 1:
                os._exit(3)  # dies with the KV read in flight
            try:
                await asyncio.wait_for(cache.storage.finish_prefetch(op, "wait_complete"), 30)
            except RankGroupError as exc:
                out["failure"] = str(exc)
            cache.abort_req(req)
            out["in_flight"] = (cache.host_in_flight, dict(cache.hybrid.tier.inflight))
            return out
        got = []
        for toks, _turns in convs[:2]:  # prefetched to the end (wait_complete)
            req = cache.admit([*toks, 7])
            n = await cache.prefetch_request(req, policy="wait_complete")
            await cache.load_back_request(req)
            assert req.prefix_len == n, (req.prefix_len, n)
            if n:
                _l3_served(cache, toks, n, rank)
            cache.abort_req(req)
            cache.sanity_check()
            got.append(n)
        # conversation 2: stopped (best_effort) while its pages are arriving at different
        # speeds on the two ranks; what is inserted must still be agreed and restorable
        toks = convs[2][0]
        req = cache.admit([*toks, 7])
        op = cache.start_prefetch(req.key, cache.match_prefix(req.key))
        assert op is not None
        while op.phase == "query":
            await cache.sync()
        for _ in range(3):
            await asyncio.sleep(0.01)  # rank-local timing only
            await cache.sync()
        n = await cache.storage.finish_prefetch(op, "best_effort")
        cache.abort_req(req)
        req = cache.admit([*toks, 7])
        assert req.prefix_len + req.host_hit_length == n, (req.host_hit_length, n)
        await cache.load_back_request(req)
        if n:
            _l3_served(cache, toks, n, rank)
        cache.abort_req(req)
        got.append(n)
        await cache.flush()
        cache.sanity_check()
        out["got"] = got
        out["digest"] = tree_digest(cache)
        out["kv"] = kv_digest(cache)
        out["injected"] = backend.injected_total()
        out["host_states"] = len(cache.tree.component_host_slots("mamba"))
        out["fallbacks"] = {
            reason: _counter(cache, "asynccache_prefetch_component_fallback_tokens_total",
                             reason=reason)
            for reason in ("not_stored", "fault", "stopped", "host_memory")}
        out["in_flight"] = (cache.in_flight, cache.host_in_flight,
                            dict(cache.hybrid.tier.inflight), cache.tree.held_locks)
    finally:
        await cache.aclose()
        await inner.aclose()
    hy, tier = cache.hybrid, cache.hybrid.tier
    out["closed_clean"] = (cache.device_pool.allocator.used_size,
                           cache.host_pool.allocator.used_size, hy.swa_map.swa.used_size,
                           hy.mamba_pool.used_size, tier.swa_host.allocator.used_size,
                           tier.mamba_host.used_size) == (0, 0, 0, 0, 0, 0)
    return out


def l3_convs() -> list[tuple[list[int], tuple[int, ...]]]:
    rng = random.Random("hybrid-l3-ranks")
    return [([rng.randrange(50_000) for _ in range(L3_N)], turns)
            for turns in ((200, 400, L3_N), (100, 300, L3_N), (300, L3_N))]


def hybrid_l3(rank: int, world_size: int, init_method: str, url: str, kwargs: dict[str, Any],
              die: bool = False, mamba_host: int = 4) -> dict[str, Any]:
    """Write with 2 ranks, then prefetch with a fresh pair of caches (see _l3_read) with
    ``mamba_host`` host states (1: every component target evicts a host state or gives the
    held one up, at the tick)."""
    from asynccache.ranks import TorchRankGroup

    torch.set_num_threads(1)
    group = TorchRankGroup.create(rank, world_size, init_method, tp_size=world_size,
                                  timeout_s=20.0 if not die else 4.0)
    try:
        convs = l3_convs()
        asyncio.run(_l3_write(group, url, kwargs, convs))
        return asyncio.run(_l3_read(group, url, kwargs, convs, die, mamba_host))
    finally:
        group.close()
