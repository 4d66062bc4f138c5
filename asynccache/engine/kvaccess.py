"""Direct KV access to the device pool (tests, replay verification, a model writing its KV)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asynccache.errors import InvalidInputError
from asynccache.transfers.plan import runs
from asynccache.transfers.pools import DevicePool, KVShape
from asynccache.tree import as_slots


class KVAccess:
    """``read_kv`` / ``write_kv`` of one device pool."""

    def __init__(self, device_pool: DevicePool, shape: KVShape) -> None:
        self.device_pool = device_pool
        self.shape = shape
        self.page_size = device_pool.allocator.page_size

    def _split_pages(self, slots: np.ndarray) -> tuple[np.ndarray, int]:
        """(page ids, tokens they cover) of the leading whole pages of ``slots``."""
        ps = self.page_size
        full = len(slots) // ps
        if ps == 1:
            return slots, len(slots)
        head = slots[: full * ps].reshape(full, ps)
        firsts = head[:, 0]
        whole = (firsts % ps == 0) & (head == firsts[:, None] + np.arange(ps)).all(axis=1)
        full = full if whole.all() else int(np.argmin(whole))
        return firsts[:full] // ps, full * ps

    def _device_slots(self, slots: Any) -> np.ndarray:
        arr = as_slots(slots, "slots")
        n = self.device_pool.num_slots
        if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= n):
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            raise InvalidInputError(f"slots holds slot {bad}, out of the device pool's [0, {n})")
        return arr

    def read_kv(self, slots: Any) -> torch.Tensor:
        """A copy of the device KV of ``slots`` as (layers, 2, n, heads, head_dim)."""
        arr = self._device_slots(slots)
        pool = self.device_pool
        L, H, D = self.shape.num_layers, self.shape.num_heads, self.shape.head_dim
        pages, covered = self._split_pages(arr)
        dev = pool.device
        parts = []
        if covered:
            got = pool.page_view().index_select(2, torch.tensor(pages, device=dev))
            parts.append(got.reshape(L, 2, covered, H, D))
        if covered < len(arr):
            parts.append(pool.kv.index_select(2, torch.tensor(arr[covered:], device=dev)))
        if not parts:
            return pool.kv[:, :, :0].cpu()
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)).cpu()

    def slot_runs(self, slots: Any) -> list[tuple[int, int, int]]:
        """``slots`` (checked to be in range) as runs of consecutive slots: (position in
        ``slots``, first slot, length), in order."""
        out = runs(self._device_slots(slots))
        assert out is not None
        return out

    def span(self, first: int, n: int) -> torch.Tensor:
        """The device KV of slots ``first .. first + n - 1`` as a live (layers, 2, n, heads,
        head_dim) view of the pool: writing it writes the pool, no copy is made."""
        size = self.device_pool.num_slots
        if first < 0 or n < 0 or first + n > size:
            raise InvalidInputError(
                f"span of slots [{first}, {first + n}) is out of the device pool's [0, {size})")
        return self.device_pool.kv[:, :, first : first + n]

    def write_kv(self, slots: Any, values: torch.Tensor) -> None:
        """Write KV (layers, 2, n, heads, head_dim) into device ``slots``."""
        arr = self._device_slots(slots)
        if values.dim() != 5 or values.shape[2] != len(arr):
            raise InvalidInputError(
                f"KV of shape {tuple(values.shape)} for {len(arr)} slots; expected "
                f"(layers, 2, {len(arr)}, heads, head_dim)"
            )
        pool = self.device_pool
        values = values.to(device=pool.device, dtype=pool.kv.dtype)
        pages, covered = self._split_pages(arr)
        if covered:
            view = pool.page_view()
            src = values[:, :, :covered].reshape(view.shape[0], 2, len(pages), view.shape[3])
            page_runs = runs(pages, _MAX_RUNS)
            if page_runs is None:  # fragmented (a scatter is several times slower than a copy)
                view.index_copy_(2, torch.tensor(pages, device=pool.device), src)
            else:  # a few runs of consecutive pages: plain slice copies
                for at, first, n in page_runs:
                    view[:, :, first : first + n].copy_(src[:, :, at : at + n])
        if covered < len(arr):
            pool.kv.index_copy_(2, torch.tensor(arr[covered:], device=pool.device),
                                values[:, :, covered:])


_MAX_RUNS = 64
