"""Storage (L3) objects of hybrid caches: the SWA pages and Mamba states next to the KV pages.

Names: ``<page key>.swa`` for the SWA KV of a page, ``<key of a node's last page>.mamba`` for
the state after that page. A backup writes them with the node's KV pages.

A prefetch restores the longest *restorable* prefix (the largest prefix that every pool can
restore; where this differs from the reference system, docs/differences.md says why). A prefix of ``p`` pages is
restorable when its KV pages are stored, ``<key p-1>.mamba`` is stored (Mamba) and the ``.swa``
pages of its last window are stored (SWA; a prefix shorter than the window needs all of its
pages). States exist only at node ends, so:

* the hit query trims the KV hit to the deepest restorable prefix (existence queries, deepest
  first: the state at the hit's end alone and its SWA window in one call, which is the usual
  answer, then concurrent chunks of single-object queries); only that prefix is read, and
  below the prefetch threshold the prefetch is revoked like a short hit;
* host memory for a shorter prefix only: it is cut back to its deepest restorable prefix
  before anything is read;
* after each KV batch but the last, and once the read is over, the components of the deepest
  restorable prefix that has arrived are fetched (deeper ones replace the held ones only once
  all of them arrived; a component pool too small for both gives the held ones up first).
  When the KV read ends early (a ``best_effort`` / ``timeout`` stop, a failed page read) the
  deepest restorable prefix within what arrived is inserted, if it still reaches the threshold
  (a stop fetches its components itself if they are not held yet); the KV pages past it are
  freed;
* a component object that cannot be read (missing, corrupt, a backend error) counts as not
  stored: the prefetch falls back to the next shallower restorable prefix, or inserts nothing.

What is inserted is always a prefix whose KV pages, SWA window and state all arrived and were
verified. On several ranks the names carry the rank like the KV pages' (the backend's layout),
and the steps above that touch the tree or a pool are agreed at ticks instead
(:mod:`asynccache.l3.hybrid_ranks`); the existence searches and reads here are shared. Every
fallback is a ``prefetch_component_fallback`` log event and adds the KV tokens given up to
``asynccache_prefetch_component_fallback_tokens``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch

from asynccache.engine import Tiering
from asynccache.l3.op import PrefetchOp
from asynccache.l3.pages import keep_pages, page_buffers
from asynccache.logs import get_logger

if TYPE_CHECKING:
    from asynccache.engine.hybrid_tier import HybridTier

_log = get_logger("l3_hybrid")

def swa_object(key: str) -> str:
    """The storage name of the SWA KV of page ``key``."""
    return f"{key}.swa"


def mamba_object(key: str) -> str:
    """The storage name of the Mamba state after page ``key``."""
    return f"{key}.mamba"


#: Component objects asked about at once (concurrently) once the deepest candidate failed.
STORED_QUERY_CHUNK: Final = 16


class HybridStorage:
    """Component objects of one hybrid cache's storage tier."""

    def __init__(self, tiering: Tiering) -> None:
        parts = tiering.parts
        assert parts.hybrid is not None and parts.hybrid.tier is not None
        self._t = tiering
        self._parts = parts
        self.tier: HybridTier = parts.hybrid.tier
        self.swa = self.tier.swa_host is not None
        self.mamba = self.tier.mamba_host is not None
        self._ps = ps = tiering.page_size
        self.window_pages = -(-parts.config.sliding_window // ps) if self.swa else 0
        # Sidecars of the SWA pool and of the state pool: their objects go with the node's
        # .swa pages / .mamba state, and a component counts as stored only with them.
        self._swa_sidecars = parts.sidecars.stored_with("swa")
        self._state_sidecars = parts.sidecars.stored_with("mamba")

    def evict_host(self, num_tokens: int) -> int:
        """Evict host copies for a component allocation (:class:`ClosedError` once the cache
        is no longer running: nothing may be evicted then)."""
        self._parts.life.check_open()
        return self._t.evict_host(num_tokens)

    # ------------------------------------------------------------------ write
    def node_objects(self, nid: int, keys: list[str]) -> tuple[list[str], list[torch.Tensor]]:
        """Keys and (copied) bytes of ``nid``'s component host copies."""
        tree = self._t.tree
        out_k: list[str] = []
        out_b: list[torch.Tensor] = []
        ps = self._ps
        if self.swa:
            host = tree.component_host_slots_of(nid, "swa")
            if host is not None:
                assert self.tier.swa_host is not None
                for i, first in enumerate(host[::ps].tolist()):
                    out_k.append(swa_object(keys[i]))
                    out_b.append(self.tier.swa_host.read_page(first))
                    for sc in self._swa_sidecars:
                        out_k.append(sc.object_name(keys[i]))
                        out_b.append(sc.host_pool.read_page(first))
        if self.mamba:
            state = tree.component_host_slots_of(nid, "mamba")
            if state is not None:
                assert self.tier.mamba_host is not None
                out_k.append(mamba_object(keys[-1]))
                row = self.tier.mamba_host.states[int(state[0])].contiguous()
                out_b.append(row.view(torch.uint8).reshape(-1).clone())
                for sc in self._state_sidecars:
                    out_k.append(sc.object_name(keys[-1]))
                    out_b.append(sc.host_pool.read_page(int(state[0])))
        return out_k, out_b

    # ------------------------------------------------------------------ restorable prefix
    async def restorable(self, backend: Any, op: PrefetchOp, limit: int, floor: int) -> int:
        """Pages of the longest restorable prefix of ``op.keys[:limit]``; 0 if it is shorter
        than ``floor`` pages. Searched deepest first; what storage said about a component
        object is remembered on ``op`` (an object that could not be read counts as missing)."""
        floor = max(floor, 1)
        p = limit
        span = self.window_pages  # the first window alone, then chunks of the pages below
        while p >= floor:
            if self.mamba:
                p = await self._deepest_state(backend, op, p, floor)
                if not p:
                    return 0
            if self.swa:
                lo = max(0, p - self.window_pages)
                ask = [swa_object(k) for k in reversed(op.keys[max(0, p - span) : p])]
                if span == self.window_pages:  # usually all stored: one call for the window
                    await self._exists_run(backend, op, ask)
                else:
                    await self._exists(backend, op, ask)
                # the deepest page of the window not stored (those above it are known stored)
                miss = next((i for i in range(p - 1, lo - 1, -1)
                             if not op.hy.stored[swa_object(op.keys[i])]), None)
                if miss is not None:  # try the prefix ending before it
                    p = miss
                    span = max(self.window_pages, STORED_QUERY_CHUNK)
                    continue
            return p
        return 0

    async def _deepest_state(self, backend: Any, op: PrefetchOp, limit: int, floor: int) -> int:
        """The largest ``q`` in [floor, limit] with ``<key q-1>.mamba`` stored, else 0. The
        deepest candidate is asked alone (the usual answer), then chunks of candidates."""
        hi = limit
        size = 1
        while hi >= floor:
            cands = list(range(hi, max(floor, hi - size + 1) - 1, -1))
            names = [mamba_object(op.keys[q - 1]) for q in cands]
            await self._exists(backend, op, names)
            for q, name in zip(cands, names, strict=True):
                if op.hy.stored[name]:
                    return q
            hi = cands[-1] - 1
            size = STORED_QUERY_CHUNK
        return 0

    async def _exists(self, backend: Any, op: PrefetchOp, names: list[str]) -> None:
        """Ask storage which of ``names`` it holds (those not asked yet), concurrently."""
        todo = [n for n in names if n not in op.hy.stored]
        if not todo:
            return
        if len(todo) == 1:
            op.hy.stored[todo[0]] = bool(await backend.exists_prefix(todo))
            return
        async with asyncio.TaskGroup() as tg:
            asks = [tg.create_task(backend.exists_prefix([n])) for n in todo]
        for name, a in zip(todo, asks, strict=True):
            op.hy.stored[name] = bool(a.result())

    async def _exists_run(self, backend: Any, op: PrefetchOp, names: list[str]) -> None:
        """One ``exists_prefix`` call for the ``names`` not asked yet before the first known
        missing one: those stored up to the first missing one become known, and that one."""
        todo: list[str] = []
        for n in names:
            known = op.hy.stored.get(n)
            if known is False:
                break
            if known is None:
                todo.append(n)
        if not todo:
            return
        found = await backend.exists_prefix(todo)
        for n in todo[:found]:
            op.hy.stored[n] = True
        if found < len(todo):
            op.hy.stored[todo[found]] = False

    async def query(self, op: PrefetchOp, backend: Any, hit: int, floor: int) -> int:
        """Trim the KV ``hit`` (pages) to its restorable prefix (0: below ``floor`` pages)."""
        if hit < max(floor, 1):
            return hit  # a short hit anyway: revoked without asking for components
        p = await self.restorable(backend, op, hit, floor)
        op.hy.restorable_pages = p
        if p < hit:
            self.note_fallback(op, "not_stored", hit, p)
        return p

    def note_fallback(self, op: PrefetchOp, reason: str, from_pages: int, to_pages: int) -> None:
        """Log and count a fallback from a ``from_pages`` to a ``to_pages`` prefix. Reasons:
        ``not_stored`` (the hit query), ``host_memory`` (host memory or the prefetch capacity
        for a shorter prefix only, or no host slots for the components), ``stopped`` (the KV
        read ended early) and ``fault`` (a component object could not be read)."""
        if to_pages >= from_pages:
            return
        ps = self._ps
        self._parts.metrics.prefetch_component_fallback_tokens.labels(reason=reason).inc(
            (from_pages - to_pages) * ps)
        log = _log.warning if reason == "fault" else _log.info
        log("prefetch_component_fallback", reason=reason, from_tokens=from_pages * ps,
            to_tokens=to_pages * ps, start=op.start)

    # ------------------------------------------------------------------ prefetch
    async def fetch(self, op: PrefetchOp, backend: Any, floor: int, *, final: bool = True) -> None:
        """Hold in host slots recorded on ``op`` the SWA window and state of the deepest
        restorable prefix within ``op``'s arrived KV pages (``op.hy.parts_pages`` says which
        prefix the held ones restore; 0: none). Held parts are replaced only by deeper ones
        that all arrived, so a fetch that fails or is cancelled keeps the previous ones.

        ``final=False``: between KV batches (a prefetch stopped later inserts what is held);
        ``final=True``: the KV read is over, fallbacks are counted and later calls return."""
        if op.hy.parts_settled:
            return
        arrived = op.completed_tokens // self._ps
        p = op.hy.restorable_pages
        if p > arrived:  # only a prefix deeper than the held one is worth a search
            lowest = max(floor, op.hy.parts_pages + 1)
            found = await self.restorable(backend, op, arrived, lowest) if arrived >= lowest else 0
            p = max(found, op.hy.parts_pages)
            if final:
                self.note_fallback(op, "stopped", arrived, p)
        first, reason = p, "fault"
        while p > op.hy.parts_pages:
            got = await self._get(op, backend, p)
            if got:
                break
            if got is None:  # no host memory for the components: keep what is held
                reason = "host_memory"
                break
            lowest = max(floor, op.hy.parts_pages + 1)
            p = await self.restorable(backend, op, p, lowest) if p >= lowest else 0
        if final:
            if op.hy.parts_pages < first:
                self.note_fallback(op, reason, first, op.hy.parts_pages)
            op.hy.parts_settled = True

    async def _get(self, op: PrefetchOp, backend: Any, p: int) -> bool | None:
        """Read the components of the ``p``-page prefix into new host slots; they become the
        held parts when all came (True). False: one did not (it counts as missing from now
        on); None: host memory is short. Nothing new is held then."""
        ps = self._ps
        parts: dict[str, np.ndarray] = {}
        op.hy.parts_new = parts
        try:
            if self.swa:
                slots = self._take(op, "swa", min(p, self.window_pages) * ps)
                if slots is None:
                    return None
                parts["swa"] = slots
            if self.mamba:
                slots = self._take(op, "mamba", 1)
                if slots is None:
                    return None
                parts["mamba"] = slots
            if not await self.read_into(op, backend, p, parts):
                return False
            self._give(op.hy.parts, free=True)  # the shallower parts held so far
            op.hy.parts, op.hy.parts_pages, parts = parts, p, {}
            return True
        finally:  # what did not become the held parts (a cancel lands here too)
            self._give(parts, free=True)
            op.hy.parts_new = None

    async def read_into(self, op: PrefetchOp, backend: Any, p: int,
                        parts: dict[str, np.ndarray]) -> bool:
        """Read the SWA window and the state of the ``p``-page prefix into the host slots
        ``parts`` (one slot group per component pool), all or nothing, in one backend call.
        False when one object did not come (it counts as missing on ``op`` from now on); the
        slots then hold nothing meaningful.

        (Not :func:`~asynccache.l3.pages.read_run`: the objects span two pools, the state is no
        page, and a prefix counts only when all of them arrived, not a leading run.)"""
        ps = self._ps
        keys = op.keys[:p]
        want_k: list[str] = []
        source: list[str] = []  # per object: the component object it goes with
        bufs: list[torch.Tensor] = []
        pools: list[tuple[Any, np.ndarray, int, int]] = []  # (pool, slots, first buf, pages)
        if "swa" in parts:
            assert self.tier.swa_host is not None
            w = len(parts["swa"]) // ps
            names = [swa_object(k) for k in keys[p - w :]]
            for pool, objs in ((self.tier.swa_host, names),
                               *((sc.host_pool, [sc.object_name(k) for k in keys[p - w :]])
                                 for sc in self._swa_sidecars)):
                pools.append((pool, parts["swa"], len(bufs), w))
                want_k += objs
                source += names
                bufs += page_buffers(pool, parts["swa"], fill=False)
        state_buf = -1
        if "mamba" in parts:
            assert self.tier.mamba_host is not None
            row = self.tier.mamba_host.states[0]
            name = mamba_object(keys[-1])
            want_k.append(name)
            source.append(name)
            state_buf = len(bufs)
            bufs.append(torch.empty(row.numel() * row.element_size(), dtype=torch.uint8))
            for sc in self._state_sidecars:
                pools.append((sc.host_pool, parts["mamba"], len(bufs), 1))
                want_k.append(sc.object_name(keys[-1]))
                source.append(name)
                bufs += page_buffers(sc.host_pool, parts["mamba"], fill=False)
        ok = await backend.get_batch(want_k, bufs)
        if not all(ok):
            for k, src, good in zip(want_k, source, ok, strict=True):
                if not good:  # a sidecar's object missing: its component counts as missing
                    op.hy.stored[k] = op.hy.stored[src] = False
            return False
        for pool, slots, first, pages in pools:
            keep_pages(pool, slots, bufs[first : first + pages], pages)
        if "mamba" in parts:
            assert self.tier.mamba_host is not None
            dst = self.tier.mamba_host.states[int(parts["mamba"][0])]
            dst.view(-1).view(torch.uint8).copy_(bufs[state_buf])
        return True

    def _take(self, op: PrefetchOp, name: str, n: int) -> np.ndarray | None:
        """``n`` host slots of pool ``name`` for a deeper prefix's components; when short, the
        shallower held parts are given up for them (a later fault searches again)."""
        slots: np.ndarray | None = self.tier.take_host(name, n, self.evict_host)
        if slots is None and op.hy.parts:
            self._give(op.hy.parts, free=True)
            op.hy.parts, op.hy.parts_pages = None, 0
            slots = self.tier.take_host(name, n, self.evict_host)
        return slots

    def _give(self, parts: dict[str, np.ndarray] | None, *, free: bool) -> None:
        for name, slots in (parts or {}).items():
            self.tier.give_host(name, slots, free=free)

    def insert_args(self, op: PrefetchOp, done: int) -> tuple[int, dict[str, Any]]:
        """Tokens to insert of ``done`` arrived ones (the prefix the fetched components
        restore; 0: none) and the ``insert_host`` keywords for them."""
        ps = self._ps
        end = op.hy.parts_pages * ps
        if not end or end > done or op.hy.parts is None:
            return 0, {}
        out: dict[str, Any] = {}
        swa = op.hy.parts.get("swa")
        if swa is not None:
            full = np.full(end, -1, dtype=np.int64)
            full[end - len(swa) :] = swa
            out["swa_host_slots"] = full
        state = op.hy.parts.get("mamba")
        if state is not None:
            out["mamba_host_slot"] = int(state[0])
        return end, out

    def release(self, op: PrefetchOp, *, inserted: bool) -> None:
        """The op's component host slots leave flight (the held parts are kept by the tree if
        ``inserted``)."""
        self._give(op.hy.parts, free=not inserted)
        self._give(op.hy.parts_new, free=True)
        op.hy.parts = op.hy.parts_new = None
        op.hy.parts_pages = 0
