#!/usr/bin/env python3
"""LoopBridge: completions per second to awaiting coroutines, and added latency per await.

Throughput: ``tasks`` coroutines each await a fresh bridge future per round; a worker thread
completes every round's futures, in batches of ``B`` per ``complete_many`` call. Compared with
the bare way: one ``loop.call_soon_threadsafe(fut.set_result, ...)`` per completion.

Latency: a ping-pong between one coroutine and one worker thread blocked on a queue. The
coroutine hands the worker a future and awaits it; the worker completes it either bare
(``call_soon_threadsafe(fut.set_result)``), through the bridge, or through the bridge with the
engine's cancellation-safe handle await (``asyncio.shield``). Round trips are interleaved so
all three see the same machine; medians are reported with their ratio to the bare round trip.

Event latency (``--events``): the same ping-pong where the worker is the copy engine's
completer: the coroutine records a blocking-sync event on a stream (CUDA; on the CPU a
completed one), the thread waits for it (``synchronize()``) and posts through the bridge; and
the whole engine path, a one-page ``submit_h2d`` awaited (submit -> issuer -> copy stream ->
event -> completer -> bridge -> coroutine). Both as medians against the bare round trip
(target: the event path <= 2x).

Hand-off (``--handoff``): bursts of 1, 8 and 32 one-page copies submitted in one loop
iteration and awaited together, through the engine as it is (the iteration's first copy handed
to the worker at once, the rest as one batch at the iteration's end) and with a hand-off per
submit (the engine's flush called after each submit, as before batching); per copy wall time,
the loop's time per submit call and the batched / per-submit ratio, interleaved.

Prints one JSON object (``--jsonl PATH`` also appends each section as one JSON line as it is
measured). ``--quick`` runs a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asynccache.transfers.bridge import LoopBridge
from asynccache.transfers.handles import Awaitable

TARGET_COMPLETIONS_PER_S = 200_000
TARGET_LATENCY_RATIO = 2.0


async def throughput(how: str, batch: int, tasks: int, rounds: int) -> dict[str, Any]:
    """Completions/s delivered to ``tasks`` coroutines awaiting one future at a time."""
    loop = asyncio.get_running_loop()
    bridge = LoopBridge()
    work: queue.SimpleQueue[list[asyncio.Future[Any]] | None] = queue.SimpleQueue()
    registered: list[asyncio.Future[Any]] = []
    all_registered = asyncio.Event()

    def worker() -> None:
        while (futs := work.get()) is not None:
            if how == "bare":
                for f in futs:
                    loop.call_soon_threadsafe(_set, f)
            else:
                for i in range(0, len(futs), batch):
                    bridge.complete_many((f, None, None) for f in futs[i : i + batch])

    async def waiter() -> None:
        for _ in range(rounds):
            fut = bridge.create_future()
            registered.append(fut)
            if len(registered) == tasks:
                all_registered.set()
            await fut

    thread = threading.Thread(target=worker, name="bench-bridge-worker")
    thread.start()
    hops0 = bridge.hops
    start = time.perf_counter()
    running = [asyncio.create_task(waiter()) for _ in range(tasks)]
    for _ in range(rounds):
        await all_registered.wait()
        all_registered.clear()
        futs = registered[:]
        registered.clear()
        work.put(futs)
    await asyncio.gather(*running)
    elapsed = time.perf_counter() - start
    work.put(None)
    thread.join()
    bridge.close()
    n = tasks * rounds
    return {
        "how": how,
        "batch": batch if how == "bridge" else 1,
        "completions": n,
        "completions_per_s": round(n / elapsed),
        "thread_hops": (bridge.hops - hops0) if how == "bridge" else n,
    }


def _set(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(None)


async def latency(samples: int) -> dict[str, Any]:
    """Median round trip coroutine -> worker thread -> awaiting coroutine, three ways."""
    loop = asyncio.get_running_loop()
    bridge = LoopBridge()
    requests: queue.SimpleQueue[tuple[Callable[[], None]] | None] = queue.SimpleQueue()

    def worker() -> None:
        while (req := requests.get()) is not None:
            req[0]()

    thread = threading.Thread(target=worker, name="bench-bridge-pingpong")
    thread.start()
    times: dict[str, list[float]] = {"bare": [], "bridge": [], "bridge_handle": []}

    async def one(how: str) -> None:
        if how == "bare":
            fut: asyncio.Future[Any] = loop.create_future()
            action: Callable[[], None] = lambda: loop.call_soon_threadsafe(_set, fut)  # noqa: E731
            awaitable: Any = fut
        else:
            fut = bridge.create_future()
            action = lambda: bridge.set_result(fut, None)  # noqa: E731
            awaitable = fut if how == "bridge" else Awaitable(fut)
        t = time.perf_counter()
        requests.put((action,))
        await awaitable
        times[how].append(time.perf_counter() - t)

    for _ in range(50):  # warm-up
        await one("bare")
        await one("bridge")
    for h in times.values():
        h.clear()
    for i in range(samples):
        for how in (
            ("bare", "bridge", "bridge_handle") if i % 2 else ("bridge_handle", "bridge", "bare")
        ):
            await one(how)
    requests.put(None)
    thread.join()
    bridge.close()
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return {
        "samples": samples,
        "bare_call_soon_threadsafe_us": round(med["bare"], 1),
        "bridge_us": round(med["bridge"], 1),
        "bridge_handle_us": round(med["bridge_handle"], 1),
        "bridge_ratio": round(med["bridge"] / med["bare"], 3),
        "bridge_handle_ratio": round(med["bridge_handle"] / med["bare"], 3),
        "bridge_added_us": round(med["bridge"] - med["bare"], 1),
    }


async def event_latency(samples: int, device: str) -> dict[str, Any]:
    """Median round trips: bare, CUDA event -> completer thread -> bridge, one-page copy."""
    import numpy as np
    import torch

    from asynccache.transfers.engine import CopyEngine
    from asynccache.transfers.pools import DevicePool, HostPool, KVShape
    from asynccache.transfers.streams import CudaStreams, HostStreams

    dev_t = torch.device(device)
    cuda = dev_t.type == "cuda"
    streams = CudaStreams(dev_t) if cuda else HostStreams()
    stream = streams.new_stream()
    loop = asyncio.get_running_loop()
    bridge = LoopBridge()
    requests: queue.SimpleQueue[tuple[Callable[[], None]] | None] = queue.SimpleQueue()

    def worker() -> None:
        try:
            streams.thread_init()
            while (req := requests.get()) is not None:
                req[0]()
        except BaseException:  # fail the run loudly instead of leaving a coroutine waiting
            loop.call_soon_threadsafe(loop.stop)
            raise

    thread = threading.Thread(target=worker, name="bench-bridge-completer")
    thread.start()
    shape = KVShape(2, 2, 64, "fp16")
    pool_dev = DevicePool(shape, 64, 16, device=dev_t)
    pool_host = HostPool(shape, 64, 16)
    page = np.arange(16)
    times: dict[str, list[float]] = {"bare": [], "event": [], "engine": []}
    async with CopyEngine(pool_dev, pool_host) as engine:

        async def one(how: str) -> None:
            t = time.perf_counter()
            if how == "engine":
                await engine.submit_h2d(page, page)
            elif how == "bare":
                fut: asyncio.Future[Any] = loop.create_future()
                requests.put((lambda: loop.call_soon_threadsafe(_set, fut),))
                await fut
            else:
                fut = bridge.create_future()
                ev = streams.event()
                ev.record(stream)

                def wait_and_post(ev: Any = ev, fut: asyncio.Future[Any] = fut) -> None:
                    ev.synchronize()
                    bridge.set_result(fut, None)

                requests.put((wait_and_post,))
                await Awaitable(fut)
            times[how].append(time.perf_counter() - t)

        for _ in range(50):  # warm-up
            for how in times:
                await one(how)
        for h in times.values():
            h.clear()
        for i in range(samples):
            for how in (("bare", "event", "engine") if i % 2 else ("engine", "event", "bare")):
                await one(how)
    requests.put(None)
    thread.join()
    bridge.close()
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return {
        "device": str(dev_t),
        "samples": samples,
        "bare_call_soon_threadsafe_us": round(med["bare"], 1),
        "event_to_coroutine_us": round(med["event"], 1),
        "engine_one_page_copy_us": round(med["engine"], 1),
        "event_ratio": round(med["event"] / med["bare"], 3),
        "engine_ratio": round(med["engine"] / med["bare"], 3),
        "meets_event_target": med["event"] / med["bare"] <= TARGET_LATENCY_RATIO,
    }


async def handoff(samples: int, bursts: tuple[int, ...] = (1, 8, 32)) -> dict[str, Any]:
    """The copy engine's hand-off: ``k`` one-page ``submit_h2d`` calls made back to back in one
    loop iteration, then awaited together. ``batched``: as the engine does it (the iteration's
    copies reach the worker as one batch, one wake-up); ``per_submit``: each copy handed over
    as it is submitted (the engine's flush called after every submit: the hand-off before
    batching). Reports the median wall time per copy and the submitting loop's own time per
    submit, per burst size and way, all interleaved so every case sees the same machine."""
    import numpy as np

    from asynccache.transfers.engine import CopyEngine
    from asynccache.transfers.pools import DevicePool, HostPool, KVShape

    shape = KVShape(2, 2, 64, "fp16")
    kmax = max(bursts)
    pool_dev = DevicePool(shape, 16 * kmax, 16, device="cpu")
    pool_host = HostPool(shape, 16 * kmax, 16)
    pages = [np.arange(16 * i, 16 * (i + 1)) for i in range(kmax)]
    ways = ("batched", "per_submit")
    per_copy: dict[tuple[str, int], list[float]] = {(w, k): [] for w in ways for k in bursts}
    submit: dict[tuple[str, int], list[float]] = {(w, k): [] for w in ways for k in bursts}
    async with CopyEngine(pool_dev, pool_host) as engine:

        async def one(way: str, k: int) -> None:
            t = time.perf_counter()
            futs = []
            for i in range(k):
                futs.append(engine.submit_h2d(pages[i], pages[i]))
                if way == "per_submit":
                    engine._flush()
            t_sub = time.perf_counter() - t
            for f in futs:
                await f
            per_copy[way, k].append((time.perf_counter() - t) / k)
            submit[way, k].append(t_sub / k)

        cases = [(w, k) for k in bursts for w in ways]
        for _ in range(20):  # warm-up
            for c in cases:
                await one(*c)
        for v in (*per_copy.values(), *submit.values()):
            v.clear()
        for i in range(samples):
            for c in (cases if i % 2 else cases[::-1]):
                await one(*c)

    def med(d: dict[tuple[str, int], list[float]], way: str) -> dict[str, float]:
        return {str(k): round(statistics.median(d[way, k]) * 1e6, 1) for k in bursts}

    return {
        "samples": samples,
        "per_copy_us": {w: med(per_copy, w) for w in ways},
        "submit_call_us": {w: med(submit, w) for w in ways},
        "per_copy_ratio_batched_vs_per_submit": {
            str(k): round(statistics.median(per_copy["batched", k])
                          / statistics.median(per_copy["per_submit", k]), 3)
            for k in bursts
        },
    }


async def run(quick: bool) -> dict[str, Any]:
    tasks = 500 if quick else 1000
    rounds = 20 if quick else 100
    tp = [await throughput("bare", 1, tasks, rounds)]
    for batch in (1, 64, tasks):
        tp.append(await throughput("bridge", batch, tasks, rounds))
    lat = await latency(300 if quick else 2000)
    best = max(r["completions_per_s"] for r in tp if r["how"] == "bridge")
    return {
        "throughput": tp,
        "latency": lat,
        "summary": {
            "bridge_completions_per_s": best,
            "bare_completions_per_s": tp[0]["completions_per_s"],
            "speedup_vs_bare": round(best / tp[0]["completions_per_s"], 2),
            "meets_throughput_target": best >= TARGET_COMPLETIONS_PER_S,
            "median_latency_ratio": lat["bridge_ratio"],
            "meets_latency_target": lat["bridge_ratio"] <= TARGET_LATENCY_RATIO,
            "targets": {
                "completions_per_s": TARGET_COMPLETIONS_PER_S,
                "latency_ratio": TARGET_LATENCY_RATIO,
            },
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds instead of ~20")
    parser.add_argument("--events", action="store_true",
                        help="only the event-to-coroutine latency (see the module docstring)")
    parser.add_argument("--device", default="auto", help="--events: auto, cpu, cuda[:N]")
    parser.add_argument("--handoff", action="store_true",
                        help="only the copy engine's hand-off cost (one-page copies in bursts)")
    parser.add_argument("--jsonl", default=None, help="append each section to this file")
    args = parser.parse_args()
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    if args.events:
        import torch

        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        result = {"events": asyncio.run(event_latency(300 if args.quick else 2000, device))}
    elif args.handoff:
        result = {"handoff": asyncio.run(handoff(300 if args.quick else 2000))}
    else:
        result = asyncio.run(run(args.quick))
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            for key, value in result.items():
                f.write(json.dumps({key: value}) + "\n")
    out = {
        "benchmark": "bench_bridge",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_1m_at_start": round(load, 2),
        },
        "quick": args.quick,
        **result,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
