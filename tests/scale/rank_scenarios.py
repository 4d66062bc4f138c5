"""Code that runs inside the spawned rank processes of tests/scale (loaded by file path).

Every function takes ``(rank, world_size, init_method, ...)`` and returns plain data.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np

# Loaded by file path in the rank processes: the repository root makes ``tests`` importable.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

PS = 4


def _config(**over: Any) -> Any:
    from asynccache import CacheConfig

    base: dict[str, Any] = dict(
        page_size=PS, num_layers=2, num_heads=2, head_dim=8, dtype="float16",
        device_tokens=128, host_tokens=192, host_layout="page_first",
        write_policy="write_through", load_back_threshold=1, enable_kv_events=True,
        enable_page_hashes=True)
    base.update(over)
    return CacheConfig(**base)


def request_stream(n: int, seed: int = 7) -> list[np.ndarray]:
    """``n`` prompts over 6 shared documents: each is a document prefix plus its own tail."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 50_000, size=int(rng.integers(6, 12)) * PS).astype(np.uint32)
            for _ in range(6)]
    out = []
    for _ in range(n):
        d = docs[int(rng.integers(0, len(docs)))]
        tail = rng.integers(0, 50_000, size=int(rng.integers(1, 4)) * PS + int(rng.integers(0, 3)))
        out.append(np.concatenate([d, tail.astype(np.uint32)]))
    return out


def _verify(cache: Any, toks: np.ndarray, slots: np.ndarray, what: str) -> None:
    from asynccache.replay.kvgen import expected_kv, mismatched_tokens, same_bits

    got = cache.read_kv(slots)
    want = expected_kv(cache.shape, toks[: len(slots)], np.arange(len(slots)))
    if not same_bits(got, want):
        raise AssertionError(f"{what}: wrong KV at {mismatched_tokens(got, want)[:8].tolist()}")


async def _serve_stream(cache: Any, seqs: list[np.ndarray], rank: int) -> list[tuple[int, ...]]:
    """One sequential scheduler: the same calls in the same order on every rank; only the
    local timing differs (sleeps of different lengths between calls, storage delays)."""
    policies = ("wait_complete", "best_effort", "timeout")
    log = []
    for i, toks in enumerate(seqs):
        req = cache.admit(toks, rid=f"r{i}")
        dev, host = req.prefix_len, req.host_hit_length
        fetched = await cache.prefetch_request(req, policy=policies[i % 3])
        loaded = await cache.load_back_request(req)
        _verify(cache, toks, req.slots[: req.prefix_len], f"rank {rank} request {i}")
        n = len(toks)
        if n > req.computed:
            from asynccache.replay.kvgen import expected_kv

            new = await cache.extend(req, n - req.computed)
            start = n - len(new)
            cache.write_kv(new, expected_kv(cache.shape, toks[start:], np.arange(start, n)))
        cache.cache_finished_req(req)
        log.append((i, dev, host, fetched, loaded, req.prefix_len))
        if rank % 2:
            await asyncio.sleep(0.002 * (1 + i % 3))  # rank-local timing only
        if i % 4 == 3:
            await cache.sync()
        if i % 7 == 6:
            cache.evict(2 * PS)
    return log


