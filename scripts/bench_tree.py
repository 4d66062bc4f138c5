"""Benchmark of the tree core: insert, match and evict throughput (prints JSON).

Workload (scripts/tree_workload.py): 20,000 sequences of 1,000 tokens sharing 16 system prompts
and 256 documents. Phases: insert all, match all (all full hits), evict in 1,000-token calls with
the tree full. Page sizes 1 and 16; page hashing + KV events off (default) and on.

With ``--sglang-python PY`` it also runs SGLang's Python RadixCache on the same workload in that
interpreter (which must have sglang installed) and reports our throughput as a ratio to it.
Targets: insert and match >= 2x SGLang; eviction >= 3,000 calls/s.

Key forms (``keys`` in the report; ``--no-keys`` skips them): building a key from what engines
hold (a Python list, ``array('q')`` as SGLang keeps it, numpy int32 / int64, a torch tensor),
in microseconds per 1,000 tokens (median of rounds), and insert / match throughput with the key
built from a list or an ``array('q')`` inside the timed region, as a ratio to prebuilt keys
(the same 2,000 sequences, the forms in turns, A B A B).

Hybrid configurations (``hybrid`` in the report; ``--no-hybrid`` skips them): the same workload
on FULL+SWA (window 512), FULL+Mamba and FULL+SWA+Mamba trees, every insert carrying a Mamba
state (its SWA data is named by its FULL slots). Each of ``--repeat`` rounds runs FULL-only
and the three hybrids back to back, in an order rotated per round (no configuration always runs
first or last).
``slowdown_vs_full_<phase>`` is FULL-only's best rate divided by the hybrid's best rate (target:
<= 1.5): on a shared machine interference only slows a round down, so a configuration's fastest
round is the closest to the cost of its code. ``..._median`` is the median over rounds of the
ratio within a round, and ``..._range`` its lowest and highest round. ``..._paired`` comes from
a separate pass with all four trees side by side, each phase taken in turns of 500 inserts or
matches (100 evict calls) per configuration: the median over turns of the ratio within a turn,
the steadiest of these figures on a shared machine, whose interference outlasts a turn.

EAGLE (``eagle`` in the report; ``--no-eagle`` skips it, ``--eagle-only`` runs only it): the same
workload on an EAGLE tree (bigram keys: 999 bigrams per sequence) beside a token tree, in paired
turns as above (500 inserts or matches, 100 evict calls per tree and turn, the order alternating
A B A B), with prebuilt keys: ``<phase>_ratio_vs_plain`` is the median over turns of the EAGLE
tree's time over the token tree's (target: <= 1.2). ``key_build_ratio_vs_plain``: building a
BigramKey against a RadixKey from the same numpy int64 array (median of interleaved rounds);
``insert_raw_ratio_vs_plain`` / ``match_raw_ratio_vs_plain``: the tree given raw token arrays
(each builds its key inside the call, the EAGLE tree its bigram view).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from array import array
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_workload import make_sequences

from asynccache.tree import BigramKey, RadixKey, RadixTree, TreeConfig


def inserts(seqs: np.ndarray, mamba: bool) -> tuple[list, list, list[dict]]:
    """Keys, FULL slots and the component arguments of each insert: a Mamba state with
    ``mamba`` (SWA takes no argument: the tree names SWA data by the FULL slots)."""
    n, width = seqs.shape
    keys = [RadixKey(s) for s in seqs]
    slots = np.arange(n * width, dtype=np.int64)
    values = [slots[i * width : (i + 1) * width] for i in range(n)]
    kwargs: list[dict] = [{} for _ in range(n)]
    if mamba:
        for i in range(n):
            kwargs[i]["mamba_value"] = i
    return keys, values, kwargs


def run_ours(
    seqs: np.ndarray,
    page_size: int,
    hashing: bool,
    evict_calls: int,
    window: int = 0,
    mamba: bool = False,
) -> dict:
    tree = RadixTree(
        page_size=page_size, enable_kv_events=hashing, enable_page_hashes=hashing,
        sliding_window=window, mamba=mamba,
    )
    keys, values, kwargs = inserts(seqs, mamba)
    n = len(keys)
    width = seqs.shape[1]
    gc.collect()  # start every configuration from the same heap state

    clock = time.perf_counter
    lat: dict[str, list[float]] = {"insert": [], "match": [], "evict": []}
    for k, v, kw in zip(keys, values, kwargs, strict=True):
        t0 = clock()
        tree.insert(k, v, **kw)
        if hashing:
            tree.take_events()
        lat["insert"].append(clock() - t0)

    hits = 0
    for k in keys:  # every leaf is touched: the evict calls below come right after
        t0 = clock()
        hits += tree.match_prefix(k).device_prefix_len
        lat["match"].append(clock() - t0)
    aligned = width - width % page_size
    assert hits == n * aligned, (hits, n * aligned)

    evicted = 0
    for _ in range(evict_calls):
        t0 = clock()
        evicted += tree.evict(1000).num_evicted
        if hashing:
            tree.take_events()
        lat["evict"].append(clock() - t0)
    out = {
        "insert_ops_s": n / sum(lat["insert"]),
        "match_ops_s": n / sum(lat["match"]),
        "evict_calls_s": evict_calls / sum(lat["evict"]),
        "evicted_tokens": evicted,
        "evict_first_call_us": lat["evict"][0] * 1e6,
    }
    for phase, ts in lat.items():  # per call (each evict call frees 1,000 tokens)
        us = np.array(ts) * 1e6
        out[f"{phase}_p50_us"] = float(np.percentile(us, 50))
        out[f"{phase}_p99_us"] = float(np.percentile(us, 99))
        out[f"{phase}_max_us"] = float(us.max())
    return out


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
    ap.add_argument("--no-hybrid", action="store_true", help="skip the SWA / Mamba configurations")
    ap.add_argument("--repeat", type=int, default=5, help="hybrid comparison: rounds")
    ap.add_argument("--no-keys", action="store_true", help="skip the key-form timings")
    ap.add_argument("--no-eagle", action="store_true", help="skip the EAGLE (bigram) comparison")
    ap.add_argument("--eagle-only", action="store_true", help="run only the EAGLE comparison")
    args = ap.parse_args()
    if args.quick:
        args.num, args.evict_calls, args.sglang_evict_calls = 2000, 300, 30
    seqs = make_sequences(args.num)
    report: dict = {"benchmark": "tree", "sequences": args.num, "tokens_per_sequence": 1000,
                    "targets": {"insert_vs_sglang": 2.0, "match_vs_sglang": 2.0,
                                "evict_calls_s": 3000, "eagle_vs_plain": 1.2}, "runs": []}
    if args.eagle_only:
        report["eagle"] = run_eagle(seqs, args.evict_calls, args.repeat)
        print(json.dumps(report, indent=1))
        return
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
    if not args.no_keys:
        report["keys"] = run_key_forms(seqs[:2000], args.repeat)
    if not args.no_hybrid:
        report["hybrid"] = run_hybrid(seqs, args.evict_calls, args.repeat)
    if not args.no_eagle:
        report["eagle"] = run_eagle(seqs, args.evict_calls, args.repeat)
    print(json.dumps(report, indent=1))


def run_eagle(seqs: np.ndarray, evict_calls: int, repeat: int) -> list[dict]:
    """An EAGLE tree beside a token tree on the same sequences (see the module docstring)."""
    keys = {"plain": [RadixKey(s) for s in seqs], "eagle": [BigramKey(s) for s in seqs]}
    rows = []
    for page_size in (1, 16):
        row: dict = {"page_size": page_size}
        row.update(_eagle_paired(keys, seqs.shape[1], page_size, evict_calls))
        row.update(_eagle_raw_ratios(seqs[:2000], page_size, repeat))
        rows.append(row)
    return rows


def _eagle_paired(keys: dict[str, list], width: int, page_size: int,
                  evict_calls: int) -> dict:
    """Insert, match and evict on both trees in alternating turns; per phase, the median over
    turns of the EAGLE tree's time over the token tree's."""
    n = len(keys["plain"])
    trees = {"plain": RadixTree(page_size=page_size),
             "eagle": RadixTree(TreeConfig(page_size=page_size, eagle=True))}
    values = {name: [np.arange(i * width, i * width + len(keys[name][i]), dtype=np.int64)
                     for i in range(n)] for name in trees}
    hits = dict.fromkeys(trees, 0)
    times: dict[str, dict[str, list[float]]] = {
        name: {"insert": [], "match": [], "evict": []} for name in trees}
    gc.collect()
    for phase, count, size in (("insert", n, PAIRED_CHUNK), ("match", n, PAIRED_CHUNK),
                               ("evict", evict_calls, PAIRED_EVICT_CHUNK)):
        for turn, lo in enumerate(range(0, count, size)):
            hi = min(lo + size, count)
            for name in (("plain", "eagle") if turn % 2 == 0 else ("eagle", "plain")):
                tree, ks, vs = trees[name], keys[name], values[name]
                t0 = time.perf_counter()
                if phase == "insert":
                    for i in range(lo, hi):
                        tree.insert(ks[i], vs[i])
                elif phase == "match":
                    for i in range(lo, hi):
                        hits[name] += tree.match_prefix(ks[i]).device_prefix_len
                else:
                    for _ in range(lo, hi):
                        tree.evict(1000)
                times[name][phase].append(time.perf_counter() - t0)
    assert hits["plain"] == n * (width - width % page_size), hits
    assert hits["eagle"] == n * ((width - 1) - (width - 1) % page_size), hits
    out: dict = {}
    for ph in ("insert", "match", "evict"):
        ratios = [e / p for e, p in zip(times["eagle"][ph], times["plain"][ph], strict=True)]
        out[f"{ph}_ratio_vs_plain"] = float(np.median(ratios))
        out[f"{ph}_ratio_range"] = [float(min(ratios)), float(max(ratios))]
    return out


def _eagle_raw_ratios(seqs: np.ndarray, page_size: int, repeat: int) -> dict:
    """Key building, and insert / match given raw token arrays, EAGLE over token trees,
    interleaved rounds (A B A B), medians of the per-round ratios."""
    n, width = seqs.shape
    build: dict[str, list[float]] = {"plain": [], "eagle": []}
    rates: dict[str, dict[str, list[float]]] = {
        name: {"insert": [], "match": []} for name in build}
    values = [np.arange(i * width, (i + 1) * width, dtype=np.int64) for i in range(n)]
    for r in range(repeat):
        for name in (("plain", "eagle") if r % 2 == 0 else ("eagle", "plain")):
            make = BigramKey if name == "eagle" else RadixKey
            t0 = time.perf_counter()
            for s in seqs:
                make(s)
            build[name].append(time.perf_counter() - t0)
            tree = RadixTree(TreeConfig(page_size=page_size, eagle=name == "eagle"))
            t0 = time.perf_counter()
            for i in range(n):
                tree.insert(seqs[i], values[i])  # (EAGLE: N + 1 slots, the last one ours)
            rates[name]["insert"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in range(n):
                tree.match_prefix(seqs[i])
            rates[name]["match"].append(time.perf_counter() - t0)
    out = {"key_build_ratio_vs_plain": float(np.median(
        [e / p for e, p in zip(build["eagle"], build["plain"], strict=True)]))}
    out["key_build_us_per_1000_tokens"] = {
        name: float(np.median(v)) / n * 1e6 * 1000 / width for name, v in build.items()}
    for ph in ("insert", "match"):
        out[f"{ph}_raw_ratio_vs_plain"] = float(np.median(
            [e / p for e, p in zip(rates["eagle"][ph], rates["plain"][ph], strict=True)]))
    return out


def run_key_forms(seqs: np.ndarray, repeat: int) -> dict:
    """Key construction per input form, and insert / match with the key built in the timed
    region (list, array('q')) against prebuilt keys, in rotated turns."""
    import torch

    n, width = seqs.shape
    forms = {
        "list": [s.tolist() for s in seqs],
        "array_q": [array("q", s.tolist()) for s in seqs],
        "numpy_int32": [s.astype(np.int32) for s in seqs],
        "numpy_int64": [s.astype(np.int64) for s in seqs],
        "torch_int64": [torch.from_numpy(s.astype(np.int64)) for s in seqs],
    }
    build: dict[str, list[float]] = {name: [] for name in forms}
    for r in range(repeat):
        names = list(forms)
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            for s in forms[name]:
                RadixKey(s)
            build[name].append((time.perf_counter() - t0) / n * 1e6 * 1000 / width)
    out: dict = {"sequences": n, "build_us_per_1000_tokens": {
        name: float(np.median(v)) for name, v in build.items()}}
    prebuilt = [RadixKey(s) for s in seqs]
    values = [np.arange(i * width, (i + 1) * width, dtype=np.int64) for i in range(n)]
    modes = {"prebuilt": prebuilt, "list": forms["list"], "array_q": forms["array_q"]}
    rates: dict[str, dict[str, list[float]]] = {m: {"insert": [], "match": []} for m in modes}
    for r in range(repeat):
        names = list(modes)
        k = r % len(names)
        for mode in names[k:] + names[:k]:
            src = modes[mode]
            tree = RadixTree(page_size=1)
            t0 = time.perf_counter()
            for i in range(n):
                tree.insert(src[i] if mode == "prebuilt" else RadixKey(src[i]), values[i])
            rates[mode]["insert"].append(n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for i in range(n):
                tree.match_prefix(src[i] if mode == "prebuilt" else RadixKey(src[i]))
            rates[mode]["match"].append(n / (time.perf_counter() - t0))
    for mode in modes:
        for ph in ("insert", "match"):
            out[f"{ph}_ops_s_key_{mode}"] = float(np.median(rates[mode][ph]))
    for mode in ("list", "array_q"):
        for ph in ("insert", "match"):
            out[f"{ph}_key_{mode}_vs_prebuilt"] = float(np.median(
                [a / b for a, b in zip(rates[mode][ph], rates["prebuilt"][ph], strict=True)]))
    return out


HYBRIDS = (("full", 0, False), ("full+swa", 512, False), ("full+mamba", 0, True),
           ("full+swa+mamba", 512, True))
PHASES = ("insert_ops_s", "match_ops_s", "evict_calls_s")


def run_hybrid(seqs: np.ndarray, evict_calls: int, repeat: int) -> list[dict]:
    """``repeat`` rounds of every configuration, the order rotated each round; rates are each
    configuration's best round (see the module docstring)."""
    rows = []
    for page_size in (1, 16):
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in HYBRIDS}
        for r in range(repeat):
            k = r % len(HYBRIDS)
            for name, window, mamba in HYBRIDS[k:] + HYBRIDS[:k]:
                runs[name].append(run_ours(seqs, page_size, False, evict_calls, window, mamba))
        for name, window, mamba in HYBRIDS:
            row: dict = {"page_size": page_size, "config": name, "window": window,
                         "mamba": mamba}
            for ph in PHASES:
                rates = [x[ph] for x in runs[name]]
                row[ph] = max(rates)
                ratios = [f[ph] / x[ph] for f, x in zip(runs["full"], runs[name], strict=True)]
                tag = "slowdown_vs_full_" + ph.split("_")[0]
                row[tag] = max(x[ph] for x in runs["full"]) / max(rates)
                row[tag + "_median"] = float(np.median(ratios))
                row[tag + "_range"] = [min(ratios), max(ratios)]
            rows.append(row)
        paired = run_paired(seqs, page_size, evict_calls)
        for row in rows[-len(HYBRIDS):]:
            for ph in PHASES:
                tag = "slowdown_vs_full_" + ph.split("_")[0]
                row[tag + "_paired"] = paired[row["config"]][tag]
    return rows


