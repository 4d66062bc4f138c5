"""transfers: moving KV between device and host memory.

* :mod:`transfers.pools` -- :class:`KVShape`, :class:`DevicePool`, :class:`HostPool`
  (real KV tensors, each with a :class:`PageAllocator`).
* :mod:`transfers.engine` -- :class:`CopyEngine`: batched D->H / H->D copies and layer-wise
  H->D loads that coroutines await.
* :mod:`transfers.bridge` -- :class:`LoopBridge`: worker-thread completions delivered to the
  event loop in batches.
* :mod:`transfers.hybrid_pools` -- :class:`SWASlotMap` (FULL and SWA slots allocated in pairs,
  the full->SWA map) and :class:`MambaStatePool` (recurrent states, copy-on-write).

Knows nothing of the tree; see ``docs/transfers.md``.
"""

from transfers.allocator import PageAllocator
from transfers.bridge import LoopBridge
from transfers.engine import CopyEngine, OpStats
from transfers.handles import CopyHandle, CopyResult, LayerwiseHandle
from transfers.hybrid_pools import MambaStatePool, SWASlotMap
from transfers.pools import DevicePool, HostPool, KVShape

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
]
