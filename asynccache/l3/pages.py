"""Host pool pages as storage buffers, and the one batched page-read loop.

:func:`page_buffers` is the one place that knows how a page of a host pool becomes the byte
buffer a backend reads or writes (a view in a page_first pool, a copy in a layer_first one).
:func:`stored_prefix` is the hit query (how many leading pages storage holds) and
:func:`read_run` the batched read of a leading run of pages into host slots; the storage tier's
prefetch (:mod:`asynccache.l3.tier`) and the buffer-only host mode's reads and SWA windows
(:mod:`asynccache.buffer`) all go through them.

Sidecars (:mod:`asynccache.engine.sidecars`) ride the pages of their source: given the
``sidecars`` of a host pool, :func:`write_pages` writes each page's sidecar objects
(``<key>.<name>``, from the same host slots of the sidecar pools) in the same backend call as
the page, and a page counts as stored only when all of them are; :func:`read_pages` /
:func:`read_run` read them with the page, and a page counts as arrived only when its sidecar
objects did too (so a prefetch keeps the longest prefix every pool can restore).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Protocol

import numpy as np
import torch

from asynccache.engine.sidecars import Sidecar
from asynccache.transfers.pools import HostPool, KVPool

#: Pages per backend call (existence queries, reads and writes).
BATCH_PAGES: Final = 128


class Observer(Protocol):
    def observe(self, amount: float) -> None: ...


def page_buffers(host: KVPool, slots: np.ndarray, *, fill: bool) -> list[torch.Tensor]:
    """One uint8 buffer per page of ``slots``: views into a page_first pool, else copies of
    the pages (``fill``) or empty buffers to read into and keep with :func:`keep_pages`."""
    firsts = slots[:: host.page_size].tolist()
    if isinstance(host, HostPool) and host.layout == "page_first":
        return [host.page_buffer(f) for f in firsts]
    if fill:
        return [host.read_page(f) for f in firsts]
    return [torch.empty(host.page_bytes, dtype=torch.uint8) for _ in firsts]


def keep_pages(host: KVPool, slots: np.ndarray, bufs: Sequence[torch.Tensor],
               pages: int) -> None:
    """The first ``pages`` buffers of ``page_buffers(host, slots, fill=False)`` were read:
    write them into their host pages (page_first pools: they were views, nothing to do)."""
    if host.layout != "page_first":
        for j, first in enumerate(slots[:: host.page_size][:pages].tolist()):
            host.write_page(first, bufs[j])


def _pools(host: KVPool, keys: Sequence[str], sidecars: Sequence[Sidecar],
           page_keys: Sequence[str] | None) -> tuple[list[KVPool], list[list[str]]]:
    """The pools of a run of pages (the source's, then each sidecar's) and their object names
    (a sidecar's are ``<page key>.<name>``; ``page_keys``: the page keys when ``keys`` are
    other objects of them, such as ``.swa`` pages)."""
    pools: list[KVPool] = [host]
    names = [list(keys)]
    base = keys if page_keys is None else page_keys
    for sc in sidecars:
        pools.append(sc.host_pool)
        names.append([sc.object_name(k) for k in base])
    return pools, names


def _leading(oks: Sequence[Sequence[bool]], n: int) -> list[bool]:
    """Per page: every pool's object of it succeeded."""
    return [all(ok[j] for ok in oks) for j in range(n)]


async def write_pages(backend: Any, host: KVPool, keys: Sequence[str], slots: np.ndarray,
                      sidecars: Sequence[Sidecar] = (), *,
                      page_keys: Sequence[str] | None = None) -> list[bool]:
    """One backend call: write the host pages of ``slots`` as ``keys`` (and each page's sidecar
    objects, named after ``page_keys``, default ``keys``); per page, whether it and all its
    sidecar objects were stored."""
    pools, names = _pools(host, keys, sidecars, page_keys)
    all_keys: list[str] = []
    bufs: list[torch.Tensor] = []
    for pool, pool_keys in zip(pools, names, strict=True):
        all_keys += pool_keys
        bufs += page_buffers(pool, slots, fill=True)
    ok = list(await backend.set_batch(all_keys, bufs))
    n = len(keys)
    return _leading([ok[i * n : (i + 1) * n] for i in range(len(pools))], n)


async def read_pages(backend: Any, host: KVPool, keys: Sequence[str], slots: np.ndarray,
                     sidecars: Sequence[Sidecar] = (), *,
                     page_keys: Sequence[str] | None = None) -> int:
    """One backend call: read the pages ``keys`` (and their sidecar objects, named after
    ``page_keys``, default ``keys``) into the host pages of ``slots``; returns how many leading
    pages arrived whole (a backend miss or fault of any pool ends the run)."""
    pools, names = _pools(host, keys, sidecars, page_keys)
    all_keys: list[str] = []
    bufs: list[list[torch.Tensor]] = []
    for pool, pool_keys in zip(pools, names, strict=True):
        all_keys += pool_keys
        bufs.append(page_buffers(pool, slots, fill=False))
    ok = list(await backend.get_batch(all_keys, [b for pool_bufs in bufs for b in pool_bufs]))
    n = len(keys)
    arrived = _leading([ok[i * n : (i + 1) * n] for i in range(len(pools))], n)
    good = next((j for j, g in enumerate(arrived) if not g), n)
    for pool, pool_bufs in zip(pools, bufs, strict=True):
        keep_pages(pool, slots, pool_bufs, good)
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


async def read_run(backend: Any, host: KVPool, keys: Sequence[str], slots: np.ndarray, *,
                   landed: Callable[[int, int], None] | None = None,
                   between: Callable[[], Awaitable[None]] | None = None,
                   bandwidth: Observer | None = None,
                   sidecars: Sequence[Sidecar] = (),
                   page_keys: Sequence[str] | None = None) -> int:
    """Read the pages ``keys`` into the host slots ``slots`` (from their start) in batches of
    :data:`BATCH_PAGES`, stopping at the first page that did not arrive (missing, corrupt,
    unreadable); returns the leading pages that arrived.

    ``landed(first, good)``: called after each batch (``first``: the index of its first page in
    ``keys``; ``good``: its leading pages that arrived). ``between``: awaited after each whole
    batch but the last. ``bandwidth``: observes the bytes per second of the pages read.
    ``sidecars``: read each page's sidecar objects with it (a page arrives only whole; their
    names follow ``page_keys``, default ``keys``)."""
    ps = host.page_size
    n = len(keys)
    total = 0
    t0 = time.perf_counter()
    for i in range(0, n, BATCH_PAGES):
        batch = keys[i : i + BATCH_PAGES]
        good = await read_pages(
            backend, host, batch, slots[i * ps : (i + len(batch)) * ps], sidecars,
            page_keys=None if page_keys is None else page_keys[i : i + BATCH_PAGES])
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
