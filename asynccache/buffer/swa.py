"""The SWA side of the buffer-only host mode (FULL+SWA caches).

A FULL+SWA cache in buffer-only mode stores, next to each KV page ``<key>``, the page's
sliding-window KV as the object ``<key>.swa`` (the names of :mod:`asynccache.l3.hybrid`, so a
store written in cache mode reads in buffer-only mode and the other way round).

* **Writes.** An intent covers its node's KV pages and the pages of it that are still SWA-live
  on the device (a page whose FULL slots still have their SWA pairs; SWA tombstones have no
  SWA to write). Only pages whose SWA the write's lock pins are taken: the lock of the intent's
  node pins that whole node and its ancestors up to one window, so a node split after its
  intent was queued may leave the SWA of its upper fragments to a later intent. The SWA pages
  are copied D->H into the host SWA pool (operation-owned staging, like the KV staging) and
  written when the copy lands; the staging is freed when the storage write returns.
* **Existence.** A separate :class:`~asynccache.l3.existence.StorageExistenceCache` tracks
  which ``.swa`` objects are believed stored: a page's KV being stored says nothing about its
  SWA. Its heal policy is the trailing-window one, as in the reference system (see
  docs/differences.md): a short window query invalidates, a whole one adds nothing (only a
  successful write does).
* **Reads.** A hit needs the SWA of the trailing window only, as in the reference
  system (see docs/differences.md). :meth:`SWABuffer.usable_pages` picks the longest
  prefix (of the KV hit) whose window's ``.swa`` objects all exist; the pages before the window
  are loaded as FULL KV only, below the SWA floor of the insert (SWA tombstones from birth).
  The load-back's device slots come from the engine's one allocation loop
  (``Tiering.alloc(n, swa_tokens)``: FULL slots for all, SWA pairs for the window only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from asynccache.engine import Tiering
from asynccache.errors import ConfigError
from asynccache.l3 import BATCH_PAGES, StorageExistenceCache, read_run, write_pages
from asynccache.l3.hybrid import swa_object
from asynccache.logs import get_logger
from asynccache.transfers.handles import CopyHandle

_log = get_logger("buffer_swa")

EMPTY = np.empty(0, dtype=np.int64)


class SWABuffer:
    """Host SWA staging, ``.swa`` objects and their existence beliefs of one pipeline."""

    def __init__(self, tiering: Tiering, backend: Any, existence_entries: int) -> None:
        parts = tiering.parts
        hy = parts.hybrid
        if hy is None or hy.swa_map is None or hy.tier is None or hy.tier.swa_host is None:
            raise ConfigError("buffer-only SWA staging needs an SWA component and host memory")
        if hy.mamba_pool is not None:
            raise ConfigError("Mamba is not supported in buffer_only host mode")
        self._t = tiering
        self._metrics = parts.metrics
        self.backend = backend
        self.map = hy.swa_map
        self.tier = hy.tier
        self.host = hy.tier.swa_host
        self.existence = StorageExistenceCache(existence_entries)
        ps = tiering.page_size
        self._ps = ps
        sliding_window = parts.config.sliding_window
        self.window_pages = -(-sliding_window // ps)
        self.window_span = self.window_pages * ps
        if self.host.num_slots < self.window_span:
            raise ConfigError(
                f"buffer_only host mode stages one SWA window per read: the host SWA pool "
                f"(swa_host_tokens={self.host.num_slots}) must hold at least {self.window_span} "
                f"tokens (sliding_window={sliding_window}, page-aligned)"
            )
        # Sidecars of the SWA pool: their objects (<page key>.<name>) go with each .swa page.
        self._sidecars = parts.sidecars.stored_with("swa")
        self.write_staged = 0  # host SWA slots held by writes
        self.read_held = 0  # host SWA slots held by read bounces

    # ------------------------------------------------------------------ host SWA slots
    @property
    def available(self) -> int:
        """Free host SWA slots."""
        return self.tier.host_available("swa")

    def take(self, num_tokens: int, *, read: bool) -> np.ndarray | None:
        """``num_tokens`` host SWA slots owned by an operation; None when the pool is short."""
        if not num_tokens:
            return EMPTY
        slots = self.tier.take_host("swa", num_tokens, lambda _n: 0)
        if slots is not None:
            if read:
                self.read_held += len(slots)
            else:
                self.write_staged += len(slots)
        return slots

    def give(self, slots: np.ndarray | None, *, read: bool) -> None:
        if slots is None or not len(slots):
            return
        self.tier.give_host("swa", slots, free=True)
        if read:
            self.read_held -= len(slots)
        else:
            self.write_staged -= len(slots)

    # ------------------------------------------------------------------ writes
    def write_pages(self, node_id: int, slots: np.ndarray, keys: Sequence[str]) -> list[int]:
        """Pages (indices into ``keys``, the span ``slots`` of ``node_id``'s path) whose SWA is
        live, pinned by a lock of ``node_id`` and not believed stored nor being written."""
        ps = self._ps
        pairs = self.map.full_to_swa[slots[: len(keys) * ps]].reshape(len(keys), ps)
        live = (pairs >= 0).all(axis=1)
        own = len(self._t.tree.node_page_keys(node_id))
        lo = max(0, len(keys) - max(own, self.window_pages))
        cand = [j for j in range(lo, len(keys)) if live[j]]
        if not cand:
            return []
        todo = self.existence.missing([keys[j] for j in cand])
        return [cand[i] for i in todo]

    def device_slots(self, full_slots: np.ndarray) -> np.ndarray:
        """The SWA device slots paired with ``full_slots`` (every one must be live)."""
        slots: np.ndarray = self.map.translate(full_slots)
        return slots

    def submit_d2h(self, device_slots: np.ndarray, host_slots: np.ndarray) -> CopyHandle:
        engine = self.tier.swa_engine
        assert engine is not None, "the cache is not started"
        return self._t.copies.track(engine.submit_d2h(device_slots, host_slots))

    def submit_h2d(self, host_slots: np.ndarray, device_slots: np.ndarray) -> CopyHandle:
        engine = self.tier.swa_engine
        assert engine is not None, "the cache is not started"
        return self._t.copies.track(engine.submit_h2d(host_slots, device_slots))

    async def store(self, keys: Sequence[str], host: np.ndarray, ok: list[bool]) -> None:
        """Write the staged SWA pages of ``keys`` as ``.swa`` objects; appends each outcome to
        ``ok`` as it arrives (the caller pads what a fault left out)."""
        ps = self._ps
        for i in range(0, len(keys), BATCH_PAGES):
            batch = keys[i : i + BATCH_PAGES]
            got = await write_pages(self.backend, self.host, [swa_object(k) for k in batch],
                                    host[i * ps : (i + len(batch)) * ps], self._sidecars,
                                    page_keys=batch)
            ok.extend(bool(g) for g in got)

    # ------------------------------------------------------------------ reads
    def window(self, pages: int) -> int:
        """The first page of the trailing window of a prefix of ``pages`` fetched pages."""
        return max(0, pages - self.window_pages)

    async def usable_pages(self, keys: Sequence[str], pages: int, min_pages: int) -> int:
        """The longest prefix of ``keys[:pages]`` (at least ``min_pages`` long, else 0) whose
        trailing window's ``.swa`` objects all exist in storage."""
        p = pages
        while p >= max(min_pages, 1):
            lo = self.window(p)
            window = list(keys[lo:p])
            found = await self.backend.exists_prefix([swa_object(k) for k in window])
            if found >= len(window):
                return p  # trailing-window policy: a query is never evidence to add
            self.existence.invalidate_beyond(window, found)
            self._metrics.hybrid_skipped.labels(op="swa_window").inc()
            _log.info("swa_window_missing", pages=p, missing=window[found])
            p = lo + found  # every window holding the missing page is broken
        return 0

    async def fetch_window(self, keys: Sequence[str], pages: int, min_pages: int,
                           host: np.ndarray) -> int:
        """Read the ``.swa`` window of the prefix ``keys[:pages]`` into ``host`` (from its
        start); on a missing or bad page fall back to the longest shorter prefix whose window
        reads whole (at least ``min_pages``). Returns the prefix's pages (0: none)."""
        ps = self._ps
        p = pages
        while p >= max(min_pages, 1):
            lo = self.window(p)
            names = [swa_object(k) for k in keys[lo:p]]
            good = await read_run(self.backend, self.host, names, host[: (p - lo) * ps],
                                  sidecars=self._sidecars, page_keys=keys[lo:p])
            if good == p - lo:
                return p
            self.existence.invalidate_beyond(list(keys[lo:p]), good)
            self._metrics.hybrid_skipped.labels(op="swa_window").inc()
            _log.info("swa_window_read_short", pages=p, missing=keys[lo + good])
            p = lo + good
        return 0

    def check(self) -> None:
        held = self.tier.inflight["swa"]
        if self.write_staged < 0 or self.read_held < 0 or \
                held != self.write_staged + self.read_held:
            raise AssertionError(
                f"host SWA staging: tier counts {held} in flight, writes hold "
                f"{self.write_staged}, reads {self.read_held}")
