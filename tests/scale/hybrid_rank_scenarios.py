"""Code that runs inside the spawned rank processes of tests/scale/test_hybrid_ranks.py
(loaded by file path): a hybrid cache (FULL + SWA + Mamba) with a host tier on every rank.

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
import zlib
from typing import Any

import torch

PS = 2
HYBRID = dict(sliding_window=4, swa_tokens=40, mamba_states=6, mamba_state_shape=(2, 3))


def tag(prefix: tuple[int, ...]) -> float:
    return float(zlib.crc32(repr(prefix).encode()) % 100_003)


def kv(pool: Any, toks: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    L, _, _, H, D = pool.kv.shape
    vals = torch.tensor([tag(toks[: i + 1]) for i in range(lo, hi)], dtype=pool.kv.dtype)
    return vals.view(1, 1, -1, 1, 1).expand(L, 2, hi - lo, H, D)


class Driver:
    """One sequential scheduler: the same calls in the same order on every rank."""

    def __init__(self, cache: Any, rng: random.Random) -> None:
        self.cache = cache
        self.rng = rng
        self.hy = cache.hybrid
        self.history: list[tuple[int, ...]] = []
        self.pending: list[Any] = []
        self.log: list[Any] = []

    def key(self) -> tuple[int, ...]:
        base: tuple[int, ...] = ()
        if self.history and self.rng.random() < 0.7:
            b = self.rng.choice(self.history)
            base = b[: self.rng.randrange(0, len(b) + 1, PS)]
        tail = tuple(self.rng.randrange(3) for _ in range(PS * self.rng.randrange(0, 4)))
        return base + tail

    def insert(self) -> None:
        c, hy = self.cache, self.hy
        toks = self.key()
        if not toks:
            return
        slots = c.try_alloc_device(len(toks))
        if slots is None:
            self.log.append(("insert", len(toks), None))
            return
        idx = torch.from_numpy(slots.copy())
        c.device_pool.kv.index_copy_(2, idx, kv(c.device_pool, toks, 0, len(toks)))
        swa = torch.from_numpy(hy.swa_map.translate(slots).copy())
        hy.swa_pool.kv.index_copy_(2, swa, kv(hy.swa_pool, toks, 0, len(toks)))
        state = c.alloc_mamba_state()
        if state is not None:
            hy.mamba_pool.states[state].fill_(tag(toks))
        res = c.insert(list(toks), slots, mamba_value=state)
        if res.cached_len < len(toks):  # stopped before a node still loading: ours again
            c.free_device(slots[res.cached_len :])
        self.history.append(toks)
        self.log.append(("insert", len(toks), res.cached_len))

    async def load(self, wait: bool) -> None:
        c = self.cache
        if not self.history:
            return
        m = c.match_prefix(list(self.rng.choice(self.history)))
        if wait:
            from asynccache.errors import TransferError

            try:
                lb = await c.load_back(m)
            except TransferError:  # failed here or on a peer: every rank raises, nothing loaded
                self.log.append(("load", m.device_prefix_len, m.host_hit_length, "failed"))
                return
            if lb is not None:
                c.release_load(lb)
        else:
            lb = c.begin_load_back(m)
            if lb is not None:
                self.pending.append(lb)
        self.log.append(("load", m.device_prefix_len, m.host_hit_length, lb is not None))

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

    async def settle(self) -> None:
        await self.cache.flush()
        for lb in self.pending:
            self.cache.release_load(lb)
        self.pending.clear()

    def check_served(self) -> None:
        c, hy = self.cache, self.hy
        for toks in self.history:
            m = c.match_prefix(list(toks), cow_mamba=True)
            n = m.device_prefix_len
            if not n:
                continue
            idx = torch.from_numpy(m.device_indices.copy())
            got = c.device_pool.kv.index_select(2, idx)
            assert torch.equal(got, kv(c.device_pool, toks, 0, n)), toks[:n]
            w = min(4, n)
            swa = torch.from_numpy(hy.swa_map.translate(m.device_indices[n - w :]).copy())
            assert torch.equal(hy.swa_pool.kv.index_select(2, swa),
                               kv(hy.swa_pool, toks, n - w, n)), toks[:n]
            assert bool((hy.mamba_pool.states[m.mamba_cow_slot] == tag(toks[:n])).all())


def kv_digest(cache: Any) -> str:
    """SHA-256 over the bytes every tree node's slots hold, in every pool: FULL and SWA KV and
    Mamba states, on device and on host (slots nobody holds are not compared)."""
    hy, tier = cache.hybrid, cache.hybrid.tier
    h = hashlib.sha256()
    for n in sorted(cache.tree.iter_nodes(), key=lambda n: n.id):
        parts = [(cache.device_pool, n.value), (cache.host_pool, n.host_value)]
        if n.aux:
            swa, mamba = n.aux
            parts += [(hy.swa_pool, swa.value), (tier.swa_host, swa.host_value)]
            for pool, v in ((hy.mamba_pool, mamba.value), (tier.mamba_host, mamba.host_value)):
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
              copy_faults(cache._engine, delay_s=0.0 if rank else 0.001,
                          fail={5} if fail_at and rank == 0 else ())]
    d = Driver(cache, random.Random(f"hybrid-ranks/{policy}"))
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
            out["ticks"] = cache._agree.ticks
            out["held_back"] = cache._agree.held_back
            out["failed_items"] = cache._agree.failed_items
            out["skipped"] = {op: _counter(cache, "asynccache_hybrid_skipped_total", op=op)
                              for op in ("backup", "load_back")}
            out["load_backs"] = _counter(cache, "asynccache_load_back_tokens_total")
            out["backups"] = _counter(cache, "asynccache_backup_tokens_total")
            out["dropped"] = _counter(cache, "asynccache_dropped_tokens_total",
                                      reason="backup_failed")
            out["host_parts"] = (len(cache.tree.component_host_slots("swa")),
                                 len(cache.tree.component_host_slots("mamba")))
            out["injected_failures"] = faults[0].failed + faults[2].failed
            out["in_flight"] = (cache.in_flight, cache._host_inflight, dict(tier.inflight),
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
                                  timeout_s=20.0 if die_at is None else 4.0)
    try:
        return asyncio.run(_workload(group, policy, steps, fail_at, die_at))
    finally:
        group.close()
