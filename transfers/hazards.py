"""Host- and device-page hazards between copies of one engine.

A staged engine reads an H->D copy's host pages when it *issues* the copy (a CPU gather into
staging) but writes a D->H copy's host pages when the copy *completes* (a CPU scatter out of
staging, after the DMA). So an H->D submitted while an earlier D->H of the same host pages is
still running would load what those pages held before. The engine orders them instead of
trusting its caller: at submission (on the loop thread) a :class:`PageHazards` over host pages
finds the earlier copies still in flight that touch the same host pages --

* an H->D (reads host pages) depends on the pending D->H copies that write any of them;
* a D->H (writes host pages) depends on the pending H->D copies that read any of them --

and the worker waits, before it touches host memory, until each of those is done with its
host side (:meth:`~asynccache.transfers.workers.WorkerBase.wait_deps`). Two D->H copies of
the same host pages need nothing: both workers write host pages in submission order (the
direct worker copies one job after the other, the staged completer scatters in order).

Device pages need no tracking within a lane: its copies' device work runs in submission order
on its streams. With separate lanes (the staged pipeline's D->H and H->D lanes, each with its
own streams) a second :class:`PageHazards` over device pages orders them across the lanes: an
H->D (writes device pages) depends on the pending D->H copies reading any of them, a D->H on
the pending H->D copies writing any of them, and the worker waits until those are settled
(:meth:`~asynccache.transfers.workers.WorkerBase.wait_dev_deps`).

Per page the tracker keeps the sequence number of the last copy that wrote and the last that
read it (two int64 arrays, 16 bytes per page). A submission records its pages (one numpy
assignment) and looks up the other kind only while a copy of that kind is in flight (one
gather).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


class PageHazards:
    """Last writer / last reader per page (see the module docstring). Loop thread only."""

    __slots__ = ("_last_read", "_last_write", "_pending", "ordered")

    def __init__(self, num_pages: int) -> None:
        self._last_write = np.full(num_pages, -1, dtype=np.int64)
        self._last_read = np.full(num_pages, -1, dtype=np.int64)
        self._pending = [0, 0]  # copies in flight that read / write host pages
        self.ordered = 0  # submissions that had to wait for an earlier copy

    def note(self, seq: int, host_pages: np.ndarray, writes: bool,
             pending: Mapping[int, Any]) -> tuple[Any, ...]:
        """Record copy ``seq`` on ``host_pages``; return the pending jobs it must wait for.

        ``pending`` maps the sequence numbers of copies still in flight to their jobs, oldest
        first. Call :meth:`retire` when it completes."""
        self._pending[writes] += 1
        if host_pages.shape[0] == 0:
            return ()
        deps: tuple[Any, ...] = ()
        if self._pending[not writes] and pending:  # a copy of the other kind is in flight
            oldest = next(iter(pending))
            seen = (self._last_read if writes else self._last_write)[host_pages]
            if int(seen.max()) >= oldest:
                found = np.unique(seen[seen >= oldest]).tolist()
                deps = tuple(pending[s] for s in found if s in pending)
                if deps:
                    self.ordered += 1
        (self._last_write if writes else self._last_read)[host_pages] = seq
        return deps

    def retire(self, writes: bool) -> None:
        """A copy recorded with :meth:`note` completed (or failed)."""
        self._pending[writes] -= 1

    def clear(self) -> None:
        """Every copy in flight failed at once (a dead copy thread)."""
        self._pending = [0, 0]
