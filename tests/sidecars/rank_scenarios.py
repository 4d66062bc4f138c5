"""Code that runs inside the spawned rank processes of tests/sidecars/test_ranks.py (loaded by
file path): two tensor-parallel ranks, each a cache with a draft-KV and an indexer sidecar over
its own shard of a shared file store; every copy commits at agreed ticks."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

PS = 4


def _sidecar_data(name: str, toks: np.ndarray, start: int, n: int, rank: int) -> Any:
    """Each rank's sidecar data of tokens ``toks[start:n]``: a function of (rank, token,
    position), as (layers, tokens, *token_shape)."""
    import torch

    pos = np.arange(start, n)
    base = (toks[start:n].astype(np.int64) * 31 + pos * 7 + rank * 1000) % 4093
    t = torch.from_numpy(base.astype(np.float32))
    if name == "indexer":
        return (t[:, None] + torch.arange(4, dtype=torch.float32)).unsqueeze(0)
    vals = t[:, None, None, None] + torch.arange(2 * 2 * 8, dtype=torch.float32).view(2, 2, 8)
    return vals.to(torch.float16).unsqueeze(0)


def _check(cache: Any, toks: np.ndarray, slots: np.ndarray, rank: int, what: str) -> int:
    import torch

    from asynccache.replay.kvgen import expected_kv, mismatched_tokens, same_bits

    n = len(slots)
    got = cache.read_kv(slots)
    want = expected_kv(cache.shape, toks[:n], np.arange(n))
    if not same_bits(got, want):
        raise AssertionError(f"{what}: wrong KV at {mismatched_tokens(got, want)[:8].tolist()}")
    for sc in cache.sidecars:
        if not torch.equal(sc.device.read_slots(slots), _sidecar_data(sc.name, toks, 0, n, rank)):
            raise AssertionError(f"{what}: wrong {sc.name} data")
    return n


async def _run(group: Any, root: str) -> dict[str, Any]:
    import torch

    from asynccache import CacheConfig, HierarchicalCache
    from asynccache.l3 import StoragePolicy
    from asynccache.replay.kvgen import expected_kv
    from asynccache.storage.file import FileBackend
    from asynccache.transfers.sidecars import SidecarSpec

    rank = group.rank
    cfg = CacheConfig(page_size=PS, num_layers=2, num_heads=2, head_dim=8, dtype="float16",
                      device_tokens=256, host_tokens=512, host_layout="page_first",
                      write_policy="write_through", load_back_threshold=1)
    cache = HierarchicalCache(cfg, ranks=group)
    cache.register_draft_pools(num_layers=1, num_heads=2, head_dim=8)
    cache.register_sidecar_pool(SidecarSpec(name="indexer", token_shape=(4,), dtype="float32"))
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 50_000, size=int(rng.integers(5, 10)) * PS).astype(np.uint32)
            for _ in range(4)]
    seqs = [np.concatenate([docs[i % 4], rng.integers(0, 50_000, size=6).astype(np.uint32)])
            for i in range(10)]
    log: list[tuple[int, ...]] = []
    checked = 0
    async with cache:
        backend = FileBackend(root, cache.storage_layout())
        await backend.start()
        cache.attach_storage(backend, StoragePolicy(prefetch_threshold=PS))
        for phase in range(2):
            for i, toks in enumerate(seqs):
                req = cache.admit(toks, rid=f"p{phase}r{i}")
                fetched = await cache.prefetch_request(req, policy="wait_complete")
                loaded = await cache.load_back_request(req)
                checked += _check(cache, toks, req.slots[: req.prefix_len], rank,
                                  f"rank {rank} phase {phase} request {i}")
                n = len(toks)
                new = await cache.extend(req, n - req.computed)
                start = n - len(new)
                cache.write_kv(new, expected_kv(cache.shape, toks[start:], np.arange(start, n)))
                idx = torch.from_numpy(np.asarray(new, dtype=np.int64))
                for sc in cache.sidecars:
                    sc.device.data[:, idx] = _sidecar_data(sc.name, toks, start, n, rank)
                cache.cache_finished_req(req)
                log.append((phase, i, fetched, loaded, req.prefix_len))
                if rank:
                    await asyncio.sleep(0.001 * (1 + i % 3))  # rank-local timing only
                if i % 3 == 2:
                    await cache.sync()
            # Everything out of device and host: the next phase reads storage.
            await cache.flush()
            await cache.storage.drain()
            await cache.evict_async(10**6)
            await cache.flush()
            cache.evict_host(10**6)
            await cache.sync()
        cache.sanity_check()
        await cache.detach_storage()
        await backend.aclose()
    return {"rank": rank, "log": log, "checked": checked}


def serve(rank: int, world_size: int, init_method: str, root: str) -> dict[str, Any]:
    import torch

    from asynccache.ranks import TorchRankGroup

    torch.set_num_threads(1)
    group = TorchRankGroup.create(rank, world_size, init_method, tp_size=world_size,
                                  timeout_s=30.0)
    try:
        return asyncio.run(_run(group, root))
    finally:
        group.close()
