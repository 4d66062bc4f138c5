"""Run every benchmark and write one JSON report with each figure's ratio to its limit.

    python scripts/bench_all.py [--quick] [--out report.json] [--sglang-python PY]

Each benchmark runs as its own process (so one failing does not stop the others) and prints JSON;
the report keeps their full output plus a summary of the headline ratios and targets.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run(script: str, args: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True,
                          text=True)
    out: dict[str, Any] = {"script": script, "wall_s": round(time.perf_counter() - t0, 2),
                           "exit_code": proc.returncode}
    if proc.returncode == 0:
        try:
            out["result"] = json.loads(proc.stdout)
        except json.JSONDecodeError:
            out["error"] = "output is not JSON"
    else:
        out["error"] = proc.stderr.strip().splitlines()[-1:] or ["failed"]
    return out


def summarize(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(name: str, value: Any, target: Any, higher_is_better: bool = True) -> None:
        if value is None:
            return
        met = value >= target if higher_is_better else value <= target
        rows.append({"figure": name, "value": value, "target": target, "met": met})

    tree = results.get("tree", {}).get("result")
    if tree:
        for r in tree["runs"]:
            tag = f"page{r['page_size']}{'+hash' if r['hashes_and_events'] else ''}"
            add(f"tree evict calls/s ({tag}) / 3000", r["evict_ratio_to_target"], 1.0)
            if "insert_ratio_vs_sglang" in r:
                add(f"tree insert vs SGLang ({tag})", r["insert_ratio_vs_sglang"], 2.0)
                add(f"tree match vs SGLang ({tag})", r["match_ratio_vs_sglang"], 2.0)
    cache = results.get("cache", {}).get("result")
    if cache:
        add("cache bytes/s vs raw copy", cache["ratio_to_raw_copy"], 0.7)
        if "ratio_to_raw_copy_same_footprint" in cache:
            add("cache bytes/s vs raw copy over the pools' footprint",
                cache["ratio_to_raw_copy_same_footprint"], 0.7)
    transfers = results.get("transfers", {}).get("result")
    if transfers and "lanes" in transfers:
        add("transfers: layer-wise load behind a backup, separate lanes / one lane",
            transfers["lanes"]["load_latency_ratio"], 1.0, higher_is_better=False)
    replay = results.get("replay", {}).get("result")
    if replay:
        add("replay fraction of the infinite-cache bound",
            replay["hit_rate"]["fraction_of_bound"], 0.0)
    for name in ("transfers", "bridge", "storage"):
        res = results.get(name, {}).get("result")
        if res and isinstance(res.get("summary"), dict):
            for k, v in res["summary"].items():
                if isinstance(v, int | float):
                    rows.append({"figure": f"{name}: {k}", "value": v})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench_report.json")
    ap.add_argument("--sglang-python")
    args = ap.parse_args()
    quick = ["--quick"] if args.quick else []
    tree_args = quick + (["--sglang-python", args.sglang_python] if args.sglang_python else [])
    results = {
        "tree": run("bench_tree.py", tree_args),
        "transfers": run("bench_transfers.py", [*quick, "--lanes"]),
        "bridge": run("bench_bridge.py", quick),
        "cache": run("bench_cache.py", quick),
        "storage": run("bench_storage.py", quick),
    }
    replay_cmd = [sys.executable, "-m", "asynccache.cli", "replay", "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(replay_cmd, capture_output=True, text=True)
    results["replay"] = {"script": "asynccache replay", "exit_code": proc.returncode,
                         "wall_s": round(time.perf_counter() - t0, 2)}
    if proc.returncode == 0:
        results["replay"]["result"] = json.loads(proc.stdout)
    report = {"quick": args.quick, "summary": summarize(results), "benchmarks": results}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"summary": report["summary"], "out": args.out}, indent=1))


if __name__ == "__main__":
    main()
