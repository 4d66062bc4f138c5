#!/usr/bin/env python3
"""``PageAllocator.pages_of`` (the whole-page check of every insert, free and copy request)
against the one-shot check it replaced, interleaved in rounds in the same process.

The yardstick (``oneshot``) is the earlier check inlined: gather the request's page-table rows
into a fresh array and compare two fresh ``tobytes`` copies. ``pages_of`` checks requests of
8,192 slots and more chunk by chunk in reused buffers. Fresh arrays of a large request's size
cost page faults whenever malloc serves them from fresh mmap'd memory, which depends on what the
process freed before: run once as is and once with ``MALLOC_MMAP_THRESHOLD_=131072`` in the
environment (every large array fresh from mmap, as in a long replay) to see both ends.

Each case reports per-call microseconds of both (median over rounds), the ratio of every round
(oneshot time over pages_of time, > 1: pages_of is faster) and their median. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from asynccache.transfers.allocator import PageAllocator


def _oneshot(table: np.ndarray, slots: np.ndarray, ps: int, shift: int) -> np.ndarray:
    pages = slots[::ps] >> shift
    rows = table.take(pages, 0)
    if rows.tobytes() != slots.tobytes():
        raise AssertionError("bad slots")
    return pages


def _time(fn: object, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--sizes", default="4096,16384,102400,262144", help="slots per request")
    args = ap.parse_args()
    ps = args.page_size
    shift = ps.bit_length() - 1
    if ps & (ps - 1):
        raise SystemExit("--page-size must be a power of two (the yardstick shifts)")
    sizes = [int(s) for s in args.sizes.split(",")]
    num_pages = max(sizes) // ps * 4
    alloc = PageAllocator(num_pages * ps, ps)
    table = np.arange(num_pages * ps, dtype=np.int64).reshape(num_pages, ps)
    rng = np.random.default_rng(0)
    cases = []
    for n in sizes:
        slots = table[rng.permutation(num_pages)[: n // ps]].reshape(-1).copy()
        reps = max(20, 2_000_000 // n)
        new_t: list[float] = []
        old_t: list[float] = []
        for r in range(args.rounds):
            order = ("new", "old") if r % 2 == 0 else ("old", "new")
            for which in order:
                if which == "new":
                    new_t.append(_time(lambda s=slots: alloc.pages_of(s), reps))
                else:
                    old_t.append(_time(lambda s=slots: _oneshot(table, s, ps, shift), reps))
        ratios = [o / p for o, p in zip(old_t, new_t, strict=True)]
        cases.append(
            {
                "slots": n,
                "pages": n // ps,
                "pages_of_us": round(statistics.median(new_t) * 1e6, 2),
                "oneshot_us": round(statistics.median(old_t) * 1e6, 2),
                "ratio_per_round": [round(x, 2) for x in ratios],
                "ratio": round(statistics.median(ratios), 2),
            }
        )
    print(
        json.dumps(
            {
                "page_size": ps,
                "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                "load": os.getloadavg(),
                "cases": cases,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
