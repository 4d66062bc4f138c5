"""SGLang's Python RadixCache on the tree benchmark workload (run by bench_tree.py).

Runs in an interpreter that has sglang installed; drives only SGLang's public cache API and
prints one JSON line. Not part of the package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from array import array
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_workload import make_sequences


class _Allocator:
    """The cache frees evicted slots here; we only count them."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free(self, idx) -> None:
        self.freed += len(idx)

    def free_segment(self, idx, start_pos=0) -> None:
        self.freed += len(idx) - start_pos


def main() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=20_000)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--evict-calls", type=int, default=100)
    ap.add_argument("--events", action="store_true")
    args = ap.parse_args()
    seqs = make_sequences(args.num)
    alloc = _Allocator()
    cache = RadixCache(CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
        page_size=args.page_size, enable_kv_cache_events=args.events, kv_event_lora_names=None,
    ))
    width = seqs.shape[1]
    aligned = width - width % args.page_size
    keys = [RadixKey(array("q", s[:aligned].tolist())) for s in seqs]
    slots = torch.arange(len(seqs) * width, dtype=torch.int64)
    values = [slots[i * width : i * width + aligned] for i in range(len(seqs))]

    t0 = time.perf_counter()
    for k, v in zip(keys, values, strict=True):
        cache.insert(InsertParams(key=k, value=v))
        if args.events:
            cache.take_events()
    t_insert = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in keys:
        cache.match_prefix(MatchPrefixParams(key=k))
    t_match = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.evict_calls):
        cache.evict(EvictParams(num_tokens=1000))
    t_evict = time.perf_counter() - t0
    print(json.dumps({
        "insert_ops_s": len(keys) / t_insert,
        "match_ops_s": len(keys) / t_match,
        "evict_calls_s": args.evict_calls / t_evict,
        "evicted_tokens": alloc.freed,
    }))


if __name__ == "__main__":
    main()
