"""The L3 (storage) tier of the engine, cache host mode.

Modules: ``policy`` (:class:`StoragePolicy` and the one admission / pages-to-read / stop rule
of every prefetch), ``op`` (a prefetch in flight), ``pages`` (host pages as storage buffers, the
hit query and the one batched read loop), ``existence`` (what is believed stored), ``tier``
(:class:`StorageTier`: backup L2 -> L3 and prefetch L3 -> L2), ``hybrid`` and ``hybrid_ranks``
(the SWA / Mamba objects of hybrid caches, on one rank and agreed over several).
"""

from asynccache.l3.existence import DEFAULT_MAX_ENTRIES, StorageExistenceCache
from asynccache.l3.op import HybridPrefetch, PrefetchOp
from asynccache.l3.pages import BATCH_PAGES, page_buffers, read_run, stored_prefix, write_pages
from asynccache.l3.policy import (
    PREFETCH_POLICIES,
    StoragePolicy,
    admission,
    count_finished,
    final_outcome,
    floor_pages,
    may_stop,
    pages_to_read,
    prefetch_span,
    stop_policy,
    stop_wait_s,
)
from asynccache.l3.tier import PrefetchTasks, StorageTier, await_stop

__all__ = ["BATCH_PAGES", "DEFAULT_MAX_ENTRIES", "PREFETCH_POLICIES", "HybridPrefetch",
           "PrefetchOp", "PrefetchTasks", "StorageExistenceCache", "StoragePolicy", "StorageTier",
           "admission", "await_stop", "count_finished", "final_outcome", "floor_pages", "may_stop", "page_buffers", "pages_to_read",
           "prefetch_span", "read_run", "stop_policy", "stop_wait_s", "stored_prefix", "write_pages"]
