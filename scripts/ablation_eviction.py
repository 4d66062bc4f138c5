"""Eviction-policy ablation: block hit rate of every eviction policy against LRU and the offline
optimum (Belady at the same capacity), per trace and L1 capacity, through the real replay engine.

Reads the shared traces from ``../shared/traces`` (or ``--traces``) and never copies them; a
trace that is absent is skipped with a line saying so. Every run is the real engine (device
pool, radix tree, allocator) with 1-element KV, L1 only, no verification (hit rates do not
depend on the KV shape). The optimum comes from the same replay (``ReplayStats``).

    python scripts/ablation_eviction.py                    # the tables of docs/eviction.md
    python scripts/ablation_eviction.py --quick            # the first 2,000 requests of each
    python scripts/ablation_eviction.py --json out.json    # also the raw figures
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asynccache import CacheConfig
from asynccache.replay.driver import Replayer, ReplayOptions
from asynccache.replay.formats import TraceRequest, read_kvtester, read_mooncake
from asynccache.tree import POLICIES

DEFAULT_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


@dataclass(frozen=True)
class TraceSpec:
    name: str
    kind: str  # "mooncake" | "kvtester"
    path: str
    page_size: int
    capacities: tuple[int, ...]  # L1 capacities in blocks (pages)
    limit: int | None = None


def trace_specs(root: Path, quick: bool, archive: bool = False) -> list[TraceSpec]:
    mc = root / "mooncake"
    kv = root / "kv-cache-tester"
    lim = 2000 if quick else None
    return [
        TraceSpec("mooncake conversation", "mooncake", str(mc / "conversation_trace.jsonl"), 512,
                  (1000, 10_000, 50_000), lim),
        TraceSpec("mooncake synthetic", "mooncake", str(mc / "synthetic_trace.jsonl"), 512,
                  (1000, 10_000, 50_000), lim),
        # The three sample conversations beside the archive (24 requests, 15,230 blocks of 64
        # tokens, the longest prompt 1,019 blocks: L1 must hold it). The archive itself (49k
        # requests, 94M blocks) takes minutes a replay here; pass --archive for its first 2,000.
        TraceSpec("kv-cache-tester samples", "kvtester", str(kv / "trace_00*.json"), 64,
                  (1100, 2000, 4000)),
    ] + ([TraceSpec("kv-cache-tester archive (first 2,000 requests)", "kvtester",
                    str(kv / "traces.tar.xz"), 64, (16_384, 65_536, 262_144), 2000)]
         if archive else [])


def read(spec: TraceSpec) -> Iterator[TraceRequest]:
    it = (read_mooncake(spec.path) if spec.kind == "mooncake"
          else read_kvtester(sorted(glob.glob(spec.path))))
    for i, tr in enumerate(it):
        if spec.limit is not None and i >= spec.limit:
            return
        yield tr


def run_one(spec: TraceSpec, capacity: int, policy: str) -> dict[str, Any]:
    name = policy
    if policy.startswith("arc:"):  # a variant of arc, e.g. arc:ghosts=1:start=0.25
        from asynccache.tree import arc

        for kv in policy.split(":")[1:]:
            k, v = kv.split("=")
            setattr(arc, k.upper(), float(v))
        policy = "arc"
    config = CacheConfig(page_size=spec.page_size, num_layers=1, num_heads=1, head_dim=1,
                         dtype="float16", device_tokens=capacity * spec.page_size,
                         host_tokens=0, eviction_policy=policy, device="cpu")
    t0 = time.perf_counter()
    stats = asyncio.run(Replayer(config, ReplayOptions(verify="none")).run(read(spec)))
    pages = stats.prompt_pages or 1
    return {"trace": spec.name, "capacity": capacity, "policy": name,
            "hit_blocks": stats.device_hit_pages, "prompt_blocks": stats.prompt_pages,
            "hit_rate": stats.device_hit_pages / pages,
            "optimum": stats.optimum_hit_pages / pages,
            "infinite": stats.bound_hit_pages / pages,
            "rejected": stats.rejected, "wall_s": round(time.perf_counter() - t0, 1)}


def table(rows: list[dict[str, Any]], policies: list[str]) -> str:
    by = {(r["trace"], r["capacity"], r["policy"]): r for r in rows}
    out: list[str] = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        caps = sorted({r["capacity"] for r in rows if r["trace"] == trace})
        out.append(f"### {trace}\n")
        head = "| policy | " + " | ".join(f"{c:,} blocks" for c in caps) + " |"
        out += [head, "|---|" + "---:|" * len(caps)]
        for p in policies:
            cells = []
            for c in caps:
                r, base = by.get((trace, c, p)), by.get((trace, c, "lru"))
                if r is None:
                    cells.append("-")
                    continue
                cell = f"{r['hit_rate']:.4f}"
                if base is not None and p != "lru" and base["hit_rate"]:
                    cell += f" ({r['hit_rate'] / base['hit_rate'] - 1:+.1%})"
                cells.append(cell)
            out.append(f"| {p} | " + " | ".join(cells) + " |")
        first = [by.get((trace, c, policies[0])) for c in caps]
        for label, key in (("**optimum (Belady)**", "optimum"), ("infinite cache", "infinite")):
            cells = []
            for c, r in zip(caps, first, strict=True):
                base = by.get((trace, c, "lru"))
                cell = "-" if r is None else f"{r[key]:.4f}"
                if r is not None and base is not None and base["hit_rate"]:
                    cell += f" ({r[key] / base['hit_rate'] - 1:+.1%})"
                cells.append(cell)
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES,
                    help="the shared traces folder (default: ../shared/traces)")
    ap.add_argument("--policies", default=",".join(["lru", *sorted(set(POLICIES) - {"lru"})]),
                    help="comma-separated eviction policies (lru first: the baseline); "
                         "arc:ghosts=G:start=S runs arc with ghost lists of G x capacity and p "
                         "starting at S x capacity (defaults 2 and 0.5)")
    ap.add_argument("--quick", action="store_true",
                    help="the first 2,000 requests of each trace only")
    ap.add_argument("--archive", action="store_true",
                    help="also the kv-cache-tester archive's first 2,000 requests (slow)")
    ap.add_argument("--jobs", type=int, default=2, help="replays run at once (processes)")
    ap.add_argument("--json", type=Path, default=None,
                    help="append each run's figures here as it finishes (JSON lines)")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="print the tables of the runs recorded in this file; run nothing")
    a = ap.parse_args(argv)
    policies = [p for p in a.policies.split(",") if p]
    if "lru" not in policies:
        policies.insert(0, "lru")
    if a.from_json:
        rows = [json.loads(line) for line in a.from_json.read_text().splitlines() if line]
        print(table(rows, [p for p in policies if any(r["policy"] == p for r in rows)]))
        return 0
    specs = []
    for spec in trace_specs(a.traces, a.quick, a.archive):
        if not glob.glob(spec.path):
            print(f"skipped {spec.name}: {spec.path} is absent", file=sys.stderr)
            continue
        specs.append(spec)
    # Policy by policy (lru first), so an interrupted run has whole columns to compare.
    jobs = [(spec, c, p) for p in policies for spec in specs for c in spec.capacities]
    if not jobs:
        print("no traces found: nothing to do", file=sys.stderr)
        return 0
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        futs = [ex.submit(run_one, *j) for j in jobs]
        rows = []
        for f in futs:
            rows.append(f.result())
            r = rows[-1]
            if a.json:
                with a.json.open("a") as fh:
                    fh.write(json.dumps(r) + "\n")
            print(f"{r['trace']:<40} {r['capacity']:>7,} {r['policy']:<11} "
                  f"{r['hit_rate']:.4f} (optimum {r['optimum']:.4f}) {r['wall_s']} s",
                  file=sys.stderr, flush=True)
    print(table(rows, policies))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
