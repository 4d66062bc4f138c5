"""Seeded random workloads over a hybrid cache with a host tier. Every token's KV (FULL and
SWA) and every Mamba state is a function of the prefix it belongs to, so whatever the cache
serves after any mix of inserts, evictions, host evictions, backups and load-backs (awaited or
left in flight) can be checked bit for bit; ``sanity_check()`` runs after every step."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from tests.hybrid_driver import Driver

COMBOS = {
    "full+swa": {"sliding_window": 4, "swa_tokens": 40},
    "full+mamba": {"mamba_states": 6, "mamba_state_shape": (2, 3)},
    "full+swa+mamba": {"sliding_window": 4, "swa_tokens": 40, "mamba_states": 6,
                       "mamba_state_shape": (2, 3)},
}


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_random_hybrid_host_workload(make_cache: Any, combo: str, policy: str) -> None:
    cache = await make_cache(page_size=2, device_tokens=40, host_tokens=48, dtype="float32",
                             write_policy=policy, load_back_threshold=0, **COMBOS[combo])
    seed = os.environ.get("ASYNCCACHE_RANDOM_SEED", "")
    d = Driver(cache, random.Random(f"{combo}/{policy}{seed}"), evict_for_state=True)
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
