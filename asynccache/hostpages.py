"""Host pool pages as storage buffers: the one place that knows how a page of the host pool
becomes the byte buffer a backend reads or writes (a view in a page_first pool, a copy in a
layer_first one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from asynccache.transfers.pools import HostPool


def page_buffers(host: HostPool, slots: np.ndarray, *, fill: bool) -> list[torch.Tensor]:
    """One uint8 buffer per page of ``slots``: views into a page_first pool, else copies of
    the pages (``fill``) or empty buffers to read into and write back with ``write_page``."""
    firsts = slots[:: host.page_size].tolist()
    if host.layout == "page_first":
        return [host.page_buffer(f) for f in firsts]
    if fill:
        return [host.read_page(f) for f in firsts]
    return [torch.empty(host.page_bytes, dtype=torch.uint8) for _ in firsts]


async def read_pages(backend: Any, host: HostPool, keys: Sequence[str], slots: np.ndarray) -> int:
    """Read the pages ``keys`` from ``backend`` into the host pages of ``slots``; returns how
    many leading pages arrived (a backend miss or fault ends the run)."""
    bufs = page_buffers(host, slots, fill=False)
    ok = await backend.get_batch(list(keys), bufs)
    good = next((j for j, g in enumerate(ok) if not g), len(ok))
    if host.layout != "page_first":
        for j, first in enumerate(slots[:: host.page_size][:good].tolist()):
            host.write_page(first, bufs[j])
    return good
