"""Host copies of the hybrid-model components: Mamba state copies and grouped copies.

* :class:`StateCopier` copies recurrent states between two :class:`MambaStatePool` s (device
  and host) with the machinery of KV pages: a :class:`~asynccache.transfers.engine.CopyEngine`
  over the pools seen as one-state pages (:class:`~asynccache.transfers.hybrid_pools.StatePages`).
  On CUDA that is the staged pipeline: the fence contract (``after=``, a bound compute stream,
  or the current stream), a copy stream, pinned ``non_blocking`` copies through the staging
  ring, blocking-sync events; on the CPU the direct worker. Host-slot ordering and dead-thread
  handling come with it.
* :class:`~asynccache.transfers.handles.GroupHandle` (re-exported here) joins the copies of one
  operation over several pools into a single :class:`CopyHandle`.

SWA KV moves with a second :class:`~asynccache.transfers.engine.CopyEngine` over the SWA device
and host pools (same page layout as FULL KV, fewer layers).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asynccache.errors import ClosedError, InvalidInputError
from asynccache.transfers.engine import CopyEngine, Mode
from asynccache.transfers.handles import CopyHandle, GroupHandle
from asynccache.transfers.hybrid_pools import DeviceStatePages, HostStatePages, MambaStatePool
from asynccache.transfers.indices import as_slot_array
from asynccache.transfers.pools import register_host_memory
from asynccache.transfers.streams import Streams

__all__ = ["GroupHandle", "StateCopier", "host_state_pool", "state_bytes"]

#: The staging ring of a state copier (states are small next to KV).
STATE_STAGING_BYTES = 16 << 20


def host_state_pool(device_pool: MambaStatePool, num_states: int) -> MambaStatePool:
    """A host pool of ``num_states`` states shaped like ``device_pool``'s (pinned on CUDA:
    exactly its bytes, see :func:`~asynccache.transfers.pools.register_host_memory`)."""
    shape = tuple(device_pool.states.shape[1:])
    pool = MambaStatePool(num_states, shape, dtype=device_pool.states.dtype, device="cpu")
    if device_pool.states.device.type == "cuda":
        register_host_memory(pool.states)
    return pool


class StateCopier:
    """Copies Mamba states device <-> host (see the module docstring).

    ``submit_d2h`` / ``submit_h2d`` take ``after=`` like
    :meth:`CopyEngine.submit_d2h <asynccache.transfers.engine.CopyEngine.submit_d2h>`; the
    other keywords go to the engine (``compute_stream``, ``debug_fences``, ``streams``,
    ``mode``, staging)."""

    def __init__(self, device: MambaStatePool, host: MambaStatePool,
                 name: str = "asynccache-states", *, mode: Mode = "auto",
                 streams: Streams | None = None, compute_stream: Any = None,
                 debug_fences: bool | None = None,
                 staging_bytes: int = STATE_STAGING_BYTES, staging_slots: int = 4) -> None:
        if tuple(device.states.shape[1:]) != tuple(host.states.shape[1:]) or (
            device.states.dtype != host.states.dtype
        ):
            raise InvalidInputError(
                f"state pools differ: device {tuple(device.states.shape[1:])} "
                f"{device.states.dtype} vs host {tuple(host.states.shape[1:])} {host.states.dtype}"
            )
        self.device = device
        self.host = host
        self.name = name
        self.engine = CopyEngine(
            DeviceStatePages(device), HostStatePages(host), mode=mode, name=name,  # type: ignore[arg-type]
            streams=streams, compute_stream=compute_stream, debug_fences=debug_fences,
            staging_bytes=staging_bytes, staging_slots=staging_slots)

    async def start(self) -> None:
        if self.engine.worker is not None or self.engine.closed:
            raise ClosedError(f"StateCopier {self.name!r} already started")
        await self.engine.start()

    async def aclose(self) -> None:
        """Wait for the copies in flight, then stop the threads."""
        await self.engine.aclose()

    @property
    def in_flight(self) -> int:
        return self.engine.in_flight

    def submit_d2h(self, device_idx: Any, host_idx: Any, *, after: Any = None) -> CopyHandle:
        self._check(device_idx, self.device, host_idx, self.host)
        return self.engine.submit_d2h(device_idx, host_idx, after=after)

    def submit_h2d(self, host_idx: Any, device_idx: Any, *, after: Any = None) -> CopyHandle:
        self._check(host_idx, self.host, device_idx, self.device)
        return self.engine.submit_h2d(host_idx, device_idx, after=after)

    def _check(self, src_idx: Any, src: MambaStatePool, dst_idx: Any,
               dst: MambaStatePool) -> None:
        if not self.engine.running:
            raise ClosedError(f"StateCopier {self.name!r} is not running")
        s = as_slot_array(src_idx, name="src_idx")
        d = as_slot_array(dst_idx, name="dst_idx")
        if s.shape != d.shape:
            raise InvalidInputError(f"{s.shape[0]} source states but {d.shape[0]} destinations")
        for arr, pool in ((s, src), (d, dst)):
            if arr.shape[0] and (int(arr.min()) < 0 or int(arr.max()) >= pool.states.shape[0]):
                raise InvalidInputError(f"a state slot of {arr.tolist()[:8]} is out of range")


def state_bytes(pool: MambaStatePool, slots: np.ndarray) -> bytes:
    """The raw bytes of the states ``slots`` (for bit-exact comparisons and storage)."""
    idx = torch.from_numpy(as_slot_array(slots, name="slots").copy())
    rows = pool.states.index_select(0, idx.to(pool.states.device)).cpu().contiguous()
    return bytes(rows.view(torch.uint8).numpy().tobytes())
