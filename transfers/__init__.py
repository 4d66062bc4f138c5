"""asynccache.transfers: moving KV between device and host memory.

* :mod:`asynccache.transfers.pools` -- :class:`KVShape`, :class:`DevicePool`, :class:`HostPool`
  (real KV tensors, each with a :class:`PageAllocator`).
* :mod:`asynccache.transfers.engine` -- :class:`CopyEngine`: batched D->H / H->D copies and layer-wise
  H->D loads that coroutines await.
* :mod:`asynccache.transfers.bridge` -- :class:`LoopBridge`: worker-thread completions delivered to the
  event loop in batches.
* :mod:`asynccache.transfers.hybrid_pools` -- :class:`SWASlotMap` (FULL and SWA slots allocated in pairs,
  the full->SWA map) and :class:`MambaStatePool` (recurrent states, copy-on-write).
* :mod:`asynccache.transfers.sidecars` -- :class:`SidecarSpec` and the sidecar pools (per-token
  buffers sharing a source pool's slots; their copies ride the source's).

Knows nothing of the tree; see ``docs/transfers.md``.
"""

from asynccache.transfers.allocator import PageAllocator
from asynccache.transfers.bridge import LoopBridge
from asynccache.transfers.engine import CopyEngine, OpStats
from asynccache.transfers.handles import CopyHandle, CopyResult, LayerwiseHandle
from asynccache.transfers.hybrid_pools import MambaStatePool, SWASlotMap
from asynccache.transfers.pools import DevicePool, HostPool, KVShape
from asynccache.transfers.sidecars import SidecarSpec

__all__ = [
    "CopyEngine",
    "CopyHandle",
    "CopyResult",
    "DevicePool",
    "HostPool",
    "KVShape",
    "LayerwiseHandle",
    "LoopBridge",
    "MambaStatePool",
    "OpStats",
    "PageAllocator",
    "SWASlotMap",
    "SidecarSpec",
]
