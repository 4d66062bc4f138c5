"""The layout of ``Node.aux`` in hybrid trees: one flat list per node.

Each auxiliary component owns ``WIDTH`` consecutive entries from its ``Component.at``; the
names below are the offsets within them. (No per-component objects: a hybrid insert allocates
one list per new node, not a list and an object per component that the cyclic garbage
collector then has to track.)
"""

from __future__ import annotations

from typing import Any

# The value comes first, so the hot walks read it as ``aux[at]``.
VALUE = 0  # read-only int64 slot array; None is a *tombstone* (evicted, structure kept)
LOCK = 1  # pins
STAMP = 2  # the component's own LRU clock value
QE = 3  # its live LRU queue entry, or None
ACCT = 4  # how the value is counted: 0 not at all, 1 evictable, 2 protected
HOST = 5  # the host copy of the value (trees with a host tier; None: not backed up)
WIDTH = 6
EMPTY: tuple[Any, ...] = (None, 0, 0, None, 0, None)  # one component's entries on a new node
