"""Where the direct-DMA copy path loses against the pinned peak (CUDA only).

Three questions, each answered by interleaved timings (A B A B, medians) in one run:

1. Is host memory pinned by ``cudaHostRegister`` (how asynccache pins its pools: exactly their
   bytes) as fast for DMA as torch's ``pin_memory=True`` (``cudaHostAlloc``, rounded up to a
   power of two)? One contiguous copy of 256 MiB each way.
2. What does one DMA cost when issued from Python as asynccache issues them (a ``copy_`` of a
   slice per run of pages)? 256 MiB moved as copies of 256 KiB ... 16 MiB.
3. The copy engine on a page_first pool (llama3-8b, 2 MiB pages), whole copies of 48 MiB and
   512 MiB, direct DMA against the CPU staging path: the fixed cost per copy against the
   per-byte rate.

    python scripts/probe_dma.py [--jsonl PATH]      # prints one JSON object; needs CUDA
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.pools import DevicePool, HostPool, KVShape, register_host_memory

MIB = 1 << 20


def _timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def pinned_kinds(nbytes: int, reps: int) -> dict[str, Any]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    alloc = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    reg = torch.empty(nbytes, dtype=torch.uint8)
    reg.fill_(1)
    register_host_memory(reg)
    hosts = {"cudaHostAlloc": alloc, "cudaHostRegister": reg}
    times: dict[str, list[float]] = {f"{k} {op}": [] for k in hosts for op in ("d2h", "h2d")}
    for i in range(reps + 1):
        for name in (list(hosts) if i % 2 else list(reversed(hosts))):
            h = hosts[name]
            d2h = _timed(lambda h=h: h.copy_(dev, non_blocking=True))
            h2d = _timed(lambda h=h: dev.copy_(h, non_blocking=True))
            if i:  # the first round warms up
                times[f"{name} d2h"].append(d2h)
                times[f"{name} h2d"].append(h2d)
    return {k: round(nbytes / statistics.median(v) / 1e9, 2) for k, v in times.items()}


def chunked(nbytes: int, chunk: int, reps: int) -> dict[str, Any]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(1)
    register_host_memory(host)
    n = nbytes // chunk
    order = np.random.default_rng(0).permutation(n).tolist()  # scattered, as pages are
    stream = torch.cuda.Stream()

    def d2h() -> None:
        with torch.cuda.stream(stream):
            for i, j in enumerate(order):
                host[j * chunk : (j + 1) * chunk].copy_(dev[i * chunk : (i + 1) * chunk],
                                                        non_blocking=True)

    def issue_only() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        d2h()
        t = time.perf_counter() - t
        torch.cuda.synchronize()
        return t

    whole = [_timed(lambda: host.copy_(dev, non_blocking=True)) for _ in range(reps)]
    parts = [_timed(d2h) for _ in range(reps)]
    issue = [issue_only() for _ in range(reps)]
    return {"chunk_bytes": chunk, "copies": n,
            "whole_GBps": round(nbytes / statistics.median(whole) / 1e9, 2),
            "chunked_GBps": round(nbytes / statistics.median(parts) / 1e9, 2),
            "issue_us_per_copy": round(statistics.median(issue) / n * 1e6, 2)}


async def engine_paths(batch_bytes: int, reps: int) -> dict[str, Any]:
    shape = KVShape(32, 8, 128, "fp16")  # llama3-8b
    ps = 16  # 2 MiB pages
    n = batch_bytes // shape.bytes_per_page(ps)
    dev = DevicePool(shape, 2 * n * ps, ps)
    out: dict[str, Any] = {"batch_bytes": batch_bytes, "pages": n}
    rng = np.random.default_rng(1)
    src = (rng.permutation(2 * n)[:n][:, None] * ps + np.arange(ps)).reshape(-1)
    dst = (rng.permutation(2 * n)[:n][:, None] * ps + np.arange(ps)).reshape(-1)
    for direct in (True, False):
        host = HostPool(shape, 2 * n * ps, ps, layout="page_first")
        async with CopyEngine(dev, host, direct_dma=direct) as engine:
            for op in ("d2h", "h2d"):
                submit = engine.submit_d2h if op == "d2h" else engine.submit_h2d
                ts = []
                for _ in range(reps + 1):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    await submit(src, dst)
                    ts.append(time.perf_counter() - t)
                out[f"{'dma' if direct else 'staging'} {op} GBps"] = round(
                    batch_bytes / statistics.median(ts[1:]) / 1e9, 2)
        del host
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", default=None)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_dma: needs CUDA", file=sys.stderr)
        sys.exit(2)
    res: dict[str, Any] = {"probe": "dma", "device": torch.cuda.get_device_name(0)}
    res["pinned_256MiB_GBps"] = pinned_kinds(256 * MIB, args.reps)
    res["chunked_256MiB"] = [chunked(256 * MIB, c, args.reps)
                             for c in (256 << 10, MIB, 4 * MIB, 16 * MIB)]
    res["engine"] = [asyncio.run(engine_paths(b, args.reps)) for b in (48 * MIB, 512 * MIB)]
    line = json.dumps(res)
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write(line + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
