"""Cost of the ``arc`` eviction policy against ``lru`` in the tree core (prints JSON).

Workload (scripts/tree_workload.py): sequences of 1,000 tokens sharing 16 system prompts and
256 documents, each served twice in a shuffled order (so nodes are reused and come back after
eviction: ghost hits), the engine's way: match, lock, evict what the new tokens need, insert,
unlock, on a tree holding a quarter of the distinct tokens. Rounds alternate the policies
(A B B A ...): on a shared machine only the ratios within a round mean much.

Reported per policy: evict time per evicted node and per call, insert time per request (arc
hashes each new page for its ghost lists), the whole request loop per request; for arc, the
ghost list sizes at the end and their memory (bytes per key measured with tracemalloc on an
OrderedDict of as many 64-bit keys).

    python scripts/bench_arc.py            # 3,000 sequences, page size 16, 3 rounds
    python scripts/bench_arc.py --quick
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from asynccache.tree import RadixKey, RadixTree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_workload import make_sequences


def serve(policy: str, keys: list[RadixKey], order: list[int], capacity: int,
          page_size: int) -> dict[str, Any]:
    tree = RadixTree(page_size=page_size, eviction_policy=policy, device_tokens=capacity)
    free = list(range(capacity))
    clock = time.perf_counter
    t_evict = t_insert = 0.0
    calls = nodes = 0
    hits = 0
    gc.collect()
    t_all = clock()
    for i in order:
        key = keys[i]
        m = tree.match_prefix(key)
        hits += m.device_prefix_len
        receipt = tree.lock(m.last_device_node)
        need = len(key) - m.device_prefix_len
        if len(free) < need:
            t0 = clock()
            res = tree.evict(need - len(free))
            t_evict += clock() - t0
            calls += 1
            nodes += len(res.device_frees)
            for arr in res.device_frees:
                free.extend(arr.tolist())
        new = np.array([free.pop() for _ in range(need)], dtype=np.int64)
        slots = np.concatenate([m.device_indices, new])
        t0 = clock()
        res2 = tree.insert(key, slots, prev_prefix_len=m.device_prefix_len)
        t_insert += clock() - t0
        for arr in res2.device_frees:
            free.extend(arr.tolist())
        tree.unlock(receipt)
    t_all = clock() - t_all
    out: dict[str, Any] = {
        "policy": policy, "hit_tokens": hits, "evict_calls": calls, "evicted_nodes": nodes,
        "evict_us_per_node": t_evict / max(1, nodes) * 1e6,
        "evict_us_per_call": t_evict / max(1, calls) * 1e6,
        "insert_us": t_insert / len(order) * 1e6,
        "request_us": t_all / len(order) * 1e6,
    }
    if tree._arc is not None:
        out["arc"] = tree._arc.stats()
    return out


def ghost_bytes_per_key(n: int = 100_000) -> float:
    """Bytes per key of an OrderedDict of ``n`` 64-bit int keys (the keys included)."""
    rng = random.Random(0)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    od: OrderedDict[int, None] = OrderedDict()
    for _ in range(n):
        od[rng.getrandbits(64)] = None
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del od
    return size / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num", type=int, default=3000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.num, a.rounds = 600, 2
    seqs = make_sequences(a.num)
    keys = [RadixKey(s) for s in seqs]
    order = list(range(a.num)) * 2
    random.Random(1).shuffle(order)
    distinct = 16 * 200 + 256 * 300 + a.num * 500
    capacity = distinct // 4 // a.page_size * a.page_size
    rounds = []
    for r in range(a.rounds):
        pols = ("lru", "arc") if r % 2 == 0 else ("arc", "lru")
        res = {p: serve(p, keys, order, capacity, a.page_size) for p in pols}
        rounds.append({
            "order": list(pols),
            "lru": res["lru"], "arc": res["arc"],
            "evict_per_node_ratio": res["arc"]["evict_us_per_node"]
            / res["lru"]["evict_us_per_node"],
            "insert_ratio": res["arc"]["insert_us"] / res["lru"]["insert_us"],
            "request_ratio": res["arc"]["request_us"] / res["lru"]["request_us"],
        })
        print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
    bpk = ghost_bytes_per_key()
    last = rounds[-1]["arc"]["arc"]
    ghosts = last["ghost_once"] + last["ghost_reused"]
    report = {
        "num": a.num, "page_size": a.page_size, "capacity_tokens": capacity,
        "capacity_pages": capacity // a.page_size,
        "median": {k: float(np.median([r[k] for r in rounds]))
                   for k in ("evict_per_node_ratio", "insert_ratio", "request_ratio")},
        "ghost_keys": ghosts, "ghost_bytes_per_key": round(bpk, 1),
        "ghost_bytes": int(ghosts * bpk),
        "ghost_bytes_max": int(2 * 2 * (capacity // a.page_size) * bpk),
        "rounds": rounds,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
