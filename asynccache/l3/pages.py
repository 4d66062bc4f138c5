"""Host pool pages as storage buffers, and the one batched page-read loop.

:func:`page_buffers` is the one place that knows how a page of a host pool becomes the byte
buffer a backend reads or writes (a view in a page_first pool, a copy in a layer_first one).
:func:`stored_prefix` is the hit query (how many leading pages storage holds) and
:func:`read_run` the batched read of a leading run of pages into host slots; the storage tier's
prefetch (:mod:`asynccache.l3.tier`) and the buffer-only host mode's reads and SWA windows
(:mod:`asynccache.buffer`) all go through them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Protocol

import numpy as np
import torch

from asynccache.transfers.pools import HostPool

#: Pages per backend call (existence queries, reads and writes).
BATCH_PAGES: Final = 128


class Observer(Protocol):
    def observe(self, amount: float) -> None: ...


def page_buffers(host: HostPool, slots: np.ndarray, *, fill: bool) -> list[torch.Tensor]:
    """One uint8 buffer per page of ``slots``: views into a page_first pool, else copies of
    the pages (``fill``) or empty buffers to read into and keep with :func:`keep_pages`."""
    firsts = slots[:: host.page_size].tolist()
    if host.layout == "page_first":
        return [host.page_buffer(f) for f in firsts]
    if fill:
        return [host.read_page(f) for f in firsts]
    return [torch.empty(host.page_bytes, dtype=torch.uint8) for _ in firsts]


def keep_pages(host: HostPool, slots: np.ndarray, bufs: Sequence[torch.Tensor],
               pages: int) -> None:
    """The first ``pages`` buffers of ``page_buffers(host, slots, fill=False)`` were read:
    write them into their host pages (page_first pools: they were views, nothing to do)."""
    if host.layout != "page_first":
        for j, first in enumerate(slots[:: host.page_size][:pages].tolist()):
            host.write_page(first, bufs[j])


async def read_pages(backend: Any, host: HostPool, keys: Sequence[str], slots: np.ndarray) -> int:
    """One backend call: read the pages ``keys`` into the host pages of ``slots``; returns how
    many leading pages arrived (a backend miss or fault ends the run)."""
    bufs = page_buffers(host, slots, fill=False)
    ok = await backend.get_batch(list(keys), bufs)
    good = next((j for j, g in enumerate(ok) if not g), len(ok))
    keep_pages(host, slots, bufs, good)
    return good


async def stored_prefix(backend: Any, keys: Sequence[str]) -> int:
    """The hit query: how many leading pages of ``keys`` storage holds (``exists_prefix`` in
    batches of :data:`BATCH_PAGES`, until one comes up short)."""
    hit = 0
    for i in range(0, len(keys), BATCH_PAGES):
        batch = list(keys[i : i + BATCH_PAGES])
        found = await backend.exists_prefix(batch)
        hit += found
        if found < len(batch):
            break
    return hit


async def read_run(backend: Any, host: HostPool, keys: Sequence[str], slots: np.ndarray, *,
                   landed: Callable[[int, int], None] | None = None,
                   between: Callable[[], Awaitable[None]] | None = None,
                   bandwidth: Observer | None = None) -> int:
    """Read the pages ``keys`` into the host slots ``slots`` (from their start) in batches of
    :data:`BATCH_PAGES`, stopping at the first page that did not arrive (missing, corrupt,
    unreadable); returns the leading pages that arrived.

    ``landed(first, good)``: called after each batch (``first``: the index of its first page in
    ``keys``; ``good``: its leading pages that arrived). ``between``: awaited after each whole
    batch but the last. ``bandwidth``: observes the bytes per second of the pages read."""
    ps = host.page_size
    n = len(keys)
    total = 0
    t0 = time.perf_counter()
    for i in range(0, n, BATCH_PAGES):
        batch = keys[i : i + BATCH_PAGES]
        good = await read_pages(backend, host, batch, slots[i * ps : (i + len(batch)) * ps])
        total += good
        if landed is not None:
            landed(i, good)
        if good < len(batch):
            break
        if between is not None and i + BATCH_PAGES < n:
            await between()
    dt = time.perf_counter() - t0
    if bandwidth is not None and total and dt > 0:
        bandwidth.observe(total * host.page_bytes / dt)
    return total
