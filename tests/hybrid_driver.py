"""The seeded random workload driver shared by tests/cache/test_hybrid_host_random.py and the
rank processes of tests/scale/hybrid_rank_scenarios.py: a hybrid cache (FULL with SWA, Mamba
or both) with a host tier, driven by one sequential scheduler.

Every token's KV (FULL and SWA) and every Mamba state is a function of the prefix it belongs
to (:func:`tag`), so whatever the cache serves can be checked bit for bit
(:meth:`Driver.check_served`). Import it as ``tests.hybrid_driver``: under pytest ``tests`` is
a namespace package rooted at the repository; a file loaded by path (the rank scenarios) puts
the repository root on ``sys.path`` first.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import torch

__all__ = ["Driver", "kv", "randomize", "tag"]


def randomize(cache: Any, seed: int) -> torch.Generator:
    """Fill the device KV pool and every component pool (SWA KV, Mamba states) of a hybrid
    cache with seeded random values; returns the generator, to draw further values from."""
    g = torch.Generator().manual_seed(seed)
    hy = cache.hybrid
    pools = [cache.device_pool.kv]
    if hy.swa_pool is not None:
        pools.append(hy.swa_pool.kv)
    if hy.mamba_pool is not None:
        pools.append(hy.mamba_pool.states)
    for t in pools:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return g


def tag(prefix: tuple[int, ...]) -> float:
    return float(zlib.crc32(repr(prefix).encode()) % 100_003)


def kv(pool: Any, toks: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    L, _, _, H, D = pool.kv.shape
    vals = torch.tensor([tag(toks[: i + 1]) for i in range(lo, hi)], dtype=pool.kv.dtype)
    return vals.view(1, 1, -1, 1, 1).expand(L, 2, hi - lo, H, D)


class Driver:
    """One sequential scheduler: the same calls in the same order for the same seed.

    ``log`` records every decision (compared across ranks); ``loads`` counts load-backs
    begun and ``truncated`` the inserts that stopped before a node still loading.
    ``evict_for_state``: when no Mamba state is free, evict one and try again before
    inserting without a state. ``transfer_errors``: an awaited load-back that raises
    :class:`~asynccache.errors.TransferError` is logged as failed instead of raising.
    """

    def __init__(self, cache: Any, rng: random.Random, *, evict_for_state: bool = False,
                 transfer_errors: bool = False) -> None:
        self.cache = cache
        self.rng = rng
        self.hy = cache.hybrid
        self.evict_for_state = evict_for_state
        self.transfer_errors = transfer_errors
        self.history: list[tuple[int, ...]] = []
        self.pending: list[Any] = []
        self.log: list[Any] = []
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
        if hy.swa_map is not None:
            swa = torch.from_numpy(hy.swa_map.translate(slots).copy())
            hy.swa_pool.kv.index_copy_(2, swa, kv(hy.swa_pool, toks, 0, len(toks)))
        state = None
        if hy.mamba_pool is not None:
            state = c.alloc_mamba_state()
            if state is None and self.evict_for_state:
                c.evict(0, mamba_num=1)
                state = c.alloc_mamba_state()
            if state is not None:
                hy.mamba_pool.states[state].fill_(tag(toks))
        res = c.insert(list(toks), slots, mamba_value=state)
        if res.cached_len < len(toks):  # stopped before a node still loading: ours again
            self.truncated += 1
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
                if not self.transfer_errors:
                    raise
                self.log.append(("load", m.device_prefix_len, m.host_hit_length, "failed"))
                return
            if lb is not None:
                self.loads += 1
                c.release_load(lb)
        else:
            lb = c.begin_load_back(m)
            if lb is not None:
                self.loads += 1
                self.pending.append(lb)
        self.log.append(("load", m.device_prefix_len, m.host_hit_length, lb is not None))

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
            if hy.swa_map is not None:
                w = min(4, n)
                swa = torch.from_numpy(hy.swa_map.translate(m.device_indices[n - w :]).copy())
                assert torch.equal(hy.swa_pool.kv.index_select(2, swa),
                                   kv(hy.swa_pool, toks, n - w, n)), toks[:n]
            if hy.mamba_pool is not None:
                state = hy.mamba_pool.states[m.mamba_cow_slot]
                assert bool((state == tag(toks[:n])).all()), toks[:n]
