#!/usr/bin/env python3
"""Sidecar pools: what riding the KV copies costs.

Three caches of the same KV geometry run the same round trip -- serve a prompt, back it up
(write-through), evict it, load it back layer by layer -- interleaved A B C A B C, medians per
round trip:

* ``kv``: no sidecar;
* ``draft``: a draft model's KV (one layer, same heads / head_dim as the target) and an
  indexer sidecar (one fp32 vector of 16 per token) riding every copy;
* ``kv_wider``: no sidecar, but one more KV layer -- about as many bytes per token as the
  ``draft`` cache moves in all -- the cost of moving the same bytes in the KV pool itself.

Reports per-round medians, bytes per token moved, and the ratios draft / kv and
draft / kv_wider (the overhead of a rider over moving its bytes in the source pool).
Prints one JSON object. ``--quick`` runs a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch

from asynccache import CacheConfig, HierarchicalCache
from asynccache.transfers.sidecars import SidecarSpec


def _config(layers: int, tokens: int) -> CacheConfig:
    return CacheConfig(page_size=16, num_layers=layers, num_heads=8, head_dim=64,
                       dtype="float16", device_tokens=2 * tokens, host_tokens=4 * tokens,
                       write_policy="write_through", load_back_threshold=1)


async def _cache(kind: str, layers: int, tokens: int) -> HierarchicalCache:
    cache = HierarchicalCache(_config(layers + (1 if kind == "kv_wider" else 0), tokens))
    if kind == "draft":
        cache.register_draft_pools(num_layers=1, num_heads=8, head_dim=64)
        cache.register_sidecar_pool(SidecarSpec(name="indexer", token_shape=(16,),
                                                dtype="float32"))
    return await cache.start()


async def _round(cache: HierarchicalCache, prompt: list[int]) -> float:
    """One round trip; returns its wall seconds."""
    t0 = time.perf_counter()
    req = cache.admit(prompt)
    slots = await cache.extend(req, len(prompt))
    cache.cache_finished_req(req)
    await cache.flush()  # the write-through backup landed
    await cache.evict_async(len(slots))
    again = cache.admit(prompt)
    await cache.load_back_request(again)
    assert again.prefix_len == len(prompt), again.prefix_len
    cache.abort_req(again)
    dt = time.perf_counter() - t0
    cache.evict(10**9)
    cache.evict_host(10**9)
    return dt


def _bytes_per_token(cache: HierarchicalCache) -> int:
    return cache.shape.bytes_per_token + sum(s.spec.shape.bytes_per_token for s in cache.sidecars)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    kinds = ("kv", "draft", "kv_wider")
    caches = {k: await _cache(k, args.layers, args.tokens) for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for r in range(args.rounds + 1):
            for k in kinds:
                prompt = list(range(r * args.tokens, (r + 1) * args.tokens))
                dt = await _round(caches[k], prompt)
                if r:  # the first round warms up
                    times[k].append(dt)
        med = {k: statistics.median(v) for k, v in times.items()}
        return {
            "bench": "sidecars",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__},
            "tokens": args.tokens, "layers": args.layers, "rounds": args.rounds,
            "bytes_per_token": {k: _bytes_per_token(c) for k, c in caches.items()},
            "median_round_s": med,
            "ratio_draft_vs_kv": med["draft"] / med["kv"],
            "ratio_draft_vs_kv_wider": med["draft"] / med["kv_wider"],
            "bytes_ratio_draft_vs_kv": _bytes_per_token(caches["draft"])
            / _bytes_per_token(caches["kv"]),
        }
    finally:
        for c in caches.values():
            await c.aclose()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.tokens, a.rounds = 1024, 5
    np.random.seed(0)
    print(json.dumps(asyncio.run(main(a)), indent=2))
