"""Page-level eviction simulation: LRU against an ARC-style adaptive policy with ghost lists.

An exploratory model of the radix tree, not the engine: a cache of whole pages where a page is
cached only with its whole prefix, eviction takes leaves only (a page none of whose extensions
is cached), a request's matched pages are locked while its new pages go in, and a request's
hit is its longest cached prefix of whole pages. Its LRU is within 0.2 points of the engine's
(``scripts/ablation_eviction.py``), which makes it a cheap place to measure an idea before
building it into the tree (docs/eviction.md).

The ARC variant (Megiddo and Modha's adaptive replacement cache, put on a tree) splits cached
pages into *once* (inserted, never matched again) and *reused* (matched by a later request, or
re-inserted after eviction: its ghost was found), keeps the keys of evicted pages of each class
in a ghost list of ``ghosts x capacity`` entries, and evicts the least recently used leaf of
the *once* class while that class holds more than a target ``p`` pages, else of the *reused*
class. A ghost hit on an evicted once-used page grows ``p``; on an evicted reused page it
shrinks it. ``p`` starts at ``start x capacity``.

    python scripts/sim_eviction.py                 # both Mooncake traces and the kv-cache-tester samples
    python scripts/sim_eviction.py --json out.json
"""

from __future__ import annotations

import argparse
import glob
import heapq
import json
import sys
from collections import Counter, OrderedDict
from collections.abc import Iterable
from pathlib import Path

from asynccache.replay.formats import read_kvtester, read_mooncake

DEFAULT_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"

Prompt = tuple[list[int], int]  # (chain keys of the whole pages, all blocks incl. a partial one)


def prompts(requests: Iterable, page: int) -> list[Prompt]:
    out: list[Prompt] = []
    for req in requests:
        toks = req.tokens
        keys: list[int] = []
        key = 0
        for i in range(len(toks) // page):
            key = hash((key, toks[i * page:(i + 1) * page].tobytes()))
            keys.append(key)
        out.append((keys, -(-len(toks) // page)))
    return out


class PageCache:
    """Whole pages, prefix-closed, leaf eviction by the policy's choice of queue."""

    def __init__(self, capacity: int, policy: str, ghosts: float, start: float) -> None:
        self.capacity = capacity
        self.arc = policy == "arc"
        self.stamp: dict[int, int] = {}  # cached page -> last access
        self.parent: dict[int, int | None] = {}
        self.children: Counter[int] = Counter()  # cached children per page
        self.reused: set[int] = set()  # cached pages of the reused class (ARC)
        self.heaps: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
        self.ghost: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (
            OrderedDict(), OrderedDict())
        self.ghost_cap = int(ghosts * capacity)
        self.p = start * capacity
        self.locked: set[int] = set()

    def _queue(self, page: int) -> None:
        if self.children[page] == 0:
            cls = 1 if self.arc and page in self.reused else 0
            heapq.heappush(self.heaps[cls], (self.stamp[page], page))

    def _pop(self, cls: int) -> int | None:
        heap = self.heaps[cls]
        while heap:
            stamp, page = heapq.heappop(heap)
            if (self.stamp.get(page) == stamp and self.children[page] == 0
                    and page not in self.locked and (page in self.reused) == bool(cls)):
                return page
        return None

    def _evict_one(self) -> bool:
        if self.arc:
            once = len(self.stamp) - len(self.reused)
            first = 0 if once > self.p else 1
            page = self._pop(first)
            if page is None:
                page = self._pop(1 - first)
        else:
            page = self._pop(0)
        if page is None:
            return False
        del self.stamp[page]
        if self.arc:
            cls = 1 if page in self.reused else 0
            self.reused.discard(page)
            ghost = self.ghost[cls]
            ghost[page] = None
            while len(ghost) > self.ghost_cap:
                ghost.popitem(last=False)
        par = self.parent.pop(page)
        if par is not None and par in self.stamp:
            self.children[par] -= 1
            self._queue(par)
        return True

    def _admit(self, page: int) -> None:
        """ARC bookkeeping for a page going in: a ghost hit moves the target, and the page is
        reused-class if it was seen before."""
        once, reused = self.ghost
        if page in once:
            self.p = min(self.capacity, self.p + max(1.0, len(reused) / max(1, len(once))))
            del once[page]
            self.reused.add(page)
        elif page in reused:
            self.p = max(0.0, self.p - max(1.0, len(once) / max(1, len(reused))))
            del reused[page]
            self.reused.add(page)

    def serve(self, keys: list[int], t: int) -> int:
        """Match, then insert the rest; returns the matched pages."""
        m = 0
        for k in keys:
            if k not in self.stamp:
                break
            m += 1
        self.locked = set(keys[:m])
        for k in keys[:m]:
            self.stamp[k] = t
            if self.arc:
                self.reused.add(k)
        for i in range(m, len(keys)):
            while len(self.stamp) >= self.capacity and self._evict_one():
                pass
            if len(self.stamp) >= self.capacity:
                break
            k = keys[i]
            par = keys[i - 1] if i else None
            self.parent[k] = par
            self.stamp[k] = t
            if self.arc:
                self._admit(k)
            if par is not None:
                self.children[par] += 1
            self.locked.add(k)
        for k in keys:
            if k in self.stamp:
                self._queue(k)
        self.locked = set()
        return m


def hit_rate(ps: list[Prompt], capacity: int, policy: str, ghosts: float, start: float) -> float:
    cache = PageCache(capacity, policy, ghosts, start)
    hit = total = 0
    for t, (keys, blocks) in enumerate(ps, 1):
        hit += cache.serve(keys, t)
        total += blocks
    return hit / total


def traces(root: Path) -> list[tuple[str, list[Prompt], tuple[int, ...]]]:
    out = []
    for name in ("conversation", "synthetic"):
        path = root / "mooncake" / f"{name}_trace.jsonl"
        if path.exists():
            out.append((f"mooncake {name}", prompts(read_mooncake(path), 512), (1000, 10_000, 50_000)))
        else:
            print(f"skipped mooncake {name}: {path} is absent", file=sys.stderr)
    samples = sorted(glob.glob(str(root / "kv-cache-tester" / "trace_00*.json")))
    if samples:
        out.append(("kv-cache-tester samples", prompts(read_kvtester(samples), 64), (1100, 2000, 4000)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--ghosts", type=float, default=1.0, help="ghost list size, x capacity")
    ap.add_argument("--start", type=float, default=0.5, help="initial target p, x capacity")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for name, ps, caps in traces(args.traces):
        for cap in caps:
            lru = hit_rate(ps, cap, "lru", args.ghosts, args.start)
            arc = hit_rate(ps, cap, "arc", args.ghosts, args.start)
            row = dict(trace=name, capacity=cap, lru=round(lru, 4), arc=round(arc, 4),
                       arc_vs_lru=round(arc / lru - 1, 4) if lru else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(ghosts=args.ghosts, start=args.start, rows=rows),
                                        indent=1))


if __name__ == "__main__":
    main()
