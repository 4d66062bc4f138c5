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
4. Zero-copy kernels: a gather (``index_select``) reading pinned host pages straight over the
   link into device memory, and a scatter (``index_copy_``) writing device pages straight into
   pinned host pages -- one kernel per batch whatever the fragmentation, against the pinned
   ``copy_`` peak, for pages of 64 KiB ... 2 MiB in random order.
5. Where a 48 MiB direct-DMA copy spends its time: a ``torch.profiler`` timeline of the
   engine (CPU threads, CUDA runtime calls, GPU copies and kernels) summarised per copy (the
   lead before the first GPU work, the GPU span and busy time, the tail to the coroutine), and
   the engine's time for 8 ... 192 MiB fitted as fixed cost + bytes / rate.

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

from asynccache.transfers.dma import device_alias
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


def zero_copy(batch_bytes: int, page_bytes: int, reps: int) -> dict[str, Any]:
    words = page_bytes // 8
    n = batch_bytes // page_bytes
    pool_pages = 4 * n
    host = torch.empty(pool_pages, words, dtype=torch.int64)
    host.copy_(torch.arange(pool_pages * words, dtype=torch.int64).view(pool_pages, words))
    register_host_memory(host)
    alias = device_alias(host)
    dev = torch.empty(n, words, dtype=torch.int64, device="cuda")
    pages = torch.from_numpy(np.random.default_rng(2).permutation(pool_pages)[:n].copy())
    idx = pages.cuda()
    flat_dev = dev.view(-1)
    contiguous = host[:n].view(-1)
    gather = lambda: torch.index_select(alias, 0, idx, out=dev)  # noqa: E731
    scatter = lambda: alias.index_copy_(0, idx, dev)  # noqa: E731
    _timed(gather)
    ok_gather = bool(torch.equal(dev.cpu(), host[pages]))
    dev.add_(1)
    _timed(scatter)
    ok_scatter = bool(torch.equal(host[pages], dev.cpu()))
    times: dict[str, list[float]] = {k: [] for k in ("gather", "scatter", "copy_h2d", "copy_d2h")}
    for i in range(reps):
        pairs = [("gather", gather), ("copy_h2d", lambda: flat_dev.copy_(contiguous, non_blocking=True)),
                 ("scatter", scatter), ("copy_d2h", lambda: contiguous.copy_(flat_dev, non_blocking=True))]
        for name, fn in (pairs if i % 2 == 0 else pairs[::-1]):
            times[name].append(_timed(fn))
    gb = {k: batch_bytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return {"page_bytes": page_bytes, "pages": n, "bit_exact": ok_gather and ok_scatter,
            **{f"{k}_GBps": round(v, 2) for k, v in gb.items()},
            "gather_ratio": round(gb["gather"] / gb["copy_h2d"], 3),
            "scatter_ratio": round(gb["scatter"] / gb["copy_d2h"], 3)}


async def timeline(reps: int) -> dict[str, Any]:
    """The profile of direct-DMA copies of 48 MiB (see the module docstring, 5.)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    shape = KVShape(32, 8, 128, "fp16")  # llama3-8b, 2 MiB pages of 16 tokens
    ps = 16
    page = shape.bytes_per_page(ps)
    most = 192 * MIB // page
    dev = DevicePool(shape, 2 * most * ps, ps)
    host = HostPool(shape, 2 * most * ps, ps, layout="page_first")
    out: dict[str, Any] = {}

    def sl(first: int, n: int) -> np.ndarray:
        return np.arange(first * ps, (first + n) * ps)

    async with CopyEngine(dev, host, direct_dma=True) as engine:
        fit: dict[str, list[tuple[int, float]]] = {"d2h": [], "h2d": []}
        for mib in (8, 24, 48, 96, 192):
            n = mib * MIB // page
            for op in ("d2h", "h2d"):
                submit = engine.submit_d2h if op == "d2h" else engine.submit_h2d
                await submit(sl(0, n), sl(most, n))
                ts = []
                for _ in range(reps):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    await submit(sl(0, n), sl(most, n))
                    ts.append(time.perf_counter() - t)
                fit[op].append((n * page, statistics.median(ts)))
        for op, pts in fit.items():
            x = np.array([p[0] for p in pts], dtype=float)
            y = np.array([p[1] for p in pts])
            slope, fixed = np.polyfit(x, y, 1)
            out[f"{op}_fit"] = {"fixed_us": round(fixed * 1e6, 1),
                                "rate_GBps": round(1 / slope / 1e9, 2),
                                "points_ms": [(b // MIB, round(t * 1e3, 3)) for b, t in pts]}
        n = 48 * MIB // page
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(3):
                for op in ("d2h", "h2d"):
                    submit = engine.submit_d2h if op == "d2h" else engine.submit_h2d
                    torch.cuda.synchronize()
                    with record_function(f"probe.{op}.{i}"):
                        await submit(sl(0, n), sl(most, n))
    path = "/tmp/probe_timeline.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    out["trace"] = path
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "kernel",
                                                                         "gpu_memset")]
    rt = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    per = []
    for m in (e for e in events if str(e.get("name", "")).startswith("probe.")):
        a, b = m["ts"], m["ts"] + m["dur"]
        g = sorted((e for e in gpu if a <= e["ts"] <= b), key=lambda e: e["ts"])
        r = sorted((e for e in rt if a <= e["ts"] <= b), key=lambda e: e["ts"])
        if not g:
            per.append({"copy": m["name"], "us": m["dur"], "gpu": 0})
            continue
        per.append({
            "copy": m["name"], "us": round(m["dur"], 1),
            "lead_us": round(g[0]["ts"] - a, 1),
            "first_runtime_call_us": round(r[0]["ts"] - a, 1) if r else None,
            "gpu_span_us": round(g[-1]["ts"] + g[-1]["dur"] - g[0]["ts"], 1),
            "gpu_busy_us": round(sum(e["dur"] for e in g), 1),
            "tail_us": round(b - g[-1]["ts"] - g[-1]["dur"], 1),
            "gpu_ops": [(e["cat"][:6], e["name"][:40], round(e["ts"] - a, 1), round(e["dur"], 1))
                        for e in g][:12],
            "runtime_calls": [(e["name"][:28], e.get("tid"), round(e["ts"] - a, 1),
                               round(e["dur"], 1)) for e in r][:24],
        })
    out["copies"] = per
    return out


async def py_timeline(reps: int, device: str = "cuda") -> dict[str, Any]:
    """Where the engine's threads spend a 48 MiB copy, in Python: the calls of the submit,
    issue and completion paths wrapped with timestamps (no profiler: its own cost per op
    distorts a timeline of ~1 ms), for a contiguous copy of 2 MiB pages (DMA) and a scattered
    one of 192 KiB pages (zero-copy). Per copy: (call, thread, start, duration) in µs from
    the submit."""
    import threading

    from asynccache.transfers import staged, workers
    from asynccache.transfers.bridge import LoopBridge
    from asynccache.transfers.streams import CudaStreams

    records: list[tuple[str, int, float, float]] = []
    undo: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str | None = None) -> None:
        real = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                records.append((label or name, threading.get_ident(), t0, time.perf_counter()))

        undo.append((owner, name, real))
        setattr(owner, name, timed)

    for owner, name in [(CopyEngine, "submit_d2h"), (CopyEngine, "submit_h2d"),
                        (staged.StagedWorker, "_issue"), (staged.StagedWorker, "_issue_direct"),
                        (staged.StagingRing, "acquire"), (staged.StagingRing, "release"),
                        (workers.WorkerBase, "wait_deps"), (workers.WorkerBase, "wait_dev_deps"),
                        (workers.WorkerBase, "finish"), (workers.JobQueue, "next"),
                        (staged, "check_pairs"), (staged, "ring_chunks"),
                        (CudaStreams, "launch"), (LoopBridge, "_drain"),
                        (torch.cuda.Event, "synchronize"), (torch.cuda.Event, "record")]:
        wrap(owner, name)
    out: dict[str, Any] = {}
    try:
        for label, model, ps, scattered in (("dma_2MiB_contiguous", (32, 8, 128, "fp16"), 16,
                                               False),
                                              ("zc_192KiB_random", (24, 2, 64, "bf16"), 16, True)):
            shape = KVShape(*model)  # type: ignore[arg-type]
            page = shape.bytes_per_page(ps)
            n = 48 * MIB // page
            dev = DevicePool(shape, 2 * n * ps, ps, device=device)
            host = HostPool(shape, 2 * n * ps, ps, layout="page_first")
            rng = np.random.default_rng(5)
            pages = rng.permutation(2 * n)[:n] if scattered else np.arange(n)
            sl = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
            async with CopyEngine(dev, host, direct_dma=True, mode="staged") as engine:
                for op in ("d2h", "h2d"):
                    submit = engine.submit_d2h if op == "d2h" else engine.submit_h2d
                    for i in range(reps):
                        if device == "cuda":
                            torch.cuda.synchronize()
                        await asyncio.sleep(0.01)
                        records.clear()
                        t0 = time.perf_counter()
                        await submit(sl, sl)
                        t1 = time.perf_counter()
                        if i == reps - 1:
                            tids: dict[int, str] = {}
                            for r in records:
                                tids.setdefault(r[1], f"t{len(tids)}")
                            out[f"{label}.{op}"] = {
                                "total_us": round((t1 - t0) * 1e6, 1),
                                "calls": [(r[0], tids[r[1]], round((r[2] - t0) * 1e6, 1),
                                           round((r[3] - r[2]) * 1e6, 1))
                                          for r in sorted(records, key=lambda r: r[2])],
                            }
            del dev, host
    finally:
        for owner, name, real in reversed(undo):
            setattr(owner, name, real)
    return out


def blocking() -> dict[str, Any]:
    """How long a raw DMA call takes to return when its stream still waits behind a ~0.2 s
    kernel: 1D and 2D copies, both ways, pinned (registered) host memory. An asynchronous call
    returns in microseconds; one that returns after ~200 ms blocked its thread (and possibly
    the driver) until the stream reached it."""
    from asynccache.transfers.dma import _find_runtime

    lib = _find_runtime()
    if lib is None:
        return {"error": "no CUDA runtime found"}
    nbytes = 8 * MIB
    host = torch.empty(nbytes, dtype=torch.uint8)
    register_host_memory(host)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    out: dict[str, Any] = {}
    hp, dp = host.data_ptr(), dev.data_ptr()
    for name in ("d2h_1d", "d2h_2d", "h2d_1d", "h2d_2d"):
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(300_000_000)
        dst, src = (hp, dp) if name.startswith("d2h") else (dp, hp)
        t = time.perf_counter()
        if name.endswith("1d"):
            rc = lib.cudaMemcpyAsync(dst, src, nbytes // 2, 4, stream.cuda_stream)
        else:  # 4 rows of 1 MiB, 2 MiB apart on both sides
            rc = lib.cudaMemcpy2DAsync(dst, 2 * MIB, src, 2 * MIB, MIB, 4, 4, stream.cuda_stream)
        returned = time.perf_counter() - t
        stream.synchronize()
        out[name] = {"rc": rc, "returned_ms": round(returned * 1e3, 3),
                     "stream_done_ms": round((time.perf_counter() - t) * 1e3, 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", default=None)
    parser.add_argument("--reps", type=int, default=5)
    sections = ("pinned", "chunked", "engine", "zero_copy", "timeline", "py_timeline",
                "blocking")
    parser.add_argument("--only", choices=sections, nargs="*", default=None,
                        help="the sections to run (default: all)")
    args = parser.parse_args()
    only = set(args.only or sections)
    if not torch.cuda.is_available():
        print("probe_dma: needs CUDA", file=sys.stderr)
        sys.exit(2)
    res: dict[str, Any] = {"probe": "dma", "device": torch.cuda.get_device_name(0)}
    runs = {
        "pinned_256MiB_GBps": ("pinned", lambda: pinned_kinds(256 * MIB, args.reps)),
        "chunked_256MiB": ("chunked", lambda: [chunked(256 * MIB, c, args.reps)
                                               for c in (256 << 10, MIB, 4 * MIB, 16 * MIB)]),
        "engine": ("engine", lambda: [asyncio.run(engine_paths(b, args.reps))
                                      for b in (48 * MIB, 512 * MIB)]),
        "zero_copy_48MiB": ("zero_copy", lambda: [zero_copy(48 * MIB, p, args.reps)
                                                  for p in (64 << 10, 256 << 10, 2 * MIB)]),
        "timeline": ("timeline", lambda: asyncio.run(timeline(args.reps))),
        "py_timeline": ("py_timeline", lambda: asyncio.run(py_timeline(args.reps))),
        "blocking": ("blocking", blocking),
    }
    for key, (name, fn) in runs.items():
        if name in only:
            try:
                res[key] = fn()
            except Exception as exc:  # a probe reports what failed and goes on
                res[key] = {"error": repr(exc)}
            print(json.dumps({key: res[key]}), flush=True)
    line = json.dumps(res)
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write(line + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
