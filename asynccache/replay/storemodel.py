"""The shared L3 as a replay sees it: when a written page becomes readable, in trace time, and
which pages were there before the replay started.

Replays drain every storage write after each step (see :mod:`asynccache.replay.driver`), so a
write always completes before the next request of the trace is admitted. With a write
bandwidth, :class:`TraceTimeStore` additionally hides each written page until the trace time
at which a store accepting ``bandwidth`` bytes per second, one write after another, would have
finished it (a page is hidden from existence queries and reads until then, from every
instance). Without one, a page is readable from the next request on.

It also counts the distinct pages that queries found but this replay never wrote: pages of an
earlier run (a *warm* store), which inflate hit rates beyond the trace's own bound.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from asynccache.replay.bound import PageSet


def _key_ids(keys: Sequence[str]) -> np.ndarray:
    """64-bit ids of page keys (the first 16 hex digits of the hash, mixed with any pool
    suffix); never 0."""
    out = np.fromiter(
        ((int(k[:16], 16) ^ (zlib.crc32(k[64:].encode()) if len(k) > 64 else 0)) | 1
         for k in keys),
        dtype=np.uint64, count=len(keys))
    return out


class TraceTimeStore:
    """A storage backend wrapper that applies the replay's write model (see the module doc)."""

    def __init__(self, backend: Any, clock: Callable[[], float],
                 write_bandwidth: float | None = None) -> None:
        self._backend = backend
        self._clock = clock
        self._bandwidth = write_bandwidth
        self._busy_until = 0.0
        self._hidden: dict[str, float] = {}  # key -> trace time it becomes readable
        self._written = PageSet()  # keys this replay wrote
        self._foreign = PageSet()  # keys found that this replay never wrote
        self.hidden_misses = 0  # existence queries cut short by a write not yet complete

    # -- what the replay reports -----------------------------------------------------------
    @property
    def foreign_pages(self) -> int:
        """Distinct pages found in storage that this replay did not write."""
        return len(self._foreign)

    @property
    def written_pages(self) -> int:
        return len(self._written)

    # -- the backend protocol --------------------------------------------------------------
    @property
    def layout(self) -> Any:
        return self._backend.layout

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self._backend.stats()
        return out

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        n = int(await self._backend.exists_prefix(keys))
        if self._hidden and n:
            now = self._clock()
            for i in range(n):
                at = self._hidden.get(keys[i])
                if at is None:
                    continue
                if at <= now:
                    del self._hidden[keys[i]]
                else:
                    self.hidden_misses += 1
                    n = i
                    break
        if n:
            ids = _key_ids(keys[:n])
            mine = self._written.contains(ids)
            if not mine.all():
                self._foreign.add(np.unique(ids[~mine]))
        return n

    async def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        ok: list[bool] = list(await self._backend.get_batch(keys, buffers))
        if self._hidden:
            now = self._clock()
            for i, k in enumerate(keys):
                at = self._hidden.get(k)
                if at is not None and at > now:
                    ok[i] = False
        return ok

    async def set_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        ok: list[bool] = list(await self._backend.set_batch(keys, buffers))
        done = [k for k, good in zip(keys, ok, strict=True) if good]
        if not done:
            return ok
        ids = _key_ids(done)
        if self._bandwidth:
            seen = self._written.contains(ids)
            fresh = [k for k, s in zip(done, seen, strict=True) if not s or k in self._hidden]
            if fresh:
                nbytes = sum(_nbytes(b) for k, b, good in zip(keys, buffers, ok, strict=True)
                             if good)
                self._busy_until = max(self._busy_until, self._clock()) + nbytes / self._bandwidth
                for k in fresh:
                    self._hidden[k] = min(self._hidden.get(k, self._busy_until),
                                          self._busy_until)
        self._written.add(np.unique(ids))
        return ok

    async def delete(self, keys: Sequence[str]) -> int:
        return int(await self._backend.delete(keys))

    async def clear(self) -> int:
        self._hidden.clear()
        return int(await self._backend.clear())

    async def aclose(self) -> None:
        await self._backend.aclose()


def _nbytes(buf: Any) -> int:
    n = getattr(buf, "nbytes", None)
    if n is None:
        n = memoryview(buf).nbytes
    return int(n)