async def _agreement(group: Any, root: str, n_requests: int, fail_rank: int | None,
                     replicated: bool, device: str = "cpu",
                     write_policy: str = "write_through") -> dict[str, Any]:
    from asynccache import HierarchicalCache
    from asynccache.errors import RankGroupError
    from asynccache.l3 import StoragePolicy
    from asynccache.storage.faults import FaultInjectingBackend, FaultKind, FaultRule
    from asynccache.storage.file import FileBackend
    from asynccache.testing.ranks import tree_digest

    rank = group.rank
    out: dict[str, Any] = {"rank": rank}
    cache = HierarchicalCache(_config(kv_replicated=replicated, device=device,
                                      write_policy=write_policy), ranks=group)
    await cache.start()
    inner = FileBackend(root, cache.storage_layout())
    await inner.start()
    # Rank-local storage timing: odd ranks see slow reads and writes, even ranks fast ones.
    delay = 0.004 if rank % 2 else 0.0005
    backend = FaultInjectingBackend(
        inner, [FaultRule(FaultKind.DELAY, rate=0.7, delay_s=delay)], seed=rank)
    cache.attach_storage(backend, StoragePolicy(prefetch_threshold=2 * PS))
    seqs = request_stream(n_requests)
    log = await _serve_stream(cache, seqs, rank)
    await cache.flush()
    await cache.storage.drain()
    await cache.flush()
    cache.sanity_check()
    events = [repr(e) for e in cache.take_events()]
    reg = cache.metrics.registry

    def counter(name: str, **labels: str) -> float:
        v = reg.get_sample_value(name, labels or None)
        return float(v or 0.0)

    state = {"digest": tree_digest(cache), "events": events, "log": log,
             "ticks": cache.agreement.ticks, "held_locks": cache.tree.held_locks,
             "host_inflight": cache.host_in_flight, "in_flight": cache.in_flight}
    out.update(state)
    out["held_back"] = cache.agreement.held_back
    out["prefetched"] = counter("asynccache_prefetched_tokens_total")
    out["evicted"] = counter("asynccache_evicted_tokens_total")
    out["object_name"] = cache.storage_layout().object_name("ab" * 32)
    out["all_names"] = [b.decode() for b in
                        await group.all_gather_bytes(out["object_name"].encode())]
    out["tp_min"] = (await group.all_reduce_min([rank], scope="tp"))[0]
    out["pp_min"] = (await group.all_reduce_min([rank], scope="pp"))[0]
    mins, maxs = await group.all_reduce_min_max([rank + 10], [rank])
    out["min_max"] = (mins[0], maxs[0])
    # A cancelled sync() still completes its tick (its peers are in the collective): the
    # next sync waits for it, and the ranks stay in step.
    before = cache.agreement.ticks
    tick = asyncio.get_running_loop().create_task(cache.sync())
    await asyncio.sleep(0)
    tick.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await tick
    await cache.sync()
    state["ticks_after_cancel"] = cache.agreement.ticks - before
    state["digest_after_cancel"] = tree_digest(cache)
    out.update(state)
    # Every rank checks its peers' state itself too (the test compares the returned copies).
    blobs = await group.all_gather_bytes(pickle.dumps(state))
    out["peers_equal"] = all(pickle.loads(b) == state for b in blobs)
    if fail_rank is not None:
        await group.barrier()
        if rank == fail_rank:
            os._exit(3)  # a rank dies without a word
        try:
            await asyncio.wait_for(cache.sync(), 30)
        except RankGroupError as exc:
            out["failure"] = str(exc)
        # The rank group failed: the cache still drains and closes (locally).
    await cache.detach_storage()
    await cache.aclose()
    await backend.aclose()
    out["closed_clean"] = (cache.device_pool.allocator.used_size == 0
                           and cache.host_pool.allocator.used_size == 0)
    return out


def agreement(rank: int, world_size: int, init_method: str, root: str, n_requests: int,
              tp_size: int, fail_rank: int | None = None, replicated: bool = False,
              backend: str = "gloo", write_policy: str = "write_through") -> dict[str, Any]:
    import torch

    from asynccache.ranks import TorchRankGroup

    torch.set_num_threads(1)
    group = TorchRankGroup.create(rank, world_size, init_method, tp_size=tp_size,
                                  backend=backend, timeout_s=20.0 if fail_rank is None else 5.0)
    device = group.device if backend == "nccl" else "cpu"
    try:
        return asyncio.run(_agreement(group, root, n_requests, fail_rank, replicated, device,
                                      write_policy))
    finally:
        group.close()


def raise_on_odd_rank(rank: int, world_size: int, init_method: str) -> str:
    if rank % 2:
        raise ValueError(f"rank {rank} was told to fail")
    return f"rank {rank} ok"


