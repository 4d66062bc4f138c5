"""Page-level eviction simulation of LHD (hit density) on the tree, against LRU and ``arc``.

The same exploratory model of the radix tree as ``scripts/sim_eviction.py`` (whole pages,
prefix-closed, leaf eviction, a request's matched pages locked while its new pages go in, a hit
is the longest cached prefix of whole pages), with the page keys interned to dense ints in trace
order (so runs are reproducible: no per-process hash seed reaches a tie-break).

LHD (Beckmann et al., NSDI'18): every cached page is in a *class*; per class the policy keeps
decayed histograms of the (coarsened) ages at which pages of that class were hit and at which
they were evicted, and from them each age's *hit density*, the expected hits of a page of that
class and age before it leaves divided by its expected remaining time in the cache (both
conditioned on the page having reached that age). Eviction samples ``--sample`` evictable
leaves (random, seeded) and takes the one of the lowest hit density (ties: the least recently
used). Age is counted in requests since the page's last use (``--age last``) or since its insert
(``--age insert``); the bin width adapts so that evictions fall inside the histogram.

Variants (each one's options in its ``--policies`` entry, ``lhd:CLASSES:OPT:...``):

* ``gh`` (ghost hits, with ``g=G``: G x capacity ghosts): an evicted page that comes back while
  its ghost is remembered counts as a hit of its class at its true age, and its eviction is
  taken back, so the histograms see reuse past the eviction age (plain LHD only sees hits
  of pages it kept, which biases every class toward the ages the policy already keeps).
* ``mono``: the density of a class is made non-increasing in age (LRU order inside a class,
  classes compared by density). Without it LHD happily evicts a class's young pages first
  (their reuse is still far off), which on these traces costs a lot (below).
* ``carry``: ages past a class's last event keep the last known density (LHD: 0).
* ``h=H``: rank by the hits within the next H x mean eviction age per time spent, instead of
  LHD's hits until eviction.
* ``last`` / ``insert``: age since the last use or since the insert.
* ``arc``: the hybrid: ``arc``'s adaptive once/reused split (a page is reused once matched or
  re-inserted from a ghost; a ghost hit moves the once target ``p`` by the ARC rule), the
  victim of the once class the lowest hit density of the sampled once leaves (the classes
  then split the once pages: ``seg``, ``tail``...), of the reused class the least recently
  used of the sampled reused leaves. One ghost list of ``g`` x capacity (``g=4`` is about
  ``arc``'s two lists of 2 x).

Classes (``+``-separated parts, multiplied):

* ``uses``: times the page was used (inserted or matched), capped at 4; with ghosts
  (``g=G``) a re-inserted page continues the count it had when evicted.
* ``tail``: the page is the last whole page of the request that last used it, or not.
* ``seg``: log2 of the length of the new segment the page was inserted in (bucketed).
* ``depth``: log2 of the page's depth in the prompt (bucketed).
* ``par``: per-prefix popularity: the use count of the deepest matched page of the request
  that inserted the page (the prefix its segment extends): 0-1, 2-3, 4-15, 16+.
* ``oracle``: future knowledge, a ceiling and not a policy: whether the page is used again
  after its current use (the "dead page" oracle of docs/eviction.md). With ``gh`` it checks
  that the hit-density machinery can use a perfect class.

Other policies: ``lru``, ``arc`` (``sim_eviction.py``'s, 2 x ghosts, p starting at half),
``split:F`` (``arc`` with the once-class target fixed at F x capacity, ghost hits still making
pages reused-class: the best F, tuned per trace, is a ceiling of ``arc``'s adaptation).

Cost: an LHD eviction samples ``--sample`` evictable leaves (O(sample), 64 by default), plus
the histogram refresh, O(classes x bins) every ``max(2000, capacity / 2)`` events.

    python scripts/sim_lhd.py                          # the results table's policies, all traces
    python scripts/sim_lhd.py --only conversation --caps 10000 --policies lru,lhd:uses:g=2:gh:mono
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_eviction import DEFAULT_TRACES, PageCache, traces

Prompt = tuple[list[int], int]

NBINS = 128


class SplitCache(PageCache):
    """``arc`` with the once-class target ``p`` fixed: its ghost lists (2 x capacity) still make a
    re-inserted page reused-class, but a ghost hit no longer moves ``p``. The best such split,
    tuned per trace and capacity, is a ceiling of what adapting ``p`` can reach."""

    def __init__(self, capacity: int, frac: float) -> None:
        super().__init__(capacity, "arc", 2.0, frac)

    def _admit(self, page: int) -> None:
        p = self.p
        super()._admit(page)
        self.p = p


def intern(ps: list[Prompt]) -> tuple[list[Prompt], int]:
    ids: dict[int, int] = {}
    out = [([ids.setdefault(k, len(ids)) for k in keys], blocks) for keys, blocks in ps]
    return out, len(ids)


class LHDCache:
    """Leaf eviction by sampled hit density (LHD) over the page classes."""

    def __init__(self, capacity: int, npages: int, classes: tuple[str, ...], sample: int,
                 ghost: float, age: str, seed: int, ghost_hits: bool = False,
                 horizon: float = 0.0, mono: bool = False, carry: bool = False,
                 arc: bool = False, decay: float = 0.9) -> None:
        self.arc = arc  # hybrid: arc's adaptive once/reused split, hit density inside "once"
        self.p = 0.5 * capacity
        self.nreused = 0
        self.ghost_n = [0, 0]  # ghosts of once / reused pages
        self.horizon = horizon
        self.mono = mono
        self.carry = carry
        self.ghost_hits = ghost_hits
        self.capacity = capacity
        self.classes = classes
        self.sample = sample
        self.age_insert = age == "insert"
        self.rng = random.Random(seed)
        self.decay = decay
        n = npages
        self.cached = bytearray(n)
        self.last = [0] * n  # last use (request index)
        self.born = [0] * n  # insert time
        self.uses = [0] * n
        self.tail = bytearray(n)
        self.seg = bytearray(n)
        self.depth = bytearray(n)
        self.x = bytearray(n)  # an externally given class per page (analysis only)
        self.reused = bytearray(n)  # arc's class: matched, or re-inserted from a ghost
        self.par = bytearray(n)  # uses of the prefix the page's segment extended (bucketed)
        self.extra: list[int] | None = None  # per position of the current request
        self.parent = [-1] * n
        self.children = [0] * n
        self.size = 0
        self.leaves: list[int] = []
        self.pos: dict[int, int] = {}
        self.locked: set[int] = set()
        self.ghost_cap = int(ghost * capacity)
        # evicted page -> (its use count, its class and age bin at eviction, its last use)
        self.ghost: OrderedDict[int, tuple[int, int, int, int]] = OrderedDict()
        # class index layout
        self.dims = []
        for c in classes:
            self.dims.append({"uses": 4, "tail": 2, "seg": 4, "depth": 4, "x": 4, "oracle": 2, "par": 4}[c])
        ncls = 1
        for d in self.dims:
            ncls *= d
        self.ncls = ncls
        self.hits = [[0.0] * NBINS for _ in range(ncls)]
        self.evicts = [[0.0] * NBINS for _ in range(ncls)]
        self.width = max(1, capacity // 400)  # requests per age bin; adapts
        self.dens = [[1.0 / (a + 1) for a in range(NBINS)] for _ in range(ncls)]
        self.events = 0
        self.period = max(2000, capacity // 2)
        self.evict_ages: list[int] = []
        self.span = 4 if ghost_hits else 2  # the histogram covers span x the p99 eviction age

    # ---- classes
    def cls(self, k: int) -> int:
        c = 0
        for name, d in zip(self.classes, self.dims, strict=True):
            if name == "uses":
                v = min(self.uses[k], 4) - 1
            elif name == "tail":
                v = self.tail[k]
            elif name == "seg":
                v = self.seg[k]
            elif name == "par":
                v = self.par[k]
            elif name in ("x", "oracle"):
                v = self.x[k]
            else:
                v = self.depth[k]
            c = c * d + v
        return c

    def agebin(self, k: int, now: int) -> int:
        a = (now - (self.born[k] if self.age_insert else self.last[k])) // self.width
        return a if a < NBINS else NBINS - 1

    # ---- leaf set
    def _leaf_add(self, k: int) -> None:
        if k not in self.pos:
            self.pos[k] = len(self.leaves)
            self.leaves.append(k)

    def _leaf_del(self, k: int) -> None:
        i = self.pos.pop(k, None)
        if i is None:
            return
        last = self.leaves.pop()
        if last != k:
            self.leaves[i] = last
            self.pos[last] = i

    # ---- statistics
    def _tick(self) -> None:
        self.events += 1
        if self.events >= self.period:
            self.events = 0
            self._reconfigure()

    def _reconfigure(self) -> None:
        h_bins = 0
        if self.horizon and self.evict_ages:
            mean = sum(self.evict_ages) / len(self.evict_ages)
            h_bins = max(1, min(NBINS, round(self.horizon * mean / self.width)))
        for c in range(self.ncls):
            h, e, dens = self.hits[c], self.evicts[c], self.dens[c]
            if h_bins:
                self._density_horizon(h, e, dens, h_bins)
            else:
                self._density_lhd(h, e, dens, self.carry)
            if self.mono:
                # within a class never rank a younger page below an older one (LRU order inside
                # the class; the classes are compared by their densities)
                for a in range(1, NBINS):
                    if dens[a] > dens[a - 1]:
                        dens[a] = dens[a - 1]
            for a in range(NBINS):
                h[a] *= self.decay
                e[a] *= self.decay
        # adapt the age bins so that evictions fall well inside the histogram
        if self.evict_ages:
            ages = sorted(self.evict_ages)
            p = ages[int(0.99 * (len(ages) - 1))]
            target = max(1, p // (NBINS // self.span))
            if target >= 2 * self.width or target * 2 <= self.width:
                scale = target / self.width
                self.width = target
                for c in range(self.ncls):
                    for arr in (self.hits[c], self.evicts[c]):
                        new = [0.0] * NBINS
                        for a in range(NBINS):
                            b = min(NBINS - 1, int(a / scale))
                            new[b] += arr[a]
                        arr[:] = new
            self.evict_ages = []

    @staticmethod
    def _density_lhd(h: list[float], e: list[float], dens: list[float], carry: bool) -> None:
        """LHD: hits after this age / the time the class's pages of this age still spend."""
        cum_h = cum_e = life = 0.0
        for a in range(NBINS - 1, -1, -1):
            cum_h += h[a]
            cum_e += h[a] + e[a]
            life += cum_e
            dens[a] = cum_h / life if life > 0 else -1.0
        # ages past the last event of the class: 0 (LHD: nothing was ever hit there), or with
        # ``carry`` the last known density
        known = 0.0
        for a in range(NBINS):
            if dens[a] < 0:
                dens[a] = known if carry else 0.0
            else:
                known = dens[a]

    @staticmethod
    def _density_horizon(h: list[float], e: list[float], dens: list[float], w: int) -> None:
        """Hits within the next ``w`` bins / the time spent until then (or until the hit), of
        the pages of the class that reached this age; a page evicted and never back counts as
        never hit (with ghost hits its hit is at its true age)."""
        risk = [0.0] * (NBINS + 1)
        for a in range(NBINS - 1, -1, -1):
            risk[a] = risk[a + 1] + h[a] + e[a]
        known = 0.0
        for a in range(NBINS):
            if risk[a] <= 0:
                dens[a] = known
                continue
            hits = time = 0.0
            for b in range(a, min(NBINS, a + w)):
                hits += h[b]
                time += h[b] * (b - a + 1)
            time += (risk[a] - hits) * w
            dens[a] = known = hits / time

    # ---- eviction
    def _pick(self, now: int, want: int) -> int:
        """The lowest-density leaf of ``--sample`` sampled (of arc class ``want`` unless -1;
        the reused class in LRU order)."""
        leaves, locked, reused = self.leaves, self.locked, self.reused
        best = -1
        best_key = None
        n = len(leaves)
        tries = got = 0
        limit = (16 if want >= 0 else 4) * self.sample
        while got < self.sample and tries < limit:
            tries += 1
            k = leaves[self.rng.randrange(n)]
            if k in locked or (want >= 0 and reused[k] != want):
                continue
            got += 1
            if want == 1:
                key = (0.0, self.last[k])
            else:
                key = (self.dens[self.cls(k)][self.agebin(k, now)], self.last[k])
            if best_key is None or key < best_key:
                best_key, best = key, k
        return best

    def _evict_one(self, now: int) -> bool:
        leaves, locked = self.leaves, self.locked
        if not leaves:
            return False
        best = -1
        if self.arc:
            first = 0 if self.size - self.nreused > self.p else 1
            best = self._pick(now, first)
            if best < 0:
                best = self._pick(now, 1 - first)
        else:
            best = self._pick(now, -1)
        if best < 0:
            cand = [k for k in leaves if k not in locked]
            if not cand:
                return False
            best = min(cand, key=lambda k: self.last[k])
        k = best
        c = self.cls(k)
        b = self.agebin(k, now)
        self.evicts[c][b] += 1
        self.evict_ages.append(now - (self.born[k] if self.age_insert else self.last[k]))
        self._tick()
        self.cached[k] = 0
        self.size -= 1
        self._leaf_del(k)
        if self.ghost_cap:
            r = self.reused[k]
            self.ghost[k] = (self.uses[k], c, b, self.born[k] if self.age_insert else self.last[k],
                             r)
            self.ghost_n[r] += 1
            if len(self.ghost) > self.ghost_cap:
                self.ghost_n[self.ghost.popitem(last=False)[1][4]] -= 1
        if self.reused[k]:
            self.reused[k] = 0
            self.nreused -= 1
        par = self.parent[k]
        if par >= 0 and self.cached[par]:
            self.children[par] -= 1
            if self.children[par] == 0:
                self._leaf_add(par)
        return True

    def serve(self, keys: list[int], t: int) -> int:
        m = 0
        cached = self.cached
        for k in keys:
            if not cached[k]:
                break
            m += 1
        self.locked = set(keys[:m])
        L = len(keys)
        for i in range(m):
            k = keys[i]
            c = self.cls(k)
            self.hits[c][self.agebin(k, t)] += 1
            self._tick()
            self.uses[k] += 1
            self.last[k] = t
            if not self.reused[k]:
                self.reused[k] = 1
                self.nreused += 1
            self.tail[k] = i == L - 1
            if self.extra is not None:
                self.x[k] = self.extra[i]
        seg = min(3, max(0, (L - m).bit_length() - 3))
        pu = self.uses[keys[m - 1]] if m else 0
        pcls = 0 if pu <= 1 else 1 if pu <= 3 else 2 if pu <= 15 else 3
        for i in range(m, L):
            while self.size >= self.capacity and self._evict_one(t):
                pass
            if self.size >= self.capacity:
                break
            k = keys[i]
            par = keys[i - 1] if i else -1
            self.parent[k] = par
            cached[k] = 1
            self.size += 1
            self.last[k] = self.born[k] = t
            g = self.ghost.pop(k, None) if self.ghost_cap else None
            self.uses[k] = 1
            if g is not None:
                self.uses[k] = g[0] + 1
                self.ghost_n[g[4]] -= 1
                self.reused[k] = 1
                self.nreused += 1
                once_g, reused_g = self.ghost_n
                if g[4]:  # arc: a ghost of a reused page shrinks the once target
                    self.p = max(0.0, self.p - max(1.0, once_g / max(1, reused_g)))
                else:
                    self.p = min(self.capacity, self.p + max(1.0, reused_g / max(1, once_g)))
                if self.ghost_hits:
                    # the evicted page came back: had it stayed, this was a hit of its class
                    # at this age, not an eviction at the earlier one
                    a = min(NBINS - 1, (t - g[3]) // self.width)
                    self.hits[g[1]][a] += 1
                    self.evicts[g[1]][g[2]] = max(0.0, self.evicts[g[1]][g[2]] - 1)
            self.tail[k] = i == L - 1
            self.seg[k] = seg
            self.par[k] = pcls
            self.depth[k] = min(3, max(0, i.bit_length() - 3))
            if self.extra is not None:
                self.x[k] = self.extra[i]
            self.children[k] = 0
            self._leaf_add(k)
            if par >= 0:
                if self.children[par] == 0:
                    self._leaf_del(par)
                self.children[par] += 1
            self.locked.add(k)
        self.locked = set()
        return m


def run(ps: list[Prompt], npages: int, capacity: int, spec: dict) -> float:
    pol = spec["policy"]
    if pol in ("lru", "arc"):
        cache = PageCache(capacity, pol, spec.get("ghosts", 2.0), spec.get("start", 0.5))
    elif pol == "split":
        cache = SplitCache(capacity, spec["frac"])
    else:
        cache = LHDCache(capacity, npages, tuple(spec["classes"].split("+")), spec["sample"],
                         spec["ghost"], spec["age"], spec["seed"], spec["ghost_hits"], spec["horizon"],
                         spec["mono"], spec["carry"], spec["arc"])
    extra = None
    if pol == "lhd" and "oracle" in spec["classes"].split("+"):
        # future knowledge (a ceiling, not a policy): is the page used again after this use?
        last_use = {}
        for t, (keys, _) in enumerate(ps, 1):
            for k in keys:
                last_use[k] = t
        extra = [[int(last_use[k] > t) for k in keys] for t, (keys, _) in enumerate(ps, 1)]
    hit = total = 0
    for t, (keys, blocks) in enumerate(ps, 1):
        if extra is not None:
            cache.extra = extra[t - 1]
        hit += cache.serve(keys, t)
        total += blocks
    return hit / total


def markdown(rows: list[dict], names: list[str]) -> str:
    """One table per trace: block hit ratio per policy and capacity, change vs LRU."""
    out = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        rs = [r for r in rows if r["trace"] == trace]
        out.append(f"\n#### {trace}\n")
        out.append("| policy | " + " | ".join(f"{r['capacity']:,} blocks" for r in rs) + " |")
        out.append("|---|" + "---:|" * len(rs))
        for n in names:
            cells = []
            for r in rs:
                v = r[n]
                cells.append(f"{v:.4f}" if n == "lru" or not r.get("lru") else
                             f"{v:.4f} ({v / r['lru'] - 1:+.1%})")
            out.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--policies", default=(
        "lru,arc,split:0.5,split:0.02,lhd:uses,lhd:uses+tail,lhd:uses:g=1:gh:mono,"
        "lhd:uses:g=2:gh:mono,lhd:uses:g=4:gh:mono:arc,lhd:seg:g=4:gh:mono:arc,"
        "lhd:oracle:g=2:gh"),
                    help="comma-separated: lru, arc (2x ghosts), lhd (with the flags below); "
                         "lhd:CLASSES[:OPT...] sets a variant's own options: last|insert (age), "
                         "g=GHOST, gh (ghost hits), h=HORIZON; e.g. lhd:uses+tail:insert:g=2")
    ap.add_argument("--classes", default="uses", help="default LHD classes, '+'-separated")
    ap.add_argument("--seeds", default="", help="comma-separated seeds: LHD rows are the mean "
                    "(min and max in the JSON)")
    ap.add_argument("--age", default="last", choices=("last", "insert"))
    ap.add_argument("--sample", type=int, default=64)
    ap.add_argument("--ghost", type=float, default=0.0,
                    help="remembered use counts of evicted pages, x capacity")
    ap.add_argument("--ghost-hits", action="store_true",
                    help="a re-inserted ghost counts as a hit of its class at its age (and its "
                         "eviction is taken back): hit densities past the eviction age")
    ap.add_argument("--horizon", type=float, default=0.0,
                    help="rank by hits within the next horizon x the mean eviction age per "
                         "time spent (0: LHD's hits until eviction)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default="", help="substring of the trace names to run")
    ap.add_argument("--caps", default="", help="override capacities (comma-separated)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", action="store_true", help="also print the results table")
    args = ap.parse_args()
    specs = []
    for p in args.policies.split(","):
        parts = p.split(":")
        if parts[0] in ("lru", "arc"):
            specs.append(dict(name=parts[0], policy=parts[0]))
        elif parts[0] == "split":
            specs.append(dict(name=p, policy="split", frac=float(parts[1])))
        else:
            spec = dict(name=p, policy="lhd", classes=args.classes, age=args.age,
                        sample=args.sample, ghost=args.ghost, seed=args.seed,
                        ghost_hits=args.ghost_hits, horizon=args.horizon, mono=False,
                        carry=False, arc=False)
            for i, opt in enumerate(parts[1:]):
                if opt in ("last", "insert"):
                    spec["age"] = opt
                elif opt == "gh":
                    spec["ghost_hits"] = True
                elif opt == "mono":
                    spec["mono"] = True
                elif opt == "carry":
                    spec["carry"] = True
                elif opt == "arc":
                    spec["arc"] = True
                elif opt.startswith("g="):
                    spec["ghost"] = float(opt[2:])
                elif opt.startswith("h="):
                    spec["horizon"] = float(opt[2:])
                elif i == 0:
                    spec["classes"] = opt
                else:
                    ap.error(f"unknown lhd option {opt!r} in {p!r}")
            specs.append(spec)
    rows = []
    for name, ps, caps in traces(args.traces):
        if args.only and args.only not in name:
            continue
        ps, npages = intern(ps)
        if args.caps:
            caps = tuple(int(c) for c in args.caps.split(","))
        for cap in caps:
            row: dict = dict(trace=name, capacity=cap)
            for spec in specs:
                t0 = time.time()
                if spec["policy"] == "lhd" and args.seeds:
                    vals = [run(ps, npages, cap, spec | dict(seed=int(x)))
                            for x in args.seeds.split(",")]
                    row[spec["name"]] = round(sum(vals) / len(vals), 4)
                    row[spec["name"] + "_seeds"] = [round(v, 4) for v in vals]
                else:
                    row[spec["name"]] = round(run(ps, npages, cap, spec), 4)
                row[spec["name"] + "_s"] = round(time.time() - t0, 1)
            base = row.get("lru")
            if base:
                for spec in specs:
                    if spec["name"] != "lru":
                        row[spec["name"] + "_vs_lru"] = f"{row[spec['name']] / base - 1:+.1%}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.markdown:
        print(markdown(rows, [sp["name"] for sp in specs]))
    if args.json:
        args.json.write_text(json.dumps(dict(args=vars(args) | dict(traces=str(args.traces),
                                             json=str(args.json)), rows=rows), indent=1))


if __name__ == "__main__":
    main()
