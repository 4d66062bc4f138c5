"""Benchmark of the cache engine: insert -> backup -> evict -> load_back round trips (JSON).

Each round trip admits a fresh sequence, computes it (allocates slots), caches it with
write-through (D->H backup), evicts it from the device (demotion), then admits it again and loads
it back (H->D, layer by layer). Two yardsticks are timed between the rounds, interleaved, so
both see the same machine:

* ``raw_copy``: the transfers benchmark's baseline, a plain contiguous ``copy_`` of a
  sequence's bytes between two fixed buffers, out and back (on CUDA: pinned host <-> device).
  The issue's target is a ratio to this one: ``ratio_to_raw_copy`` >= 0.7. Timed between
  rounds, its buffers have been pushed out of the CPU caches by the round in between, as the
  pools' pages have.
* ``raw_copy_same_footprint``: the same two ``copy_`` calls per round but between buffers as
  large as the cache's pools, at positions rotating the way the cache's allocations rotate.
* ``raw_copy_two_threads`` (CPU): the fixed buffers copied out and back in halves by this
  thread and a helper thread with numpy, the way the CPU copy engine copies. torch's
  ``copy_`` runs an OpenMP team whose threads spin at a barrier; on a loaded machine a
  descheduled team member stalls the others, so load slows that yardstick far more than the
  engine (ratios of 1.1-1.6 on a busy machine); this one suffers load the way the engine does.

After the rounds, ``raw_copy_cache_resident`` times the fixed buffers copied back to back
(the fastest of 20; the ratio divides it by the median round): cache-resident copies, the ceiling the previous version of this benchmark
divided by. A round trip cannot reach it where the last-level cache holds one sequence but not
the pools (this 2-core VM: ~27 GB/s resident, ~12 GB/s otherwise).

Yardsticks and round trips are paired per round (A B in even rounds, B A in odd ones):
``ratio_per_round`` is each round's yardstick time over its round trip's time and
``ratio_median_per_round`` (the headline) their median; likewise for the same-footprint
yardstick. A load spike then moves one pair, not the whole comparison; a loaded machine still
slows torch's multi-threaded ``copy_`` more than the engine, which is why ``loadavg_1m`` is
printed next to them. Other figures are medians over the rounds (plus min / max); the ``best_`` ratios compare the fastest
round with the fastest yardstick copies, which other tenants' load spikes disturb less.
``copying`` (ms) is the copy worker's own time on a round's two copies (from the engine's
stats: start of the copy to data in place) and ``outside_copies`` the rest of the round
(submission, hand-offs, completions, the cache's own work); ``copy_bytes_s`` is the rate while
copying. ``--quick`` runs a few rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from asynccache import CacheConfig, HierarchicalCache


class RawCopies:
    """The two yardsticks: hot fixed buffers, and pool-sized buffers with rotating positions."""

    def __init__(self, seq_bytes: int, device_seqs: int, host_seqs: int, device: str) -> None:
        self.n = seq_bytes
        self.cuda = device.startswith("cuda")
        pin = self.cuda
        self.hot_host = torch.ones(seq_bytes, dtype=torch.uint8, pin_memory=pin)
        self.hot_dev = torch.zeros(seq_bytes, dtype=torch.uint8, device=device)
        self.dev = torch.zeros(device_seqs * seq_bytes, dtype=torch.uint8, device=device)
        self.host = torch.ones(host_seqs * seq_bytes, dtype=torch.uint8, pin_memory=pin)
        self.device_seqs, self.host_seqs = device_seqs, host_seqs
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="bench-copy-helper")

    def threads(self) -> float:
        """Seconds for one sequence out and back between the fixed buffers, each copy split
        in halves over this thread and a helper thread with numpy (the way the CPU copy engine
        copies: no OpenMP team, so load slows it the way it slows the engine). CPU only."""
        n = self.n
        h = n // 2
        src_dev, src_host = self.hot_dev.numpy(), self.hot_host.numpy()
        t = time.perf_counter()
        for a, b in ((src_host, src_dev), (src_dev, src_host)):
            fut = self._helper.submit(np.copyto, a[h:], b[h:])
            np.copyto(a[:h], b[:h])
            fut.result()
        return time.perf_counter() - t

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def hot(self) -> float:
        """Seconds for one sequence out and back between fixed buffers (2 copies)."""
        t = time.perf_counter()
        self.hot_host.copy_(self.hot_dev, non_blocking=self.cuda)
        self._sync()
        self.hot_dev.copy_(self.hot_host, non_blocking=self.cuda)
        self._sync()
        return time.perf_counter() - t

    def footprint(self, i: int) -> float:
        """Seconds for one sequence out and back, positions rotating over pool-sized buffers."""
        n = self.n
        d0 = (i % self.device_seqs) * n
        d1 = ((i + 1) % self.device_seqs) * n
        h = (i % self.host_seqs) * n
        t = time.perf_counter()
        self.host[h : h + n].copy_(self.dev[d0 : d0 + n], non_blocking=self.cuda)
        self._sync()
        self.dev[d1 : d1 + n].copy_(self.host[h : h + n], non_blocking=self.cuda)
        self._sync()
        return time.perf_counter() - t


def settle() -> None:
    """Let torch's OpenMP threads stop spinning after a parallel ``copy_``.

    Here libgomp's idle workers keep spinning for ~3-5 ms after a parallel region; a round
    started inside that window shares the cores with a spinning thread (measured: a 32 MiB
    D->H right after a ``copy_`` took ~1.3 ms longer, median). Not timed.
    """
    time.sleep(0.01)


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device_seqs, host_seqs = 2, 4
    cfg = CacheConfig(
        page_size=args.page_size, num_layers=args.layers, num_heads=args.heads,
        head_dim=args.head_dim, dtype="float16", device_tokens=args.seq_tokens * device_seqs,
        host_tokens=args.seq_tokens * host_seqs, host_layout=args.host_layout,
        write_policy="write_through", device=args.device,
    )
    rt: list[float] = []
    backup: list[float] = []
    load: list[float] = []
    hot: list[float] = []
    foot: list[float] = []
    thr: list[float] = []
    copying: list[float] = []  # per round: the copy worker's own time on the round's copies
    async with HierarchicalCache(cfg) as cache:
        engine = cache.copy_engine
        assert engine is not None

        def copy_seconds() -> float:
            return sum(st.seconds for st in engine.stats.values())

        seq_bytes = cache.shape.bytes_per_token * args.seq_tokens
        raw = RawCopies(seq_bytes, device_seqs, host_seqs, str(cache.device_pool.device))
        for i in range(args.warmup + args.rounds):
            tokens = [(i * args.seq_tokens + j) % 30000 + 1 for j in range(args.seq_tokens)]
            tokens[0] = 40000 + i  # a fresh prefix every round
            # A B / B A: the yardsticks run before the round trip in odd rounds, after it in
            # even ones, so a load spike is as likely to land on either side of a pair.
            yard_first = i % 2 == 1
            if yard_first:
                h, f = raw.hot(), raw.footprint(i)
                th = raw.threads() if not raw.cuda else h
                settle()
            c0 = copy_seconds()
            t0 = time.perf_counter()
            req = cache.admit(tokens)
            await cache.extend(req, args.seq_tokens)
            cache.cache_finished_req(req)
            await cache.flush()  # D->H backup done
            t1 = time.perf_counter()
            await cache.evict_async(cache.evictable_size)
            req = cache.admit(tokens)
            t2 = time.perf_counter()
            loaded = await cache.load_back_request(req)
            t3 = time.perf_counter()
            assert loaded == args.seq_tokens, loaded
            cache.cache_finished_req(req)
            t4 = time.perf_counter()
            if not yard_first:
                h, f = raw.hot(), raw.footprint(i)
                th = raw.threads() if not raw.cuda else h
            settle()
            if i >= args.warmup:
                rt.append(t4 - t0)
                backup.append(t1 - t0)
                load.append(t3 - t2)
                hot.append(h)
                foot.append(f)
                thr.append(th)
                copying.append(copy_seconds() - c0)
        cache.sanity_check()
    settle()
    resident = [raw.hot() for _ in range(21)][1:]
    # Per round: the yardstick's time over the round trip's, both measured in that round.
    per_round = [h / r for h, r in zip(hot, rt, strict=True)]
    per_round_foot = [f / r for f, r in zip(foot, rt, strict=True)]
    per_round_thr = [x / r for x, r in zip(thr, rt, strict=True)]
    moved = 2 * seq_bytes
    bps = moved / statistics.median(rt)
    hot_bps = moved / statistics.median(hot)
    foot_bps = moved / statistics.median(foot)
    outside = [r - c for r, c in zip(rt, copying, strict=True)]
    ms = {k: {s: round(v * 1e3, 3) for s, v in _stats(xs).items()}
          for k, xs in (("round_trip", rt), ("backup", backup), ("load_back", load),
                        ("copying", copying), ("outside_copies", outside),
                        ("raw_copy", hot), ("raw_copy_same_footprint", foot),
                        ("raw_copy_two_threads", thr),
                        ("raw_copy_cache_resident", resident))}
    return {
        "benchmark": "cache",
        "device": str(cfg.device),
        "host_layout": args.host_layout,
        "kv_bytes_per_token": seq_bytes // args.seq_tokens,
        "sequence_tokens": args.seq_tokens,
        "sequence_bytes": seq_bytes,
        "rounds": args.rounds,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "round_trips_s": round(1 / statistics.median(rt), 1),
        "bytes_moved_s": round(bps),
        "raw_copy_bytes_s": round(hot_bps),
        "raw_copy_same_footprint_bytes_s": round(foot_bps),
        # The headline: median over rounds of the ratio measured within each round.
        "ratio_median_per_round": round(statistics.median(per_round), 3),
        "ratio_same_footprint_median_per_round": round(statistics.median(per_round_foot), 3),
        "ratio_two_threads_median_per_round": round(statistics.median(per_round_thr), 3),
        "ratio_per_round": [round(x, 3) for x in per_round],
        "ratio_same_footprint_per_round": [round(x, 3) for x in per_round_foot],
        "ratio_two_threads_per_round": [round(x, 3) for x in per_round_thr],
        "ratio_to_raw_copy": round(bps / hot_bps, 3),
        "ratio_to_raw_copy_same_footprint": round(bps / foot_bps, 3),
        "ratio_to_raw_copy_cache_resident": round(min(resident) / statistics.median(rt), 3),
        # the fastest round against the fastest copies: robust to other tenants' load spikes
        "best_ratio_to_raw_copy": round(min(hot) / min(rt), 3),
        "best_ratio_to_raw_copy_same_footprint": round(min(foot) / min(rt), 3),
        # Where a round's time goes: the copy worker's own time on the round's two copies
        # (first byte to last, completions posted), their rate, and their share of the round;
        # the rest is submission, hand-offs to and from the worker, and the cache's own work.
        "copy_bytes_s": round(moved / statistics.median(copying)),
        "copy_share_of_round_median": round(
            statistics.median(c / r for c, r in zip(copying, rt, strict=True)), 3),
        "ms": ms,
        "target_ratio": 0.7,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq-tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--host-layout", choices=("layer_first", "page_first"), default="layer_first")
    ap.add_argument("--device", default="cpu",
                    help="device pool: cpu (default), cuda or cuda:N")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 8
    print(json.dumps(asyncio.run(run(args)), indent=1))


if __name__ == "__main__":
    main()