async def _shared_l3(group: Any, url: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """One independent cache instance per process over ONE shared backend (a directory or
    an S3 prefix). ``group`` only coordinates the test (barriers); the caches do not agree."""
    from asynccache import HierarchicalCache
    from asynccache.l3 import StoragePolicy
    from asynccache.storage.factory import open_backend

    me, other = group.rank, 1 - group.rank
    rng = np.random.default_rng(11)
    common = [rng.integers(0, 50_000, size=40).astype(np.uint32) for _ in range(3)]
    own = {r: [np.random.default_rng(100 + 10 * r + i).integers(0, 50_000, size=36)
               .astype(np.uint32) for i in range(3)] for r in (0, 1)}
    out: dict[str, Any] = {"rank": me}
    cfg = _config(enable_kv_events=False, device_tokens=512, host_tokens=1024)
    async with HierarchicalCache(cfg) as cache:
        backend = await open_backend(url, cache.storage_layout(), **kwargs)
        cache.attach_storage(backend, StoragePolicy(prefetch_threshold=PS))
        await group.barrier()
        # Phase 1: both instances write the common prompts at once (same pages, concurrent
        # writers) and their own prompts.
        await _serve_stream_plain(cache, common + own[me])
        await cache.flush()
        await cache.storage.drain()
        await group.barrier()
        # Phase 2: each serves the OTHER instance's prompts: nothing of them is local, all of
        # their whole pages must come from the shared tier, bit for bit.
        fetched = []
        for toks in own[other] + common:
            req = cache.admit(toks)
            local = req.prefix_len + req.host_hit_length
            got = await cache.prefetch_request(req, policy="wait_complete")
            await cache.load_back_request(req)
            _verify(cache, toks, req.slots[: req.prefix_len], f"instance {me}")
            fetched.append((local, got, req.prefix_len))
            cache.abort_req(req)
        out["fetched"] = fetched
        cache.sanity_check()
        await cache.detach_storage()
        await backend.aclose()
    await group.barrier()
    return out


async def _serve_stream_plain(cache: Any, seqs: list[np.ndarray]) -> None:
    from asynccache.replay.kvgen import expected_kv

    for toks in seqs:
        req = cache.admit(toks)
        await cache.load_back_request(req)
        n = len(toks)
        new = await cache.extend(req, n - req.computed)
        start = n - len(new)
        cache.write_kv(new, expected_kv(cache.shape, toks[start:], np.arange(start, n)))
        cache.cache_finished_req(req)


def shared_l3(rank: int, world_size: int, init_method: str, url: str,
              kwargs: dict[str, Any]) -> dict[str, Any]:
    import torch

    from asynccache.ranks import TorchRankGroup

    torch.set_num_threads(1)
    group = TorchRankGroup.create(rank, world_size, init_method, timeout_s=60.0)
    try:
        return asyncio.run(_shared_l3(group, url, kwargs))
    finally:
        group.close()


async def _diverge(group: Any) -> str:
    """Rank 1 serves one request more than rank 0: the next tick must say the ranks diverged."""
    from asynccache import HierarchicalCache
    from asynccache.errors import RankGroupError

    async with HierarchicalCache(_config(device_tokens=1024, host_tokens=2048),
                                 ranks=group) as cache:
        await _serve_stream(cache, request_stream(3), 0)
        if group.rank == 1:  # room to spare, no hit: no tick of its own, only a bigger tree
            extra = np.arange(1_000_000, 1_000_040, dtype=np.uint32)
            await _serve_stream_plain(cache, [extra])
        try:
            await cache.sync()
        except RankGroupError as exc:
            return str(exc)
        return "no error"


def diverge_then_hang(rank: int, world_size: int, init_method: str) -> list[str]:
    """Then rank 1 stays alive but never joins a collective: rank 0's must time out, clearly."""
    import time

    import torch.distributed as dist

    from asynccache.errors import RankGroupError
    from tests.scale.control_plane_scenarios import joined

    group = joined(rank, world_size, init_method, timeout_s=1.0)
    try:
        out = [asyncio.run(_diverge(group))]
        asyncio.run(group.barrier())
        if rank == 1:
            time.sleep(2.5)
            return [*out, "slept"]
        try:
            asyncio.run(group.all_reduce_min([1, 2]))
        except RankGroupError as exc:
            return [*out, str(exc)]
        return [*out, "no error"]
    finally:
        group.close()
        dist.destroy_process_group()


def join_alone(rank: int, world_size: int, init_method: str) -> str:
    """A world of 2 that only this process joins: the rendezvous must fail, clearly."""
    from asynccache.errors import RankGroupError
    from asynccache.ranks import TorchRankGroup

    try:
        TorchRankGroup.create(0, 2, init_method, timeout_s=1.0)
    except RankGroupError as exc:
        return str(exc)
    return "joined"
