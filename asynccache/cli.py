"""The ``asynccache`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import numpy as np

from asynccache.tree import RadixKey, RadixTree


def _demo(args: argparse.Namespace) -> int:
    """Replay a seeded synthetic multi-turn workload through the tree core with a device budget."""
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, 32000, size=int(rng.integers(100, 400))) for _ in range(8)]
    tree = RadixTree(page_size=args.page_size, eviction_policy=args.eviction_policy)
    free = list(range(args.capacity))[::-1]
    convs: list[np.ndarray] = []
    asked = reused = 0
    t0 = time.perf_counter()
    for _ in range(args.requests):
        if convs and rng.random() < 0.6:
            i = int(rng.integers(len(convs)))
            seq = np.concatenate([convs[i], rng.integers(0, 32000, size=int(rng.integers(20, 200)))])
            convs[i] = seq
        else:
            seq = np.concatenate([prompts[int(rng.integers(len(prompts)))],
                                  rng.integers(0, 32000, size=int(rng.integers(50, 400)))])
            convs.append(seq)
        key = RadixKey(seq)
        hit = tree.match_prefix(key)
        lock = tree.lock(hit.last_device_node)
        need = len(seq) - hit.device_prefix_len
        if need > len(free):
            for slots in tree.evict(need - len(free)).device_frees:
                free.extend(slots.tolist())
        tree.unlock(lock)
        if need > len(free):
            continue  # the request does not fit even after eviction
        new = [free.pop() for _ in range(need)]
        value = np.concatenate([hit.device_indices, np.asarray(new, dtype=np.int64)])
        res = tree.insert(key, value, prev_prefix_len=hit.device_prefix_len)
        for slots in res.device_frees:
            free.extend(slots.tolist())
        tail = len(seq) - res.cached_len
        if tail:
            free.extend(value[res.cached_len:].tolist())
        asked += len(seq)
        reused += hit.device_prefix_len
    tree.sanity_check()
    report = {
        "requests": args.requests,
        "capacity_tokens": args.capacity,
        "page_size": args.page_size,
        "eviction_policy": args.eviction_policy,
        "prompt_tokens": asked,
        "reused_tokens": reused,
        "hit_rate": round(reused / asked, 4) if asked else 0.0,
        "cached_tokens": tree.device_size,
        "nodes": tree.node_count,
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    if args.json:
        print(json.dumps(report))
    else:
        width = max(len(k) for k in report)
        for k, v in report.items():
            print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynccache", description="Hierarchical prefix KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="replay a small synthetic workload through the tree core")
    demo.add_argument("--requests", type=int, default=2000)
    demo.add_argument("--capacity", type=int, default=50_000, help="device capacity in tokens")
    demo.add_argument("--page-size", type=int, default=16)
    demo.add_argument("--eviction-policy", default="lru")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as exc:  # a clean one-line error for the command line
        from asynccache.errors import AsyncCacheError

        if isinstance(exc, AsyncCacheError):
            print(f"asynccache: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    raise SystemExit(main())
