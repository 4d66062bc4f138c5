"""Many requests at once through a buffer-only host under staging pressure: reads park, writes
wait for their window, requests are cancelled at random points. Every served token is checked
bit for bit, and at the end nothing is held and the accounting balances."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from asynccache.errors import PoolExhaustedError
from asynccache.l3 import StoragePolicy

POLICY = StoragePolicy(prefetch_threshold=8, timeout_base_s=5.0)


def _workload(kit, rng: random.Random) -> list[np.ndarray]:
    """Prompts sharing a few stems (some stored, some not), 8-40 pages each."""
    stems = [kit.tokens(500 + i, 4 * rng.randint(4, 20)) for i in range(6)]
    out = []
    for i in range(40):
        stem = stems[rng.randrange(len(stems))]
        tail = kit.tokens(600 + i, 4 * rng.randint(4, 20) + rng.randint(0, 3))
        out.append(np.concatenate([stem, tail]))
    return out


@pytest.mark.parametrize("seed", [0, 1])
async def test_concurrent_requests_under_staging_pressure(kit, make_cache, make_file_backend,
                                                          seed) -> None:
    rng = random.Random(seed)
    seqs = _workload(kit, rng)
    w = await make_cache()
    w.attach_storage(await make_file_backend(w), POLICY)
    await kit.write_sequences(w, seqs[::2])  # half of them stored up front
    await kit.quiesce(w)
    await w.detach_storage()
    await w.aclose()

    c = await make_cache(device_tokens=1024, host_tokens=256, write_policy="write_through")
    c.attach_storage(await make_file_backend(c), POLICY)
    served: list[int] = []
    rejected: list[int] = []

    async def one(i: int, s: np.ndarray) -> None:
        await asyncio.sleep(rng.random() * 0.01)
        try:
            await kit.serve(c, s, policy=rng.choice(["wait_complete", "timeout"]))
        except PoolExhaustedError:
            rejected.append(i)
            return
        served.append(i)

    tasks = [asyncio.ensure_future(one(i, s)) for i, s in enumerate(seqs)]
    doomed = rng.sample(tasks, 8)
    await asyncio.sleep(0.005)
    for t in doomed:
        t.cancel()
    done, pending = await asyncio.wait(tasks, timeout=60.0)
    assert not pending
    for t in done:
        if not t.cancelled():
            assert t.exception() is None, repr(t.exception())
    cancelled = sum(t.cancelled() for t in tasks)
    assert len(served) + len(rejected) + cancelled == len(seqs)
    assert len(served) >= 20
    # 40 prompts at once over 230 tokens of read budget: fetches had to wait for staging.
    assert kit.counter(c, "asynccache_buffer_parked_prefetches") > 0
    await kit.quiesce(c)
    kit.assert_at_rest(c)
    # Every served prompt was written through (or fetched): all its whole pages are stored...
    backend = c.storage.backend
    for i in served:
        keys = kit.page_keys(seqs[i])
        assert await backend.exists_prefix(keys) == len(keys), f"prompt {i}"
    # ...and a cache that lost its device copies serves them entirely from storage or device.
    c.evict(10**6)
    for i in served:
        r = await kit.serve(c, seqs[i], policy="wait_complete")
        assert r.prefix == len(seqs[i]) - len(seqs[i]) % kit.PS, f"prompt {i}"
    await kit.quiesce(c)
