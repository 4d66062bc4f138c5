"""Hybrid (SWA / Mamba) storage prefetches on several ranks: every decision agreed at ticks.

One rank's view of storage can differ from another's (each TP rank stores its own KV, SWA
pages and states; an object can be missing or unreadable on one rank only), and its reads finish
at other times. So everything a hybrid prefetch changes in the tree or the pools is decided at
agreement ticks (:mod:`asynccache.ranks.agreement`), from values reduced over the ranks:

* **restorable hit**: each rank reports the deepest restorable prefix of its KV hit. When the
  ranks' answers differ, the MIN is a candidate only (it need not be restorable on the ranks that
  found a deeper one): every rank asks again with that limit, and so on until every rank reports
  the same prefix (MIN == MAX) or the MIN falls below the prefetch threshold (revoked). Then the
  KV host memory is allocated exactly as for FULL caches;
* **components**: while the KV pages arrive, each rank reports ``cand``, the deepest restorable
  prefix within its arrived pages (deeper than the components held; 0: none). When no component
  read is in flight and the MIN of ``cand`` is deeper than the held components, that prefix
  becomes the agreed *target*: its SWA-window and state host slots are allocated at the tick
  (evicting host copies, or giving the held components up, exactly alike on every rank) and each
  rank reads its own objects into them. A later tick retires the target once every rank
  finished: held on every rank -> it replaces the held components; failed on some rank (an
  object missing or unreadable there) -> its slots are freed everywhere and no rank proposes it
  again (every rank searches its ``cand`` anew, skipping failed targets), so every target is a
  new prefix and the protocol ends;
* **termination**: once the ranks agree to stop (as for FULL caches), ``cand`` is capped at the
  pages that arrived on every rank at that tick; targets go on until none is deeper than the held
  components. What is inserted is the prefix the held components restore (every rank holds the
  same), or nothing (below the threshold, or nothing held).

So the inserted length is the MIN over the ranks of each one's deepest restorable arrived
prefix (a rank whose component read failed contributes a shorter one), and every allocation,
eviction and free happens at the same tick in the same order on every rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import numpy as np

from asynccache.l3.hybrid import HybridStorage, mamba_object, swa_object
from asynccache.l3.op import FAILED, FETCHING, HELD, PrefetchOp
from asynccache.logs import get_logger
from asynccache.ranks import Agreement

_log = get_logger("l3_hybrid")


class PrefetchRunner(Protocol):
    """What the agreed protocol needs of the storage tier that runs the prefetches."""

    backend: Any
    page_size: int

    @property
    def agreement(self) -> Agreement | None: ...

    def floor_pages(self) -> int: ...

    async def read_hit(self, op: PrefetchOp, want: int,
                       between: Callable[[], Awaitable[None]] | None = None) -> None: ...

    def run_main(self, op: PrefetchOp, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as ``op``'s main task (its query, then its read)."""

    def run_side(self, op: PrefetchOp, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a side task of ``op`` (stopped with it)."""

    def cancel_main(self, op: PrefetchOp) -> None:
        """Cancel ``op``'s main task."""


class AgreedComponents:
    """The agreed component protocol of one hybrid cache's multi-rank prefetches."""

    def __init__(self, storage: PrefetchRunner, hybrid: HybridStorage) -> None:
        self.storage = storage
        self.hy = hybrid

    def _progress(self) -> None:
        agree = self.storage.agreement
        if agree is not None:
            agree.note_progress()

    def _side(self, op: PrefetchOp, coro: Coroutine[Any, Any, None]) -> None:
        self.storage.run_side(op, coro)

    # ------------------------------------------------------------------ restorable hit
    def converged(self, op: PrefetchOp, lo: int, hi: int) -> bool:
        """Whether the ranks' restorable hits (MIN ``lo``, MAX ``hi``) are agreed; if not,
        every rank asks again, limited to ``lo`` (identical on every rank)."""
        if lo < self.storage.floor_pages() or lo == hi:
            op.hy.restorable_pages = lo
            return True
        op.local_hit = -1
        self.storage.run_main(op, self._requery(op, lo))
        return False

    async def _requery(self, op: PrefetchOp, limit: int) -> None:
        try:
            p = await self.hy.restorable(self.storage.backend, op, limit,
                                         self.storage.floor_pages())
        except Exception as exc:  # a storage fault: nothing restorable here
            _log.warning("prefetch_query_failed", error=repr(exc))
            p = 0
        self.hy.note_fallback(op, "not_stored", limit, p)
        op.local_hit = p
        self._progress()

    # ------------------------------------------------------------------ transfer
    def start(self, op: PrefetchOp) -> None:
        """The KV read of ``op``'s agreed ``want_pages`` pages begins (at a tick)."""
        op.hy.cap = op.want_pages
        if op.want_pages < op.hy.restorable_pages:
            self.hy.note_fallback(op, "host_memory", op.hy.restorable_pages, op.want_pages)
        self.storage.run_main(op, self._read(op))

    async def _read(self, op: PrefetchOp) -> None:
        try:
            await self.storage.read_hit(op, op.want_pages, lambda: self.refresh(op))
        finally:
            # what may be restored now (also after a failed or cancelled read)
            if not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                await self.refresh(op)

    async def refresh(self, op: PrefetchOp) -> None:
        """Find this rank's ``cand``: the deepest restorable prefix within the arrived pages
        (at most ``op.hy.cap``) deeper than the held components, 0 if none; -1 meanwhile."""
        op.hy.cand_gen += 1
        gen = op.hy.cand_gen
        op.hy.cand = -1
        limit = min(op.completed_tokens // self.storage.page_size, op.hy.cap)
        lowest = max(self.storage.floor_pages(), op.hy.parts_pages + 1)
        try:
            found = 0
            while limit >= lowest:  # the deepest one that is no failed target
                p = await self.hy.restorable(self.storage.backend, op, limit, lowest)
                if p not in op.hy.failed_targets:
                    found = p
                    break
                limit = p - 1
        except Exception as exc:  # a storage fault: nothing deeper found here
            _log.warning("prefetch_component_query_failed", error=repr(exc))
            found = 0
        if gen == op.hy.cand_gen:  # not superseded by a later search
            op.hy.cand = found
        self._progress()

    def entry(self, op: PrefetchOp) -> tuple[int, int]:
        """This rank's ``cand`` and target state for a tick."""
        if op.phase not in ("transfer", "stopping"):
            return 0, HELD
        return op.hy.cand, op.hy.target_status if op.hy.target else HELD

    def apply(self, op: PrefetchOp, cand: int, status: int) -> None:
        """A tick's reduced ``cand`` and target state (identical on every rank)."""
        if op.hy.target:
            if status == FETCHING:  # some rank is still reading it
                return
            parts, op.hy.parts_new = op.hy.parts_new, None
            if status == HELD:  # every rank holds it: it replaces the held components
                self.hy._give(op.hy.parts, free=True)
                op.hy.parts, op.hy.parts_pages = parts, op.hy.target
                op.hy.target = 0
            else:  # no rank searches it again; every rank's cand may be it: search again
                self.hy._give(parts, free=True)
                op.hy.failed_targets.add(op.hy.target)
                op.hy.target = 0
                self._side(op, self.refresh(op))  # cand is -1 from here on
                return
        if op.hy.blocked or cand <= op.hy.parts_pages or (cand == op.hy.no_room
                                                     and op.phase == "transfer"):
            return
        parts = self._alloc(op, cand)
        if parts is None:  # no host slots for the components: keep what is held
            if op.phase == "stopping":  # nothing more arrives: give up deeper ones
                op.hy.blocked = True
                self.hy.note_fallback(op, "host_memory", cand, op.hy.parts_pages)
            else:  # try again for another cand (host copies may be evictable by then)
                op.hy.no_room = cand
            return
        op.hy.parts_new, op.hy.target, op.hy.target_status = parts, cand, FETCHING
        self._side(op, self._fetch(op, cand, parts))

    def _alloc(self, op: PrefetchOp, p: int) -> dict[str, np.ndarray] | None:
        """Host slots for the components of the ``p``-page prefix; when short, the held
        components are given up for them (at a tick: alike on every rank)."""
        hy = self.hy
        ps = self.storage.page_size
        want = {}
        if hy.swa:
            want["swa"] = min(p, hy.window_pages) * ps
        if hy.mamba:
            want["mamba"] = 1
        for retry in (False, True):
            got: dict[str, np.ndarray] = {}
            for name, n in want.items():
                slots = hy.tier.take_host(name, n, hy.evict_host)
                if slots is None:
                    break
                got[name] = slots
            if len(got) == len(want):
                return got
            hy._give(got, free=True)
            if retry or not op.hy.parts:
                return None
            hy._give(op.hy.parts, free=True)
            op.hy.parts, op.hy.parts_pages = None, 0
        return None

    async def _fetch(self, op: PrefetchOp, p: int, parts: dict[str, np.ndarray]) -> None:
        try:
            ok = await self.hy.read_into(op, self.storage.backend, p, parts)
        except Exception as exc:  # a storage fault: the prefix counts as not stored here
            _log.warning("prefetch_component_read_failed", error=repr(exc))
            ok = False
            last = op.keys[p - 1]
            op.hy.stored[mamba_object(last) if "mamba" in parts else swa_object(last)] = False
        op.hy.target_status = HELD if ok else FAILED
        self._progress()

    # ------------------------------------------------------------------ termination
    def stop(self, op: PrefetchOp, pages: int) -> None:
        """The ranks agreed to stop with ``pages`` pages arrived everywhere: restore no deeper."""
        op.phase = "stopping"
        op.hy.cap = min(op.hy.cap, pages)
        # Pages past the cap are not needed: stop reading them (the first ``cap`` arrived here
        # already).
        self.storage.cancel_main(op)
        self._side(op, self.refresh(op))

    def settled(self, op: PrefetchOp, cand: int) -> bool:
        """Stopping and nothing deeper left to fetch: insert the held components' prefix."""
        if op.hy.target or not (op.hy.blocked or 0 <= cand <= op.hy.parts_pages):
            return False
        reason = "fault" if op.hy.failed_targets else "stopped"
        self.hy.note_fallback(op, reason, op.want_pages, op.hy.parts_pages)
        return True
