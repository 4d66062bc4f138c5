"""The L1/L2 engine of a cache: device and host tiers, slots, copies and their commits.

It knows nothing of storage, buffers or requests. Modules: ``parts`` (what one cache is made of,
built once from its config), ``ledger`` (who holds which slots), ``slots`` (FULL-only or hybrid
device slots), ``effects`` (applying tree results), ``copies`` (copies in flight, commit
policies), ``ports`` (calls up to storage), ``tiering`` (match / insert / evict / allocate /
back up), ``loadback`` (L2 -> L1), ``hybrid`` (SWA / Mamba calls), ``sidecars`` (extra per-token
pools on a source pool's slots, riding its copies), ``kvaccess``, ``tasks``.
"""

from asynccache.engine.copies import AgreedCommits, CommitPolicy, ImmediateCommits, copy_error
from asynccache.engine.hybrid import HybridOps
from asynccache.engine.kvaccess import KVAccess
from asynccache.engine.loadback import LoadBack, LoadBacks
from asynccache.engine.parts import Lifecycle, Parts
from asynccache.engine.ports import NO_STORAGE, StoragePorts
from asynccache.engine.sidecars import Sidecar, Sidecars
from asynccache.engine.tasks import TaskOwner, stop_and_wait
from asynccache.engine.tiering import Tiering

__all__ = ["NO_STORAGE", "AgreedCommits", "CommitPolicy", "HybridOps", "ImmediateCommits",
           "KVAccess", "Lifecycle", "LoadBack", "LoadBacks", "Parts", "Sidecar", "Sidecars",
           "StoragePorts",
           "TaskOwner", "Tiering", "copy_error", "stop_and_wait"]
