"""The ``arc`` eviction policy: an ARC-style adaptive split of the device leaves (docs/eviction.md).

Megiddo and Modha's adaptive replacement cache, put on a radix tree of whole pages (the rules of
``scripts/sim_eviction.py``):

* a device-resident node is of class *once* (inserted, never hit since) or *reused* (hit by a
  later request's insert, or re-admitted while the key of one of its pages was in a ghost
  list). The class is ``node.aux[at]`` (0 / 1); it is kept only while the node is on device
  (a node leaving the device goes back to 0);
* eviction takes the least recently used evictable device leaf of the *once* class while that
  class holds more than ``p`` pages, counted over **all** device-resident nodes (leaves and
  inner nodes, locked or not), else of the *reused* class; when the chosen class has no
  evictable leaf, the other one's;
* the page keys of a node leaving the device go to its class's ghost list (an
  ``OrderedDict``, FIFO-trimmed to ``2 x capacity`` pages each);
* a page coming (back) on device whose key is in a ghost list is a *ghost hit*: in the once
  list it grows ``p`` by ``max(1, |ghost reused| / |ghost once|)`` (capped at the capacity),
  in the reused list it shrinks it by ``max(1, |ghost once| / |ghost reused|)`` (floored at 0);
  the key leaves the list and the page is reused-class. ``p`` starts at half the capacity.

Where the class size is kept: the tree counts the device tokens of every node (``_account``:
evictable + protected), and this module counts the reused-class ones (``reused``), so the once
class is their difference. ``reused`` changes only where a resident node changes class
(``promote``), where a reused node leaves the device (``lost``, from ``_account``: every path
that takes KV off the device goes through it) and never at a split (the prefix inherits the
class; the tokens stay). Every path that puts KV on the device gives a node of class 0 (a new
leaf, a load-back, an un-evicted host node) and then asks ``admit`` / ``after_insert`` for its
ghost hits and hits.

Page keys: a cheap per-page chain key, ``hash((key of the previous page, page bytes))`` from a
seed per namespace (Python's 64-bit hash, so ghost lists hold ints: no SHA-256 per page). A
node caches the key of its last page in ``node.aux[at + 1]`` (None: computed on demand from its
parent's, as the page digests are). Keys live in one process only (they are never stored).

The evictable device leaves are in :class:`ArcQueue`: a lazy-deletion heap queue per class,
each in the tree's LRU order (O(log n) a push or a pop).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from asynccache.tree.keys import DEFAULT_NAMESPACE
from asynccache.tree.node import DLEAF, Node
from asynccache.tree.queues import NodeQueue, PolicyKey

if TYPE_CHECKING:
    from asynccache.tree.base import TreeBase

WIDTH = 2  # the entries of Node.aux an arc tree adds at the end: class, last page's key
# Ghost lists of GHOSTS x capacity pages each; p starts at START x capacity (docs/eviction.md:
# measured variants; module settings so that scripts/ablation_eviction.py can try others).
GHOSTS = 2.0
START = 0.5


class Arc:
    """The arc policy's state in one tree: the target ``p``, the reused-class size, the ghost
    lists, and the hooks the tree calls (see the module docstring)."""

    __slots__ = ("at", "capacity", "ghost_cap", "ghost_hits", "ghosts", "p", "page", "reused",
                 "start", "tree")

    def __init__(self, tree: TreeBase, at: int, capacity_pages: int, *,
                 ghosts: float | None = None, start: float | None = None) -> None:
        ghosts = GHOSTS if ghosts is None else ghosts
        start = START if start is None else start
        self.start = start
        self.tree = tree
        self.at = at  # node.aux[at]: class (0 once, 1 reused); node.aux[at + 1]: chain key
        self.page = tree.page_size
        self.capacity = capacity_pages
        self.ghost_cap = max(1, int(ghosts * capacity_pages))
        self.p = start * capacity_pages  # target size of the once class, in pages
        self.reused = 0  # device tokens of resident reused-class nodes
        self.ghosts: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (
            OrderedDict(), OrderedDict())
        self.ghost_hits = [0, 0]  # ghost hits so far, per list (for reports and tests)

    def reset(self) -> None:
        self.p = self.start * self.capacity
        self.reused = 0
        self.ghosts[0].clear()
        self.ghosts[1].clear()
        self.ghost_hits = [0, 0]

    # ------------------------------------------------------------------ sizes
    def once_tokens(self) -> int:
        """Device tokens of the once class: every resident node's tokens but the reused."""
        t = self.tree
        return t._evictable + t._protected - self.reused

    def once_first(self) -> bool:
        """Does the next victim come from the once class (it holds more than ``p`` pages)?"""
        return self.once_tokens() > self.p * self.page

    # ------------------------------------------------------------------ page keys
    def _seed(self, n: Node) -> int:
        ns = n.ns
        if ns is DEFAULT_NAMESPACE:
            return 0
        return hash((ns.extra_key, ns.cache_salt))

    def chain_key(self, n: Node) -> int:
        """The key of ``n``'s last page (root: its namespace seed), cached on the node."""
        key: int | None = n.aux[self.at + 1]
        if key is not None:
            return key
        root = self.tree._root
        chain: list[Node] = []
        cur: Node | None = n
        while cur is not None and cur is not root and cur.aux[self.at + 1] is None:
            chain.append(cur)
            cur = cur.parent
        last = 0
        for node in reversed(chain):
            last = self.page_keys(node)[-1]
        return last

    def page_keys(self, n: Node) -> list[int]:
        """The keys of ``n``'s pages, root first (sets ``n``'s cached key)."""
        parent = n.parent
        assert parent is not None
        prev = self._seed(n) if parent is self.tree._root else self.chain_key(parent)
        data = n.key
        pb = self.tree._pb
        keys: list[int] = []
        append = keys.append
        for off in range(0, len(data), pb):
            prev = hash((prev, data[off : off + pb]))
            append(prev)
        n.aux[self.at + 1] = prev
        return keys

    # ------------------------------------------------------------------ classes
    def promote(self, n: Node) -> None:
        """``n`` (a resident node) becomes reused-class; re-filed if it is a queued leaf."""
        aux = n.aux
        if aux[self.at]:
            return
        aux[self.at] = 1
        if n.acct:
            self.reused += n.ntok
        if aux[DLEAF] is not None:
            self.tree._queues[DLEAF].push(n)

    def lost(self, n: Node) -> None:
        """``n`` left the device (called by ``_account``): its page keys go to its class's
        ghost list, and it is no longer of either class."""
        aux = n.aux
        cls = 1 if aux[self.at] else 0
        if cls:
            self.reused -= n.ntok
            aux[self.at] = 0
        ghost = self.ghosts[cls]
        for k in self.page_keys(n):
            if k in ghost:
                ghost.move_to_end(k)
            else:
                ghost[k] = None
        while len(ghost) > self.ghost_cap:
            ghost.popitem(last=False)

    def _ghost_hit(self, k: int) -> bool:
        once, reused = self.ghosts
        if k in once:
            self.p = min(float(self.capacity), self.p + max(1.0, len(reused) / len(once)))
            del once[k]
            self.ghost_hits[0] += 1
            return True
        if k in reused:
            self.p = max(0.0, self.p - max(1.0, len(once) / len(reused)))
            del reused[k]
            self.ghost_hits[1] += 1
            return True
        return False

    def admit(self, n: Node) -> None:
        """``n`` came back on device (a load-back, a host node given slots again): each of its
        pages found in a ghost list moves ``p``; any such page makes the node reused."""
        hit = False
        for k in self.page_keys(n):
            if self._ghost_hit(k):
                hit = True
        if hit:
            self.promote(n)

    def admit_new(self, n: Node) -> None:
        """``n`` is a new device node of an insert: its pages found in a ghost list are
        reused-class, the others once. A node holding both is split into runs of one class
        (top first; ``n`` keeps the last run)."""
        keys = self.page_keys(n)
        flags = [self._ghost_hit(k) for k in keys]
        if not any(flags):
            return
        tree = self.tree
        pb = tree._pb
        i = 0
        while True:
            j = i
            while j < len(flags) and flags[j] == flags[i]:
                j += 1
            if j == len(flags):
                if flags[i]:
                    self.promote(n)
                return
            p = tree._split(n, (j - i) * pb)
            p.aux[self.at + 1] = keys[j - 1]
            if flags[i]:
                self.promote(p)
            i = j

    def after_insert(self, last_id: int, inserted_len: int, clock0: int) -> None:
        """An insert ended at node ``last_id``: its new nodes (created after ``clock0``) are
        admitted, top first, and the walked nodes it counts a hit on (ending past
        ``inserted_len``, as the tree's hit count) become reused."""
        tree = self.tree
        root = tree._root
        n = tree._nodes[last_id]
        path: list[Node] = []
        while n is not root:
            path.append(n)
            assert n.parent is not None
            n = n.parent
        if not path:
            return
        end = sum(x.ntok for x in path)
        new: list[Node] = []
        for x in path:  # deepest first
            if x.creation > clock0:
                new.append(x)
            elif end > inserted_len and x.value is not None:
                self.promote(x)
            end -= x.ntok
        for x in reversed(new):
            if x.value is not None:
                self.admit_new(x)

    # ------------------------------------------------------------------ inspection
    def stats(self) -> dict[str, Any]:
        return {"p": self.p, "capacity": self.capacity, "reused_tokens": self.reused,
                "once_tokens": self.once_tokens(), "ghost_once": len(self.ghosts[0]),
                "ghost_reused": len(self.ghosts[1]), "ghost_hits_once": self.ghost_hits[0],
                "ghost_hits_reused": self.ghost_hits[1]}


