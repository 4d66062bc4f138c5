"""Seeded random workloads over a hybrid cache with a host tier. Every token's KV (FULL and
SWA) and every Mamba state is a function of the prefix it belongs to, so whatever the cache
serves after any mix of inserts, evictions, host evictions, backups and load-backs (awaited or
left in flight) can be checked bit for bit; ``sanity_check()`` runs after every step."""

from __future__ import annotations

import os
import random
import zlib
from typing import Any

import pytest
import torch

COMBOS = {
    "full+swa": {"sliding_window": 4, "swa_tokens": 40},
    "full+mamba": {"mamba_states": 6, "mamba_state_shape": (2, 3)},
    "full+swa+mamba": {"sliding_window": 4, "swa_tokens": 40, "mamba_states": 6,
                       "mamba_state_shape": (2, 3)},
}


def tag(prefix: tuple[int, ...]) -> float:
    return float(zlib.crc32(repr(prefix).encode()) % 100_003)


def kv(pool: Any, toks: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    L, _, _, H, D = pool.kv.shape
    vals = torch.tensor([tag(toks[: i + 1]) for i in range(lo, hi)], dtype=pool.kv.dtype)
    return vals.view(1, 1, -1, 1, 1).expand(L, 2, hi - lo, H, D)


class Driver:
    def __init__(self, cache: Any, rng: random.Random) -> None:
        self.cache = cache
        self.rng = rng
        self.hy = cache.hybrid
        self.history: list[tuple[int, ...]] = []
        self.pending: list[Any] = []
        self.loads = 0
        self.truncated = 0

    def key(self) -> tuple[int, ...]:
        ps = self.cache.page_size
        base: tuple[int, ...] = ()
        if self.history and self.rng.random() < 0.7:
            b = self.rng.choice(self.history)
            base = b[: self.rng.randrange(0, len(b) + 1, ps)]
        tail = tuple(self.rng.randrange(3) for _ in range(ps * self.rng.randrange(0, 4)))
        return base + tail

    def insert(self) -> None:
        c = self.cache
        toks = self.key()
        if not toks:
            return
        slots = c.try_alloc_device(len(toks))
        if slots is None:
            return
        idx = torch.from_numpy(slots.copy())
        c.device_pool.kv.index_copy_(2, idx, kv(c.device_pool, toks, 0, len(toks)))
        if self.hy.swa_map is not None:
            swa = torch.from_numpy(self.hy.swa_map.translate(slots).copy())
            self.hy.swa_pool.kv.index_copy_(2, swa, kv(self.hy.swa_pool, toks, 0, len(toks)))
        state = None
        if self.hy.mamba_pool is not None:
            state = c.alloc_mamba_state()
            if state is None:
                c.evict(0, mamba_num=1)
                state = c.alloc_mamba_state()
            if state is not None:
                self.hy.mamba_pool.states[state].fill_(tag(toks))
        res = c.insert(list(toks), slots, mamba_value=state)
        if res.cached_len < len(toks):  # stopped before a node still loading: ours again
            self.truncated += 1
            c.free_device(slots[res.cached_len :])
        self.history.append(toks)

    async def load(self, wait: bool) -> None:
        c = self.cache
        if not self.history:
            return
        m = c.match_prefix(list(self.rng.choice(self.history)))
        if wait:
            lb = await c.load_back(m)
            if lb is not None:
                self.loads += 1
                c.release_load(lb)
        else:
            lb = c.begin_load_back(m)
            if lb is not None:
                self.loads += 1
                self.pending.append(lb)

    async def settle(self) -> None:
        await self.cache.flush()
        for lb in self.pending:
            self.cache.release_load(lb)
        self.pending.clear()

    def check_served(self) -> None:
        c = self.cache
        for toks in self.history:
            m = c.match_prefix(list(toks), cow_mamba=True)
            n = m.device_prefix_len
            if not n:
                continue
            idx = torch.from_numpy(m.device_indices.copy())
            got = c.device_pool.kv.index_select(2, idx)
            assert torch.equal(got, kv(c.device_pool, toks, 0, n)), toks[:n]
            if self.hy.swa_map is not None:
                w = min(4, n)
                swa = torch.from_numpy(self.hy.swa_map.translate(m.device_indices[n - w :]).copy())
                got = self.hy.swa_pool.kv.index_select(2, swa)
                assert torch.equal(got, kv(self.hy.swa_pool, toks, n - w, n)), toks[:n]
            if self.hy.mamba_pool is not None:
                state = self.hy.mamba_pool.states[m.mamba_cow_slot]
                assert bool((state == tag(toks[:n])).all()), toks[:n]


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_random_hybrid_host_workload(make_cache: Any, combo: str, policy: str) -> None:
    cache = await make_cache(page_size=2, device_tokens=40, host_tokens=48, dtype="float32",
                             write_policy=policy, load_back_threshold=0, **COMBOS[combo])
    seed = os.environ.get("ASYNCCACHE_RANDOM_SEED", "")
    d = Driver(cache, random.Random(f"{combo}/{policy}{seed}"))
    for step in range(300):
        op = d.rng.random()
        if op < 0.4:
            d.insert()
        elif op < 0.55:
            cache.evict(d.rng.randrange(0, 24),
                        swa_num_tokens=d.rng.randrange(0, 6) if cache.hybrid.swa_map else 0,
                        mamba_num=d.rng.randrange(0, 2) if cache.hybrid.mamba_pool else 0)
        elif op < 0.62:
            cache.evict_host(d.rng.randrange(1, 12))
        elif op < 0.8:
            await d.load(wait=True)
        elif op < 0.9:
            await d.load(wait=False)
        else:
            await d.settle()
            d.check_served()
        cache.sanity_check()
        if step % 40 == 39:
            await d.settle()
            d.check_served()
    await d.settle()
    d.check_served()
    assert d.loads > 0
    cache.sanity_check()
