"""Benchmark of the tree core: insert, match and evict throughput (prints JSON).

Workload (scripts/tree_workload.py): 20,000 sequences of 1,000 tokens sharing 16 system prompts
and 256 documents. Phases: insert all, match all (all full hits), evict in 1,000-token calls with
the tree full. Page sizes 1 and 16; page hashing + KV events off (default) and on.

With ``--sglang-python PY`` it also runs SGLang's Python RadixCache on the same workload in that
interpreter (which must have sglang installed) and reports our throughput as a ratio to it.
Targets: insert and match >= 2x SGLang; eviction >= 3,000 calls/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_workload import make_sequences

from asynccache.tree import RadixKey, RadixTree


def run_ours(seqs: np.ndarray, page_size: int, hashing: bool, evict_calls: int) -> dict:
    tree = RadixTree(
        page_size=page_size, enable_kv_events=hashing, enable_page_hashes=hashing
    )
    keys = [RadixKey(s) for s in seqs]
    n = len(keys)
    width = seqs.shape[1]
    slots = np.arange(n * width, dtype=np.int64)
    values = [slots[i * width : (i + 1) * width] for i in range(n)]
    gc.collect()  # start every configuration from the same heap state

    t0 = time.perf_counter()
    for k, v in zip(keys, values, strict=True):
        tree.insert(k, v)
        if hashing:
            tree.take_events()
    t_insert = time.perf_counter() - t0

    t0 = time.perf_counter()
    hits = 0
    for k in keys:
        hits += tree.match_prefix(k).device_prefix_len
    t_match = time.perf_counter() - t0
    aligned = width - width % page_size
    assert hits == n * aligned, (hits, n * aligned)

    t0 = time.perf_counter()
    evicted = 0
    for _ in range(evict_calls):
        evicted += tree.evict(1000).num_evicted
        if hashing:
            tree.take_events()
    t_evict = time.perf_counter() - t0
    return {
        "insert_ops_s": n / t_insert,
        "match_ops_s": n / t_match,
        "evict_calls_s": evict_calls / t_evict,
        "evicted_tokens": evicted,
    }


def run_sglang(python: str, num: int, page_size: int, hashing: bool, evict_calls: int) -> dict:
    script = Path(__file__).resolve().parent / "bench_sglang_tree.py"
    out = subprocess.run(
        [python, str(script), "--num", str(num), "--page-size", str(page_size),
         "--evict-calls", str(evict_calls)] + (["--events"] if hashing else []),
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num", type=int, default=20_000)
    ap.add_argument("--evict-calls", type=int, default=2000)
    ap.add_argument("--sglang-python", help="interpreter with sglang installed, for the side-by-side")
    ap.add_argument("--sglang-evict-calls", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="2,000 sequences, fewer evict calls")
    args = ap.parse_args()
    if args.quick:
        args.num, args.evict_calls, args.sglang_evict_calls = 2000, 300, 30
    seqs = make_sequences(args.num)
    report: dict = {"benchmark": "tree", "sequences": args.num, "tokens_per_sequence": 1000,
                    "targets": {"insert_vs_sglang": 2.0, "match_vs_sglang": 2.0,
                                "evict_calls_s": 3000}, "runs": []}
    for page_size in (1, 16):
        for hashing in (False, True):
            row = {"page_size": page_size, "hashes_and_events": hashing}
            row["asynccache"] = run_ours(seqs, page_size, hashing, args.evict_calls)
            row["evict_ratio_to_target"] = row["asynccache"]["evict_calls_s"] / 3000
            if args.sglang_python:
                sg = run_sglang(args.sglang_python, args.num, page_size, hashing,
                                args.sglang_evict_calls)
                row["sglang"] = sg
                row["insert_ratio_vs_sglang"] = row["asynccache"]["insert_ops_s"] / sg["insert_ops_s"]
                row["match_ratio_vs_sglang"] = row["asynccache"]["match_ops_s"] / sg["match_ops_s"]
                row["evict_ratio_vs_sglang"] = (
                    row["asynccache"]["evict_calls_s"] / sg["evict_calls_s"]
                )
            report["runs"].append(row)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