class ArcQueue:
    """The evictable device leaves of an arc tree: one :class:`~asynccache.tree.queues.NodeQueue`
    per class over the same node slot, each in the policy key's order (LRU, sessions last). A
    class's key leads with the class, so a node's live entry (``node.aux[slot]``) says which
    queue holds it: ``(class, *key, seq, node id)``. A pop chooses the class by
    :meth:`Arc.once_first`."""

    __slots__ = ("_classes", "_slot", "arc")

    def __init__(self, slot: int, key: PolicyKey, nodes: dict[int, Node]) -> None:
        self._slot = slot
        self._classes = (NodeQueue(slot, lambda n: (0, *key(n)), nodes),
                         NodeQueue(slot, lambda n: (1, *key(n)), nodes))
        self.arc: Arc | None = None  # set by the tree once its Arc exists

    def __len__(self) -> int:
        return len(self._classes[0]) + len(self._classes[1])

    def live(self, cls: int) -> int:
        return len(self._classes[cls])

    def push(self, node: Node) -> None:
        """Add ``node`` to its class's queue, or re-file it (new key or new class)."""
        arc = self.arc
        assert arc is not None
        cls = 1 if node.aux[arc.at] else 0
        old = node.aux[self._slot]
        if old is not None and old[0] != cls:
            self._classes[old[0]].discard(node)
        self._classes[cls].push(node)

    def discard(self, node: Node) -> None:
        old = node.aux[self._slot]
        if old is not None:
            self._classes[old[0]].discard(node)

    def pop(self) -> Node | None:
        """The least recently used evictable leaf of the class the policy evicts now (of the
        other class when that one has none), or None when empty."""
        arc = self.arc
        assert arc is not None
        first = 0 if arc.once_first() else 1
        for q in (self._classes[first], self._classes[1 - first]):
            if len(q):
                return q.pop()
        return None

    def clear(self) -> None:
        for q in self._classes:
            q.clear()
