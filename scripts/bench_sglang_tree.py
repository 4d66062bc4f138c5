#!/usr/bin/env python
"""asynccache's RadixTree against SGLang's Python RadixCache on the tree workload, one process.

The workload is scripts/tree_workload.py's (20,000 sequences of 1,000 tokens by default). Per
page size, ``--rounds`` rounds alternate the two sides (A B A B; each round builds fresh trees):
insert every sequence, match every sequence (all full hits: both sides' hit lengths are
checked equal), then ``--evict-calls`` calls that evict 1,000 tokens each, the same number of
calls on both sides (the evicted token counts are reported). Each insert and match builds its
key from the sequence's ``--key-form`` (``array_q``: ``array('q')``, ``list``: a list of ints)
inside the timed region, as an engine holding its token ids that way would. Values (KV slot
indices) are prebuilt in each side's own type (numpy for asynccache, torch for SGLang).

Reported per side: medians over rounds (with min and max) of the per-call p50 / p99 / max
latencies of insert, match and evict, the first evict call separately (it pays for building
the eviction order) and the evict stats over the other calls, plus the Python heap the tree
holds after the inserts (tracemalloc, in an untimed pass). Ratios are asynccache / SGLang
latency per round, medians over rounds (< 1: asynccache faster); memory ratio likewise.

SGLang's radix tree reaches its vision configs, which import torchvision at module level; it
is imported under asynccache's stand-in for it (asynccache.integrations.sglang_import_guard).
Needs sglang (scripts/install_sglang_cpu.sh). ``--quick``: 2,000 sequences, 3 rounds.

``--page-size N`` (with ``--num``, ``--evict-calls``, ``--events``) runs SGLang's side alone the
way ``bench_tree.py --sglang-python`` calls this script: prebuilt keys, whole-phase throughput,
one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tree_workload import make_sequences

from asynccache.integrations.sglang_import_guard import missing_package_stand_in
from asynccache.tree import RadixKey, RadixTree

with missing_package_stand_in():
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.radix_cache import RadixKey as SgKey

EVICT_TOKENS = 1000


class _Allocator:
    """SGLang's cache frees evicted slots here; we count them."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free(self, idx: Any) -> None:
        self.freed += len(idx)

    def free_segment(self, idx: Any, start_pos: int = 0) -> None:
        self.freed += len(idx) - start_pos


class Side:
    """One tree behind the three timed calls."""

    name: str
    freed: int

    def insert(self, i: int) -> None: ...
    def match(self, i: int) -> int: ...
    def evict(self) -> None: ...


class Ours(Side):
    name = "asynccache"

    def __init__(self, src: list, values: list, page_size: int) -> None:
        self.tree = RadixTree(page_size=page_size)
        self.src, self.values, self.freed = src, values, 0

    def insert(self, i: int) -> None:
        self.tree.insert(RadixKey(self.src[i]), self.values[i])

    def match(self, i: int) -> int:
        return int(self.tree.match_prefix(RadixKey(self.src[i])).device_prefix_len)

    def evict(self) -> None:
        self.freed += self.tree.evict(EVICT_TOKENS).num_evicted


class Sglang(Side):
    name = "sglang"

    def __init__(self, src: list, values: list, page_size: int) -> None:
        self.alloc = _Allocator()
        self.cache = RadixCache(CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc,
            page_size=page_size, enable_kv_cache_events=False, kv_event_lora_names=None))
        self.src, self.values = src, values

    @property  # type: ignore[override]
    def freed(self) -> int:
        return self.alloc.freed

    def insert(self, i: int) -> None:
        self.cache.insert(InsertParams(key=SgKey(self.src[i]), value=self.values[i]))

    def match(self, i: int) -> int:
        return int(self.cache.match_prefix(MatchPrefixParams(key=SgKey(self.src[i]))).device_prefix_len)

    def evict(self) -> None:
        self.cache.evict(EvictParams(num_tokens=EVICT_TOKENS))


def _stats(us: list[float]) -> dict[str, float]:
    a = np.array(us)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max())}


def run_round(side: Side, n: int, aligned: int, evict_calls: int) -> dict[str, Any]:
    gc.collect()
    clock = time.perf_counter
    lat: dict[str, list[float]] = {"insert": [], "match": [], "evict": []}
    for i in range(n):
        t0 = clock()
        side.insert(i)
        lat["insert"].append((clock() - t0) * 1e6)
    hits = 0
    for i in range(n):
        t0 = clock()
        hits += side.match(i)
        lat["match"].append((clock() - t0) * 1e6)
    assert hits == n * aligned, (side.name, hits, n * aligned)
    for _ in range(evict_calls):
        t0 = clock()
        side.evict()
        lat["evict"].append((clock() - t0) * 1e6)
    out: dict[str, Any] = {f"{ph}_us": _stats(lat[ph]) for ph in ("insert", "match")}
    out["evict_first_call_us"] = lat["evict"][0]
    out["evict_us"] = _stats(lat["evict"][1:])
    out["evicted_tokens"] = side.freed
    return out


