#!/usr/bin/env python3
"""Multi-rank agreement: what a tick costs, and what agreement costs a request stream.

Two rank processes (spawn, gloo on 127.0.0.1) measure, interleaved so both see the same machine:

* ``raw_allreduce_us``: a blocking ``dist.all_reduce`` (MIN of a small int64 vector) called
  directly — the machine's own collective latency;
* ``tick_collective_us``: the same collective through ``TorchRankGroup.all_reduce_min`` (queued
  on the group's collective thread, awaited on the loop); ``ratio`` is its median over the raw
  one: the price of never blocking the loop;
* ``thread_hop_us``: a bare ``run_in_executor`` round trip (the loop <-> thread wake-up limit).

Then the same request stream (tests/scale's scenario: shared documents, device/host pressure,
storage prefetches) runs in both processes at once, first with ``SingleRank`` (immediate
commits, no agreement) and then agreed over the 2 ranks — so both runs see the same CPU
contention; ``stream_ratio`` = agreed wall / single-rank wall (slowest rank of each).

Prints one JSON object. ``--quick`` runs a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCENARIOS = ROOT / "tests" / "scale" / "rank_scenarios.py"


def _median_us(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 1)


async def _latencies(group: Any, rounds: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    loop = asyncio.get_running_loop()
    raw, tick, hop = [], [], []
    vec = [3, 1, 4, 1, 5, 9, 2, 6]
    for _ in range(rounds):
        t = torch.tensor(vec, dtype=torch.int64)
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        raw.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await group.all_reduce_min(vec)
        tick.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await loop.run_in_executor(None, int)
        hop.append(time.perf_counter() - t0)
    return {"raw_allreduce_us": _median_us(raw), "tick_collective_us": _median_us(tick),
            "thread_hop_us": _median_us(hop),
            "ratio": round(statistics.median(tick) / statistics.median(raw), 2)}


async def _stream(group: Any, root: str, n: int) -> dict[str, float]:
    sys.path.insert(0, str(SCENARIOS.parent))
    import rank_scenarios as rs

    from asynccache import HierarchicalCache
    from asynccache.l3 import StoragePolicy
    from asynccache.storage.file import FileBackend

    cache = HierarchicalCache(rs._config(), ranks=group)
    await cache.start()
    backend = FileBackend(root, cache.storage_layout())
    await backend.start()
    cache.attach_storage(backend, StoragePolicy(prefetch_threshold=2 * rs.PS))
    t0 = time.perf_counter()
    await rs._serve_stream(cache, rs.request_stream(n), 0)
    await cache.flush()
    await cache.storage.drain()
    wall = time.perf_counter() - t0
    ticks = cache.agreement.ticks if cache.agreement is not None else 0
    await cache.detach_storage()
    await cache.aclose()
    await backend.aclose()
    return {"wall_s": wall, "ticks": ticks}


def bench_rank(rank: int, world: int, init: str, rounds: int, n: int, root: str) -> dict:
    import torch

    from asynccache.ranks import SingleRank, TorchRankGroup

    torch.set_num_threads(1)
    group = TorchRankGroup.create(rank, world, init, timeout_s=60)
    try:
        lat = asyncio.run(_latencies(group, rounds))
        single = asyncio.run(_stream(SingleRank(), f"{root}/single{rank}", n))
        asyncio.run(group.barrier())
        stream = asyncio.run(_stream(group, f"{root}/agreed", n))
    finally:
        group.close()
    return {"latency": lat, "stream": stream, "single": single}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds, n = (300, 40) if args.quick else (2000, 120)
    from asynccache.testing.ranks import check_ranks, run_ranks

    with tempfile.TemporaryDirectory() as root:
        results = check_ranks(run_ranks(Path(__file__), "bench_rank", 2,
                                        args=(rounds, n, root), timeout_s=600))
    agreed = max(r["stream"]["wall_s"] for r in results)
    single = max(r["single"]["wall_s"] for r in results)
    print(json.dumps({
        "ranks": 2,
        "backend": "gloo",
        "collective": results[0]["latency"],
        "stream": {
            "requests": n,
            "agreed_wall_s": round(agreed, 3),
            "ticks": results[0]["stream"]["ticks"],
            "single_rank_wall_s": round(single, 3),
            "stream_ratio": round(agreed / single, 2),
        },
    }, indent=1))


if __name__ == "__main__":
    main()
