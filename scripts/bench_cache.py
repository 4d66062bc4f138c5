"""Benchmark of the cache engine: insert -> backup -> evict -> load_back round trips (JSON).

Each round trip admits a fresh sequence, computes it (allocates slots), caches it with
write-through (D->H backup), evicts it from the device (demotion), then admits it again and loads
it back (H->D). Reports round trips per second and the bytes moved per second as a ratio to a
plain contiguous ``copy_`` of the same bytes measured in the same run (target >= 0.7: the
engine adds little over the copies themselves).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from asynccache import CacheConfig, HierarchicalCache


def raw_copy_bps(nbytes: int, repeats: int) -> float:
    """Median throughput of a plain contiguous ``copy_`` of ``nbytes`` (the limit we compare to)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


async def run(args: argparse.Namespace) -> dict:
    cfg = CacheConfig(
        page_size=args.page_size, num_layers=args.layers, num_heads=args.heads,
        head_dim=args.head_dim, dtype="float16", device_tokens=args.seq_tokens * 2,
        host_tokens=args.seq_tokens * 4, write_policy="write_through",
    )
    seq_bytes = 0
    async with HierarchicalCache(cfg) as cache:
        seq_bytes = cache.shape.bytes_per_token * args.seq_tokens
        moved = 0
        t0 = time.perf_counter()
        for i in range(args.rounds):
            tokens = [(i * args.seq_tokens + j) % 30000 + 1 for j in range(args.seq_tokens)]
            tokens[0] = 40000 + i  # a fresh prefix every round
            req = cache.admit(tokens)
            await cache.extend(req, args.seq_tokens)
            cache.cache_finished_req(req)
            await cache.flush()  # D->H backup done
            await cache.evict_async(cache.evictable_size)
            req = cache.admit(tokens)
            loaded = await cache.load_back_request(req)
            assert loaded == args.seq_tokens, loaded
            cache.cache_finished_req(req)
            moved += 2 * seq_bytes
        elapsed = time.perf_counter() - t0
        cache.sanity_check()
    raw = raw_copy_bps(seq_bytes, 20)
    bps = moved / elapsed
    return {
        "benchmark": "cache",
        "kv_bytes_per_token": seq_bytes // args.seq_tokens,
        "sequence_tokens": args.seq_tokens,
        "rounds": args.rounds,
        "round_trips_s": args.rounds / elapsed,
        "bytes_moved_s": bps,
        "raw_copy_bytes_s": raw,
        "ratio_to_raw_copy": bps / raw,
        "target_ratio": 0.7,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--seq-tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 8
    print(json.dumps(asyncio.run(run(args)), indent=1))


if __name__ == "__main__":
    main()