def heap_bytes(make: Callable[[], Side], n: int) -> int:
    """Python heap held by a tree after all inserts (untimed)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    side = make()
    for i in range(n):
        side.insert(i)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del side
    return held


def _med(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
            "max": round(max(xs), 3)}


def bench_page(seqs: np.ndarray, page_size: int, rounds: int, evict_calls: int,
               key_form: str) -> dict[str, Any]:
    n, width = seqs.shape
    aligned = width - width % page_size
    rows = [s[:aligned] for s in seqs]
    src = [r.tolist() for r in rows] if key_form == "list" else [array("q", r.tolist()) for r in rows]
    ours_values = [np.arange(i * width, i * width + aligned, dtype=np.int64) for i in range(n)]
    slots = torch.arange(n * width, dtype=torch.int64)
    sg_values = [slots[i * width : i * width + aligned] for i in range(n)]
    makers: dict[str, Callable[[], Side]] = {
        "asynccache": lambda: Ours(src, ours_values, page_size),
        "sglang": lambda: Sglang(src, sg_values, page_size),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in makers}
    for _ in range(rounds):
        for name, make in makers.items():  # A B A B
            runs[name].append(run_round(make(), n, aligned, evict_calls))
    out: dict[str, Any] = {"page_size": page_size, "sides": {}, "ratio_asynccache_to_sglang": {}}
    for name, rs in runs.items():
        side: dict[str, Any] = {}
        for ph in ("insert", "match", "evict"):
            for q in ("p50", "p99", "max"):
                side[f"{ph}_{q}_us"] = _med([r[f"{ph}_us"][q] for r in rs])
        side["evict_first_call_us"] = _med([r["evict_first_call_us"] for r in rs])
        side["evicted_tokens"] = rs[0]["evicted_tokens"]
        out["sides"][name] = side
    ratios = out["ratio_asynccache_to_sglang"]
    for ph in ("insert", "match", "evict"):
        for q in ("p50", "p99", "max"):
            ratios[f"{ph}_{q}"] = _med([a[f"{ph}_us"][q] / b[f"{ph}_us"][q] for a, b in
                                        zip(runs["asynccache"], runs["sglang"], strict=True)])
    ratios["evict_first_call"] = _med([a["evict_first_call_us"] / b["evict_first_call_us"] for a, b
                                       in zip(runs["asynccache"], runs["sglang"], strict=True)])
    mem = {name: heap_bytes(make, n) for name, make in makers.items()}
    out["heap_bytes_after_inserts"] = mem
    ratios["heap_bytes"] = round(mem["asynccache"] / mem["sglang"], 3)
    return out


def sglang_only(num: int, page_size: int, evict_calls: int, events: bool) -> dict[str, Any]:
    """SGLang's RadixCache alone (bench_tree.py's comparator): throughput per phase."""
    seqs = make_sequences(num)
    alloc = _Allocator()
    cache = RadixCache(CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
        page_size=page_size, enable_kv_cache_events=events, kv_event_lora_names=None))
    width = seqs.shape[1]
    aligned = width - width % page_size
    keys = [SgKey(array("q", s[:aligned].tolist())) for s in seqs]
    slots = torch.arange(len(seqs) * width, dtype=torch.int64)
    values = [slots[i * width : i * width + aligned] for i in range(len(seqs))]
    t0 = time.perf_counter()
    for k, v in zip(keys, values, strict=True):
        cache.insert(InsertParams(key=k, value=v))
        if events:
            cache.take_events()
    t_insert = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in keys:
        cache.match_prefix(MatchPrefixParams(key=k))
    t_match = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(evict_calls):
        cache.evict(EvictParams(num_tokens=EVICT_TOKENS))
    t_evict = time.perf_counter() - t0
    return {"insert_ops_s": len(keys) / t_insert, "match_ops_s": len(keys) / t_match,
            "evict_calls_s": evict_calls / t_evict, "evicted_tokens": alloc.freed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num", type=int, default=20_000)
    ap.add_argument("--page-size", type=int, default=None,
                    help="SGLang's side alone at this page size (bench_tree.py's comparator)")
    ap.add_argument("--events", action="store_true", help="(with --page-size) KV events on")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--evict-calls", type=int, default=200)
    ap.add_argument("--key-form", choices=("array_q", "list"), default="array_q")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.page_size is not None:
        print(json.dumps(sglang_only(a.num, a.page_size, a.evict_calls, a.events)))
        return
    if a.quick:
        a.num, a.rounds, a.evict_calls = 2000, 3, 50
    if a.rounds < 1 or a.evict_calls < 2:
        ap.error(f"--rounds >= 1 and --evict-calls >= 2, got {a.rounds}, {a.evict_calls}")
    seqs = make_sequences(a.num)
    report: dict[str, Any] = {
        "benchmark": "tree_vs_sglang_radix_cache", "sequences": a.num,
        "tokens_per_sequence": int(seqs.shape[1]), "rounds": a.rounds,
        "evict_calls": a.evict_calls, "evict_tokens_per_call": EVICT_TOKENS,
        "key_form": a.key_form, "pages": []}
    for ps in (int(x) for x in a.page_sizes.split(",")):
        report["pages"].append(bench_page(seqs, ps, a.rounds, a.evict_calls, a.key_form))
    report["loadavg_1m"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
