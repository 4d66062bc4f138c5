"""Pools of the hybrid-model components: the SWA slot map and the Mamba state pool.

* :class:`SWASlotMap` pairs a FULL page allocator with a (usually smaller) SWA page allocator.
  A request's tokens get a FULL slot and an SWA slot together; ``full_to_swa`` says where a FULL
  slot's sliding-window KV lives (what the attention kernel needs; the tree names SWA data by
  FULL slots and leaves the translation to this map).
  SWA slots can be freed on their own (out of the window, or an SWA tombstone in the tree);
  the map forgets them, and the FULL side is freed later with :meth:`SWASlotMap.free_full`.
* :class:`MambaStatePool`: one real tensor of recurrent states with a one-slot-per-page
  allocator, and the copy-on-write copy a match asks for.

:meth:`SWASlotMap.apply_tree_frees` applies what the tree returns (its ``device_frees``,
``component_frees["swa"]`` and ``swa_adopted``, all FULL slots) in the one safe order. Not
thread-safe: the cache's event loop is the only caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asynccache.errors import ConfigError, DoubleFreeError, InvalidInputError
from asynccache.transfers.allocator import PageAllocator, positive_int
from asynccache.transfers.indices import as_slot_array
from asynccache.transfers.pools import KVPool


class SWASlotMap:
    """FULL and SWA slots allocated together, with the FULL -> SWA translation."""

    def __init__(self, full: PageAllocator, swa: PageAllocator) -> None:
        if full.page_size != swa.page_size:
            raise ConfigError(
                f"FULL page_size {full.page_size} != SWA page_size {swa.page_size}"
            )
        self.full = full
        self.swa = swa
        self.full_to_swa = np.full(full.total_size, -1, dtype=np.int64)
        self.swa_to_full = np.full(swa.total_size, -1, dtype=np.int64)

    def alloc(self, num_tokens: int) -> np.ndarray | None:
        """``num_tokens`` FULL slots, each paired with a fresh SWA slot; None (nothing taken)
        when either pool is short."""
        full = self.full.alloc(num_tokens)
        if full is None:
            return None
        swa = self.swa.alloc(num_tokens)
        if swa is None:
            self.full.free(full)
            return None
        self.full_to_swa[full] = swa
        self.swa_to_full[swa] = full
        return full

    def translate(self, full_slots: Any) -> np.ndarray:
        """The SWA slots of ``full_slots``; every one must still have its SWA side."""
        full = as_slot_array(full_slots, name="full_slots")
        if full.shape[0] and (int(full.min()) < 0 or int(full.max()) >= len(self.full_to_swa)):
            raise InvalidInputError(f"a FULL slot of {full.tolist()[:8]} is out of range")
        swa: np.ndarray = self.full_to_swa[full]
        if swa.shape[0] and int(swa.min()) < 0:
            bad = int(full[int(np.argmin(swa))])
            raise InvalidInputError(f"FULL slot {bad} has no SWA slot (freed or never paired)")
        return swa

    def free_swa(self, swa_slots: Any) -> None:
        """Free SWA slots on their own; their FULL slots stay allocated, unpaired."""
        swa = as_slot_array(swa_slots, name="swa_slots")
        if not swa.shape[0]:
            return
        self.swa.free(swa)  # atomic: raises before anything changes
        full = self.swa_to_full[swa]
        paired = full[full >= 0]
        self.full_to_swa[paired] = -1
        self.swa_to_full[swa] = -1

    def free_full(self, full_slots: Any) -> None:
        """Free FULL slots with whatever SWA side they still have (the combined free)."""
        full = as_slot_array(full_slots, name="full_slots")
        if not full.shape[0]:
            return
        swa = self.full_to_swa[full]
        self.full.free(full)  # atomic: raises before anything changes
        paired = swa[swa >= 0]
        if paired.shape[0]:
            self.swa.free(paired)
            self.swa_to_full[paired] = -1
        self.full_to_swa[full] = -1

    def adopt(self, full_slots: Any, swa_slots: Any) -> None:
        """Pair ``full_slots`` with ``swa_slots`` (allocated SWA slots that were paired with
        other FULL slots, or with none): the tree recovered an SWA tombstone from a caller's
        slots. The FULL slots must have no SWA side."""
        full = as_slot_array(full_slots, name="full_slots")
        swa = as_slot_array(swa_slots, name="swa_slots")
        if full.shape != swa.shape:
            raise InvalidInputError(f"{full.shape[0]} FULL slots but {swa.shape[0]} SWA slots")
        if full.shape[0] and int(self.full_to_swa[full].max()) >= 0:
            raise InvalidInputError("adopt: a FULL slot already has an SWA side")
        old = self.swa_to_full[swa]
        self.full_to_swa[old[old >= 0]] = -1
        self.full_to_swa[full] = swa
        self.swa_to_full[swa] = full

    def apply_tree_frees(
        self,
        device_frees: Iterable[np.ndarray],
        swa_frees: Iterable[np.ndarray],
        swa_adopted: Sequence[tuple[np.ndarray, np.ndarray]] = (),
    ) -> None:
        """Apply a tree result. The tree names SWA data by FULL slots: ``swa_frees`` are FULL
        slots whose SWA side it gave up, ``swa_adopted`` pairs (a node's FULL slots, the
        caller's FULL slots whose SWA side the node takes over). In the one safe order: re-pair
        the adopted SWA slots, free the SWA sides given up, then the FULL slots (with any SWA
        side still paired; an adopted or freed side is unpaired by then, so nothing is freed
        twice)."""
        for node_full, caller_full in swa_adopted:
            fresh = node_full != caller_full  # the node's own slots keep their own pairs
            if fresh.any():
                self.adopt(node_full[fresh], self.translate(caller_full[fresh]))
        for full in swa_frees:
            self.free_swa(self.translate(full))
        for full in device_frees:
            self.free_full(full)

    def check(self) -> None:
        """The two maps mirror each other and only name allocated slots."""
        full = np.flatnonzero(self.full_to_swa >= 0)
        swa = self.full_to_swa[full]
        if not np.array_equal(self.swa_to_full[swa], full):
            raise AssertionError("full_to_swa and swa_to_full disagree")
        if int((self.swa_to_full >= 0).sum()) != len(full):
            raise AssertionError("swa_to_full names SWA slots full_to_swa does not")


class MambaStatePool:
    """``num_states`` recurrent states of ``state_shape`` in one tensor, one slot per state."""

    def __init__(
        self,
        num_states: int,
        state_shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        num_states = positive_int(num_states, "num_states")
        shape = tuple(positive_int(d, "state_shape") for d in state_shape)
        self.allocator = PageAllocator(num_states, 1)
        self.states = torch.zeros((num_states, *shape), dtype=dtype, device=device)

    @property
    def available_size(self) -> int:
        return self.allocator.available_size

    @property
    def used_size(self) -> int:
        return self.allocator.used_size

    def alloc(self, num: int) -> np.ndarray | None:
        got: np.ndarray | None = self.allocator.alloc(num)
        return got

    def free(self, slots: Any) -> None:
        self.allocator.free(slots)

    def _allocated(self, slot: int, what: str) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int | np.integer):
            raise InvalidInputError(f"{what} must be an int slot, got {slot!r}")
        if not 0 <= slot < self.allocator.total_size:
            raise InvalidInputError(f"{what} {slot} out of range [0, {self.allocator.total_size})")
        if not self.allocator._allocated[int(slot)]:
            raise DoubleFreeError(f"{what} {slot} is not allocated")
        return int(slot)

    def copy_on_write(self, src: int) -> int | None:
        """A fresh slot holding a copy of state ``src`` (None when the pool is full): the
        request's private state after a match returned ``mamba_cow_slot``."""
        s = self._allocated(src, "source state")
        got = self.alloc(1)
        if got is None:
            return None
        dst = int(got[0])
        self.states[dst].copy_(self.states[s])
        return dst


@dataclass(frozen=True, slots=True)
class StateShape:
    """A state pool's geometry as the copy engine sees it: one "layer", one state per page."""

    state_shape: tuple[int, ...]
    dtype: torch.dtype
    num_layers: int = 1

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one state."""
        n = 1
        for d in self.state_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def bytes_per_page(self, page_size: int) -> int:
        return self.bytes_per_token * page_size


class StatePages(KVPool):
    """A :class:`MambaStatePool` seen as a pool of one-state pages, so that a
    :class:`~asynccache.transfers.engine.CopyEngine` moves states with the machinery of KV
    pages (fences, copy stream, staging ring, host-slot ordering). It wraps the pool's tensor
    (no copy): the page view is ``(1, 1, num_states, state elements)``."""

    def __init__(self, pool: MambaStatePool) -> None:  # no KVPool.__init__: nothing allocated
        states = pool.states
        if not states.is_contiguous():
            raise ConfigError("a MambaStatePool's states must be contiguous to be copied")
        n = int(states.shape[0])
        self.allocator = pool.allocator
        self.shape = StateShape(tuple(int(d) for d in states.shape[1:]), states.dtype)  # type: ignore[assignment]
        self.page_size = 1
        self.num_slots = self.num_pages = n
        self.layout = "layer_first"
        self.device = states.device
        self.pinned = states.device.type == "cpu" and torch.cuda.is_available() and \
            bool(states.is_pinned())
        self.kv = states
        self._page_view = states.view(1, 1, n, -1)


class DeviceStatePages(StatePages):
    kind = "device"


class HostStatePages(StatePages):
    kind = "host"