PAIRED_CHUNK = 500  # inserts or matches per configuration and turn
PAIRED_EVICT_CHUNK = 100  # evict calls per configuration and turn


def run_paired(seqs: np.ndarray, page_size: int, evict_calls: int) -> dict[str, dict[str, float]]:
    """The four configurations side by side: each phase in turns of one chunk per configuration,
    the order rotated per turn. Interference on a shared machine outlasts a turn, so it slows
    the configurations of a turn alike, and the median over turns of (hybrid time / FULL-only
    time) is steadier than a ratio of whole runs. (The four trees share one heap, so the
    collector's full collections land in a few turns; the median leaves them out.)"""
    names = [name for name, _, _ in HYBRIDS]
    trees = {
        name: RadixTree(page_size=page_size, sliding_window=window, mamba=mamba)
        for name, window, mamba in HYBRIDS
    }
    work = {name: inserts(seqs, mamba) for name, _, mamba in HYBRIDS}
    times: dict[str, dict[str, list[float]]] = {name: {ph: [] for ph in PHASES} for name in names}

    def turns(phase: str, count: int, size: int, step) -> None:
        for turn, lo in enumerate(range(0, count, size)):
            hi = min(lo + size, count)
            k = turn % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                step(trees[name], work[name], lo, hi)
                times[name][phase].append(time.perf_counter() - t0)

    def insert(tree: RadixTree, w: tuple, lo: int, hi: int) -> None:
        keys, values, kwargs = w
        for i in range(lo, hi):
            tree.insert(keys[i], values[i], **kwargs[i])

    def match(tree: RadixTree, w: tuple, lo: int, hi: int) -> None:
        keys = w[0]
        for i in range(lo, hi):
            tree.match_prefix(keys[i])

    def evict(tree: RadixTree, w: tuple, lo: int, hi: int) -> None:
        for _ in range(lo, hi):
            tree.evict(1000)

    gc.collect()
    turns("insert_ops_s", len(seqs), PAIRED_CHUNK, insert)
    turns("match_ops_s", len(seqs), PAIRED_CHUNK, match)
    turns("evict_calls_s", evict_calls, PAIRED_EVICT_CHUNK, evict)
    out: dict[str, dict[str, float]] = {}
    for name in names:
        out[name] = {}
        for ph in PHASES:
            ratios = [x / f for x, f in zip(times[name][ph], times["full"][ph], strict=True)]
            out[name]["slowdown_vs_full_" + ph.split("_")[0]] = float(np.median(ratios))
    return out


if __name__ == "__main__":
    main()
