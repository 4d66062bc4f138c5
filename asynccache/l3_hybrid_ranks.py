"""Hybrid (SWA / Mamba) storage prefetches on several ranks: every decision agreed at ticks.

One rank's view of storage can differ from another's (each TP rank stores its own KV, SWA
pages and states; an object can be missing or unreadable on one rank only), and its reads finish
at other times. So everything a hybrid prefetch changes in the tree or the pools is decided at
agreement ticks (:mod:`asynccache.agreement`), from values reduced over the ranks:

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
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from asynccache.l3_hybrid import mamba_object, swa_object
from asynccache.logs import get_logger

if TYPE_CHECKING:
    from asynccache.l3 import PrefetchOp, StorageTier
    from asynccache.l3_hybrid import HybridStorage

_log = get_logger("l3_hybrid")

#: A rank's state of the current target in a tick entry (reduced by MIN): reading it,
#: could not read one of its objects, or holds it (also: no target).
FETCHING: Final = 0
FAILED: Final = 1
HELD: Final = 2


class AgreedComponents:
    """The agreed component protocol of one hybrid cache's multi-rank prefetches."""

    def __init__(self, storage: StorageTier, hybrid: HybridStorage) -> None:
        self.storage = storage
        self.hy = hybrid

    def _progress(self) -> None:
        agree = self.storage.cache._agree
        if agree is not None:
            agree.note_progress()

    def _side(self, op: PrefetchOp, coro: Coroutine[Any, Any, None]) -> None:
        op.side.append(asyncio.get_running_loop().create_task(coro))

    # ------------------------------------------------------------------ restorable hit
    def converged(self, op: PrefetchOp, lo: int, hi: int) -> bool:
        """Whether the ranks' restorable hits (MIN ``lo``, MAX ``hi``) are agreed; if not,
        every rank asks again, limited to ``lo`` (identical on every rank)."""
        if lo < self.storage._floor_pages() or lo == hi:
            op.restorable_pages = lo
            return True
        op.local_hit = -1
        op.task = asyncio.get_running_loop().create_task(self._requery(op, lo))
        return False

    async def _requery(self, op: PrefetchOp, limit: int) -> None:
        try:
            p = await self.hy.restorable(self.storage.backend, op, limit,
                                         self.storage._floor_pages())
        except Exception as exc:  # a storage fault: nothing restorable here
            _log.warning("prefetch_query_failed", error=repr(exc))
            p = 0
        self.hy.note_fallback(op, "not_stored", limit, p)
        op.local_hit = p
        self._progress()

    # ------------------------------------------------------------------ transfer
    def start(self, op: PrefetchOp) -> None:
        """The KV read of ``op``'s agreed ``want_pages`` pages begins (at a tick)."""
        op.cap = op.want_pages
        if op.want_pages < op.restorable_pages:
            self.hy.note_fallback(op, "host_memory", op.restorable_pages, op.want_pages)
        op.task = asyncio.get_running_loop().create_task(self._read(op))

    async def _read(self, op: PrefetchOp) -> None:
        try:
            await self.storage._read(op, op.want_pages, lambda: self.refresh(op))
        finally:
            # what may be restored now (also after a failed or cancelled read)
            if not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                await self.refresh(op)

    async def refresh(self, op: PrefetchOp) -> None:
        """Find this rank's ``cand``: the deepest restorable prefix within the arrived pages
        (at most ``op.cap``) deeper than the held components, 0 if none; -1 meanwhile."""
        op.cand_gen += 1
        gen = op.cand_gen
        op.cand = -1
        limit = min(op.completed_tokens // self.storage.cache.page_size, op.cap)
        lowest = max(self.storage._floor_pages(), op.parts_pages + 1)
        try:
            found = 0
            while limit >= lowest:  # the deepest one that is no failed target
                p = await self.hy.restorable(self.storage.backend, op, limit, lowest)
                if p not in op.failed_targets:
                    found = p
                    break
                limit = p - 1
        except Exception as exc:  # a storage fault: nothing deeper found here
            _log.warning("prefetch_component_query_failed", error=repr(exc))
            found = 0
        if gen == op.cand_gen:  # not superseded by a later search
            op.cand = found
        self._progress()

    def entry(self, op: PrefetchOp) -> tuple[int, int]:
        """This rank's ``cand`` and target state for a tick."""
        if op.phase not in ("transfer", "stopping"):
            return 0, HELD
        return op.cand, op.target_status if op.target else HELD

    def apply(self, op: PrefetchOp, cand: int, status: int) -> None:
        """A tick's reduced ``cand`` and target state (identical on every rank)."""
        if op.target:
            if status == FETCHING:  # some rank is still reading it
                return
            parts, op.parts_new = op.parts_new, None
            if status == HELD:  # every rank holds it: it replaces the held components
                self.hy._give(op.parts, free=True)
                op.parts, op.parts_pages = parts, op.target
                op.target = 0
            else:  # no rank searches it again; every rank's cand may be it: search again
                self.hy._give(parts, free=True)
                op.failed_targets.add(op.target)
                op.target = 0
                self._side(op, self.refresh(op))  # cand is -1 from here on
                return
        if op.blocked or cand <= op.parts_pages or (cand == op.no_room
                                                     and op.phase == "transfer"):
            return
        parts = self._alloc(op, cand)
        if parts is None:  # no host slots for the components: keep what is held
            if op.phase == "stopping":  # nothing more arrives: give up deeper ones
                op.blocked = True
                self.hy.note_fallback(op, "host_memory", cand, op.parts_pages)
            else:  # try again for another cand (host copies may be evictable by then)
                op.no_room = cand
            return
        op.parts_new, op.target, op.target_status = parts, cand, FETCHING
        self._side(op, self._fetch(op, cand, parts))

    def _alloc(self, op: PrefetchOp, p: int) -> dict[str, np.ndarray] | None:
        """Host slots for the components of the ``p``-page prefix; when short, the held
        components are given up for them (at a tick: alike on every rank)."""
        hy = self.hy
        ps = self.storage.cache.page_size
        want = {}
        if hy.swa:
            want["swa"] = min(p, hy.window_pages) * ps
        if hy.mamba:
            want["mamba"] = 1
        for retry in (False, True):
            got: dict[str, np.ndarray] = {}
            for name, n in want.items():
                slots = hy.tier.take_host(name, n, self.storage.cache.evict_host)
                if slots is None:
                    break
                got[name] = slots
            if len(got) == len(want):
                return got
            hy._give(got, free=True)
            if retry or not op.parts:
                return None
            hy._give(op.parts, free=True)
            op.parts, op.parts_pages = None, 0
        return None

    async def _fetch(self, op: PrefetchOp, p: int, parts: dict[str, np.ndarray]) -> None:
        try:
            ok = await self.hy.read_into(op, self.storage.backend, p, parts)
        except Exception as exc:  # a storage fault: the prefix counts as not stored here
            _log.warning("prefetch_component_read_failed", error=repr(exc))
            ok = False
            last = op.keys[p - 1]
            op.stored[mamba_object(last) if "mamba" in parts else swa_object(last)] = False
        op.target_status = HELD if ok else FAILED
        self._progress()

    # ------------------------------------------------------------------ termination
    def stop(self, op: PrefetchOp, pages: int) -> None:
        """The ranks agreed to stop with ``pages`` pages arrived everywhere: restore no deeper."""
        op.phase = "stopping"
        op.cap = min(op.cap, pages)
        if op.task is not None:  # pages past the cap are not needed: stop reading them
            op.task.cancel()  # (the first ``cap`` arrived here already)
        self._side(op, self.refresh(op))

    def settled(self, op: PrefetchOp, cand: int) -> bool:
        """Stopping and nothing deeper left to fetch: insert the held components' prefix."""
        if op.target or not (op.blocked or 0 <= cand <= op.parts_pages):
            return False
        reason = "fault" if op.failed_targets else "stopped"
        self.hy.note_fallback(op, reason, op.want_pages, op.parts_pages)
        return True
