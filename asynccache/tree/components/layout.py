"""The layout of ``Node.aux``: one flat list per node.

The node's eviction-queue entries come first (``QUEUES`` of them: ``DLEAF``, ``HLEAF``, ``HDUP``
in :mod:`asynccache.tree.node`); then each auxiliary component owns ``WIDTH`` consecutive entries
from its ``Component.at``; the names below are the offsets within them. (No per-component
objects: a new node allocates one list, in every tree, so a hybrid node costs the cyclic garbage
collector no more objects than a FULL-only one.)
"""

from __future__ import annotations

from typing import Any

# The value comes first, so the hot walks read it as ``aux[at]``.
# Read-only int64 slot array (SWA: the node's FULL array itself, see components/swa.py);
# None is a *tombstone* (evicted, structure kept).
VALUE = 0
LOCK = 1  # pins
STAMP = 2  # the component's own LRU clock value
QE = 3  # its live LRU queue entry, or None
ACCT = 4  # how the value is counted: 0 not at all, 1 evictable, 2 protected
HOST = 5  # the host copy of the value (trees with a host tier; None: not backed up)
WIDTH = 6
QUEUES = 3  # the node's eviction-queue entries before the components' (DLEAF, HLEAF, HDUP)
EMPTY: tuple[Any, ...] = (None, 0, 0, None, 0, None)  # one component's entries on a new node
