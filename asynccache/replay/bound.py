"""The infinite-cache bound of a replay: how much of each prompt a cache that never evicts
would have served, counted in whole pages, in a compact set of 64-bit prefix hashes.

A prompt's ``j``-th whole page is identified by a hash of its namespace and every token up to
the end of that page (a chain: equal hashes mean equal prefixes, up to a 64-bit collision).
The set holds one 8-byte entry per distinct prefix page in an open-addressing numpy table kept
at most half full (16-32 bytes per distinct page), so the bound's memory grows with the
trace's distinct content, not with its length, and never holds token arrays.
"""

from __future__ import annotations

import heapq
import zlib

import numpy as np

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
# Odd multipliers (from splitmix64 / murmur3 finalisers) and the chain base.
_M1, _M2, _M3 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15
_K = 0xD6E8FEB86659FD93
_PAD = _U64(1 << 40)  # pads a partial page: token ids are uint32


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(_M1)
    x = x ^ (x >> _U64(27))
    x = x * _U64(_M2)
    out: np.ndarray = x ^ (x >> _U64(31))
    return out


class PrefixHasher:
    """64-bit chain hashes of a prompt's whole pages: ``hashes(tokens, ns)[j]`` identifies the
    namespace plus tokens ``[0, (j + 1) * page_size)``."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        rng = np.random.default_rng(0x5EED)
        self._lane = rng.integers(1, 1 << 63, size=page_size, dtype=np.uint64) * _U64(2) + _U64(1)
        self._pow: np.ndarray = np.ones(1, dtype=np.uint64)  # K ** j
        self._ipow: np.ndarray = np.ones(1, dtype=np.uint64)  # K ** -j
        self._kinv = pow(_K, -1, 1 << 64)
        self._seeds: dict[str | None, int] = {}

    def _powers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self._pow) < n:
            m = max(n, 2 * len(self._pow))
            with np.errstate(over="ignore"):
                self._pow = np.cumprod(np.full(m, _K, dtype=np.uint64)) * _U64(self._kinv)
                self._ipow = np.cumprod(np.full(m, self._kinv, dtype=np.uint64)) * _U64(_K)
        return self._pow[:n], self._ipow[:n]

    def _seed(self, namespace: str | None) -> int:
        s = self._seeds.get(namespace)
        if s is None:
            raw = b"\x00" if namespace is None else b"\x01" + namespace.encode()
            s = (zlib.crc32(raw) * _M3 + len(raw) * _M1 + 1) & _MASK64
            if len(self._seeds) < 1 << 16:
                self._seeds[namespace] = s
        return s

    def hashes(self, tokens: np.ndarray, namespace: str | None = None, *,
               partial: bool = False) -> np.ndarray:
        """One hash per whole page; ``partial=True`` adds one for a partial last page (its
        tokens padded with an id no token has, so it equals no whole page's hash)."""
        ps = self.page_size
        n = len(tokens)
        pages = -(-n // ps) if partial else n // ps
        if pages == 0:
            return np.empty(0, dtype=np.uint64)
        with np.errstate(over="ignore"):
            if pages * ps <= n:
                flat = tokens[: pages * ps].astype(np.uint64)
            else:
                flat = np.full(pages * ps, _PAD, dtype=np.uint64)
                flat[:n] = tokens
            t = flat.reshape(pages, ps)
            page = _mix(t * self._lane + _U64(_M3)).sum(axis=1, dtype=np.uint64)
            page = _mix(page)
            pw, ipw = self._powers(pages)
            # H_j = K^j * (seed + sum_{i<=j} P_i K^-i): the polynomial chain, vectorised
            acc = np.cumsum(page * ipw, dtype=np.uint64) + _U64(self._seed(namespace))
            out = _mix(acc * pw)
        out[out == 0] = 1  # 0 marks an empty slot in PageSet
        return out


class PageSet:
    """A growable set of non-zero uint64 values (open addressing, linear probing)."""

    def __init__(self, capacity: int = 1 << 12) -> None:
        size = 1 << max(4, (2 * capacity - 1).bit_length())
        self._table = np.zeros(size, dtype=np.uint64)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)

    def _find(self, h: np.ndarray) -> np.ndarray:
        """For each value: its slot, or the empty slot where probing for it stopped."""
        table = self._table
        mask = _U64(len(table) - 1)
        idx = (h & mask).astype(np.int64)
        out = np.empty(len(h), dtype=np.int64)
        todo = np.arange(len(h))
        while todo.size:
            cur = table[idx[todo]]
            done = (cur == h[todo]) | (cur == 0)
            out[todo[done]] = idx[todo[done]]
            todo = todo[~done]
            idx[todo] = (idx[todo] + 1) & (len(table) - 1)
        return out

    def contains(self, h: np.ndarray) -> np.ndarray:
        """A bool per value: is it in the set."""
        if not len(h):
            return np.zeros(0, dtype=bool)
        return np.asarray(self._table[self._find(h)] == h)

    def leading(self, h: np.ndarray) -> int:
        """How many of the first values of ``h`` are in the set (stops at the first absent)."""
        if not len(h):
            return 0
        present = self._table[self._find(h)] == h
        miss = np.flatnonzero(~present)
        return int(miss[0]) if miss.size else len(h)

    def add(self, h: np.ndarray) -> None:
        """Add distinct values ``h`` (some may be present already)."""
        if not len(h):
            return
        if 2 * (self._count + len(h)) > len(self._table):
            self._grow(self._count + len(h))
        todo = h
        while todo.size:
            slots = self._find(todo)
            new = self._table[slots] == 0
            todo, slots = todo[new], slots[new]
            self._table[slots] = todo  # two values may race for one empty slot: one wins
            won = self._table[slots] == todo
            self._count += int(won.sum())
            todo = todo[~won]

    def _grow(self, need: int) -> None:
        old = self._table[self._table != 0]
        size = len(self._table)
        while 2 * need > size:
            size *= 2
        self._table = np.zeros(size, dtype=np.uint64)
        self._count = 0
        self.add(old)


class InfiniteBound:
    """Hits of a cache that never evicts (whole pages, per namespace)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._hasher = PrefixHasher(page_size)
        self._set = PageSet()

    def access(self, tokens: np.ndarray, namespace: str | None = None) -> int:
        """The prompt's hit in tokens (whole pages seen before), then remember its pages."""
        return self.access_pages(self._hasher.hashes(tokens, namespace))

    def access_pages(self, h: np.ndarray) -> int:
        """:meth:`access` with the prompt's whole-page hashes already computed
        (:class:`PrefixHasher` of this page size)."""
        hit = self._set.leading(h)
        if hit < len(h):
            self._set.add(h[hit:])
        return hit * self.page_size

    @property
    def distinct_pages(self) -> int:
        return len(self._set)

    @property
    def nbytes(self) -> int:
        return self._set.nbytes


_NEVER = np.iinfo(np.int64).max


def belady_hits(seq: np.ndarray, depth: np.ndarray, capacity: int) -> int:
    """Hits of the offline optimum (Belady, with bypass) on the page sequence ``seq`` (ints,
    one per page access) with room for ``capacity`` pages.

    On a miss the page is admitted only when some cached page is next used later than it (that
    page is evicted); a page never used again is not admitted. Ties go to the deeper page
    (``depth``), so a page leaves before its prefix. For prefix pages (a prompt accesses its
    pages root first) this keeps the cache prefix-closed: a page's prefix is next used no later
    than the page itself, so every cached page's prefix is cached and a hit is a prefix hit.
    O(n log capacity): a max-heap of (next use, depth) with lazy deletion.
    """
    n = len(seq)
    if n == 0 or capacity <= 0:
        return 0
    ids = np.unique(np.asarray(seq), return_inverse=True)[1].astype(np.int64)
    order = np.argsort(ids, kind="stable")
    nxt = np.full(n, _NEVER, dtype=np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    cached = np.zeros(int(ids.max()) + 1, dtype=bool)
    live = np.full(len(cached), -1, dtype=np.int64)  # the cached page's next use (heap key)
    dep = np.zeros(len(cached), dtype=np.int64)
    dep[ids] = depth
    heap: list[tuple[int, int, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    size = hits = 0
    ids_l, nxt_l, dep_l = ids.tolist(), nxt.tolist(), np.asarray(depth).tolist()
    for i in range(n):
        u, nu = ids_l[i], nxt_l[i]
        if cached[u]:
            hits += 1
            if nu == _NEVER:  # never used again: free its room now
                cached[u] = False
                size -= 1
            else:
                live[u] = nu
                push(heap, (-nu, -dep_l[i], u))
            continue
        if nu == _NEVER:
            continue
        if size >= capacity:
            while True:  # the cached page used last (skipping stale entries)
                k, _, v = heap[0]
                if cached[v] and live[v] == -k:
                    break
                pop(heap)
            if -k <= nu:
                continue  # bypass: every cached page is needed sooner
            pop(heap)
            cached[v] = False
            size -= 1
        cached[u] = True
        live[u] = nu
        size += 1
        push(heap, (-nu, -dep_l[i], u))
        if len(heap) > 4 * capacity + 1024:
            heap = [(-int(live[v]), -int(dep[v]), v) for v in np.flatnonzero(cached).tolist()]
            heapq.heapify(heap)
    return hits


class BeladyBound:
    """The offline optimum of a cache of ``capacity_pages`` pages: records each prompt's whole
    prefix pages (64-bit chain hashes, 8 bytes a page) and computes, at the end, the hits of
    Belady's algorithm over them (:func:`belady_hits`). An upper bound for every eviction
    policy of the tree at that capacity: no online policy can hit more pages.

    It relaxes the engine's constraints (a prompt need not fit its uncached pages at once, and
    a missed page may bypass the cache), so it is an upper bound, not always attainable.
    """

    def __init__(self, page_size: int, capacity_pages: int) -> None:
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self._hasher = PrefixHasher(page_size)
        self._chunks: list[np.ndarray] = []
        self._result: int | None = None

    def access(self, tokens: np.ndarray, namespace: str | None = None) -> None:
        """Record a prompt (its whole pages; a partial last page never hits)."""
        self.access_pages(self._hasher.hashes(tokens, namespace))

    def access_pages(self, h: np.ndarray) -> None:
        """:meth:`access` with the prompt's whole-page hashes already computed
        (:class:`PrefixHasher` of this page size; kept, not copied)."""
        if len(h):
            self._chunks.append(h)
            self._result = None

    def hit_pages(self) -> int:
        """Pages the optimum hits over every prompt recorded so far."""
        if self._result is None:
            if not self._chunks:
                self._result = 0
            else:
                seq = np.concatenate(self._chunks)
                depth = np.concatenate([np.arange(len(c)) for c in self._chunks])
                self._result = belady_hits(seq, depth, self.capacity_pages)
        return self._result

    def hit_tokens(self) -> int:
        return self.hit_pages() * self.page_size

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._chunks)
