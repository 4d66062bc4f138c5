"""Hypothesis stateful test of the tree's eviction *victims* against a naive reference tree.

The model below is written from the reference's rules (behavior.md 1.3, 1.4, 1.5, 1.17), not
from the tree's code: a plain radix tree of page symbols whose operations scan every node.

* access stamps come from one logical clock: a split gives the new prefix a fresh stamp, then
  the suffix another (SGLang 0.5.23 stamps a node when it creates it); an insert stamps each node it walks, top first, then its new leaf; a
  match stamps every node it walked, deepest newest;
* hit counting: an insert counts a hit on every node it walks, a new leaf starts at 1; none
  under write-back;
* write-through backs up a node (with its un-backed ancestors) once its hits reach the
  threshold (1: write_through, 2: write_through_selective); write-back at eviction;
* evict: the device leaf (no child on device) first in policy order goes; backed up: demoted;
  else deleted with its host-only subtree, or under write-back backed up first (the victims a
  call counted while they waited for their copies are demoted first by the next call);
* evict_host: host-only leaves in policy order, and host copies of device nodes only under
  write-back (first there) or when asked, and then (under write-through) only those with no
  host-copied child, in policy order. Under write-back they go in the order SGLang 0.5.23
  reclaims them (tests/tree/test_sglang_write_back.py checks that order against its own tree):
  a node joins the order when it becomes a duplicate (its backup committed, its device KV given
  back by an insert or a load-back, deepest first, or split off one as the new prefix) unless it
  still has an entry; an entry goes when its node is deleted or when a reclaim pass reaches it
  and it is no longer a duplicate. A first pass spares the device leaves, a second takes them;
  a pass stops as soon as enough is free.

Every evict and evict_host must free exactly the slots the model predicts, in the same order;
inserts must report the predicted duplicates and backups, matches the predicted device and
host hits, load-backs (host trees, FULL only) the predicted host slots. FULL-only and hybrid (SWA) trees, with and without a host tier, every policy,
page sizes 1 and 16. Mamba trees (device only): a state goes to the node ending at the insert's
end, a split leaves it on the suffix, a match's best node is the deepest holding one (only the
path up to it is stamped, then its state: a state's stamp ticks the one clock, as an SWA value's
does, and lru_credit reads the ticks), and a deleted leaf takes with it every ancestor left a leaf without a
state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asynccache.tree import POLICIES, RadixTree
from tests.tree.stateful_cases import machine_case, stateful_settings

POLICY_KEY = {
    "lru": lambda n: (n.access,),
    "mru": lambda n: (-n.access,),
    "fifo": lambda n: (n.creation,),
    "filo": lambda n: (-n.creation,),
    "lfu": lambda n: (n.hits, n.access),
    "priority": lambda n: (n.prio, n.access),
    "lru_credit": lambda n: (n.access + ((n.access - n.creation) // 2 if n.hits >= 2 else 0),
                             n.access),
}
THRESHOLD = {"write_through": 1, "write_through_selective": 2, "write_back": None}


class MNode:
    def __init__(self, pages: list[int], parent: MNode | None) -> None:
        self.pages = pages
        self.parent = parent
        self.children: dict[int, MNode] = {}
        self.dev: np.ndarray | None = None
        self.host: np.ndarray | None = None
        self.access = self.creation = self.hits = self.prio = 0
        self.pending = False  # a write-back backup in flight
        self.state = False  # holds a Mamba state (Mamba trees)


class Model:
    """The naive reference tree (page symbols; ``ps`` slots per page)."""

    def __init__(self, ps: int, policy: str, host: bool, write_policy: str,
                 mamba: bool = False, swa: bool = False) -> None:
        self.ps = ps
        self.mamba = mamba
        # Component values are stamped from the tree's one clock too, so they count in a
        # node's lifetime (lru_credit's key reads stamp differences, not just order;
        # docs/eviction.md). SWA trees stamp each device node's SWA value (a match: the path's
        # device nodes after their FULL stamps; an insert: each walked device node right after
        # its FULL stamp); Mamba trees the state of the node a match or insert ends at, last.
        self.swa = swa
        self.key = POLICY_KEY[policy]
        self.host = host
        self.write_back = host and write_policy == "write_back"
        self.threshold = THRESHOLD[write_policy] if host else None
        self.root = MNode([], None)
        self.clock = 0
        # Write-back: the host duplicates' reclaim order (a node stays listed after it stops
        # being a duplicate, until a reclaim pass reaches it or it is deleted).
        self.dup_order: dict[MNode, None] = {}
        # Write-back: the victims an evict counted while they waited (and parents counted after
        # them), in order; the next evict demotes them first.
        self.owed: list[MNode] = []

    def note_dup(self, n: MNode) -> None:
        """``n`` may have become a host duplicate: list it at the end unless it is listed."""
        if not self.write_back:
            return
        if n.dev is not None and n.host is not None and not n.pending:
            self.dup_order.setdefault(n)
        else:
            self.dup_order.pop(n, None)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def nodes(self) -> list[MNode]:
        out, todo = [], list(self.root.children.values())
        while todo:
            n = todo.pop()
            out.append(n)
            todo.extend(n.children.values())
        return out

    def split(self, n: MNode, k: int) -> MNode:
        """Cut ``n`` after ``k`` pages; the new prefix takes a fresh access, then n another
        (the prefix keeps n's creation)."""
        parent = n.parent
        assert parent is not None and 0 < k < len(n.pages)
        p = MNode(n.pages[:k], parent)
        cut = k * self.ps
        p.dev = None if n.dev is None else n.dev[:cut]
        p.host = None if n.host is None else n.host[:cut]
        n.dev = None if n.dev is None else n.dev[cut:]
        n.host = None if n.host is None else n.host[cut:]
        p.creation, p.hits, p.prio = n.creation, n.hits, n.prio
        p.pending = n.pending
        p.access = self.tick()
        n.access = self.tick()  # (a Mamba state stays on the suffix)
        parent.children[p.pages[0]] = p
        n.pages = n.pages[k:]
        p.children[n.pages[0]] = n
        n.parent = p
        self.note_dup(p)  # (the suffix keeps its place)
        return p

    def _walk(self, key: list[int], visit: Any = None) -> list[tuple[MNode, int]]:
        """Match ``key``, splitting a partly matched node (always the last one walked); each
        walked node and its start, passed to ``visit`` as soon as it is matched."""
        node, i, path = self.root, 0, []
        while i < len(key):
            c = node.children.get(key[i])
            if c is None:
                break
            k = 0
            while k < len(c.pages) and i + k < len(key) and c.pages[k] == key[i + k]:
                k += 1
            if k < len(c.pages):
                c = self.split(c, k)
            path.append((c, i))
            if visit is not None:
                visit(c, i)
            node, i = c, i + k
        return path

    def _backup_chain(self, n: MNode, out: list[MNode]) -> None:
        chain = []
        while n is not self.root and n.host is None and n not in out:
            chain.append(n)
            assert n.parent is not None
            n = n.parent
        out.extend(reversed(chain))

    def insert(self, key: list[int], slots: np.ndarray, prio: int,
               state: bool = False) -> tuple[list[int], list[MNode]]:
        """Returns (duplicate slots, nodes to back up). ``state``: a Mamba state goes to the
        node ending at the key's end (unless it holds one)."""
        ps = self.ps
        dups: list[int] = []
        backups: list[MNode] = []
        def visit(c: MNode, i: int) -> None:
            c.access = self.tick()
            c.prio = max(c.prio, prio)
            span = slots[i * ps : (i + len(c.pages)) * ps]
            if c.dev is None:
                c.dev = span  # a host-only node takes the caller's slots
                self.note_dup(c)
            else:
                dups.extend(span.tolist())
            if self.swa:
                self.tick()
            if not self.write_back:
                c.hits += 1
                if self.threshold is not None and c.hits >= self.threshold:
                    self._backup_chain(c, backups)

        path = self._walk(key, visit)
        node, i = (path[-1][0], path[-1][1] + len(path[-1][0].pages)) if path else (self.root, 0)
        if i < len(key):
            leaf = MNode(key[i:], node)
            leaf.dev = slots[i * ps :]
            leaf.access = leaf.creation = self.tick()
            leaf.hits = 1
            leaf.prio = prio
            node.children[leaf.pages[0]] = leaf
            if self.threshold == 1:
                self._backup_chain(leaf, backups)
            node = leaf
        if state and node is not self.root:
            node.state = True
        if node.state:  # (a Mamba tree) its state is stamped, a new one or the one it held
            self.tick()
        return dups, backups

    def load(self, key: list[int], slots: np.ndarray) -> list[int]:
        """Load the host-only end of ``key``'s matched path back with ``slots`` (after a match
        of ``key``); returns the host slots read, top first."""
        path = [c for c, _ in self._walk(key) if c.dev is None]
        host: list[int] = []
        pos = 0
        for c in path:
            assert c.host is not None
            k = len(c.pages) * self.ps
            c.dev = slots[pos : pos + k]
            pos += k
            host.extend(c.host.tolist())
        assert pos == len(slots)
        for c in reversed(path):
            self.note_dup(c)
        return host

    def backed_up(self, n: MNode, host: np.ndarray) -> None:
        n.host = host
        n.pending = False
        self.note_dup(n)

    def match(self, key: list[int]) -> tuple[int, int]:
        path = [c for c, _ in self._walk(key)]
        if self.mamba:  # the best node is the deepest holding a state; the tail is not stamped
            best = max((i + 1 for i, c in enumerate(path) if c.state), default=0)
            path = path[:best]
        for c in path:
            c.access = self.tick()
        if self.swa:
            for c in path:
                if c.dev is not None:
                    self.tick()
        if self.mamba and path:  # the best node's state
            self.tick()
        dev = sum(len(c.pages) for c in path if c.dev is not None)
        host = sum(len(c.pages) for c in path if c.dev is None)
        return dev * self.ps, host * self.ps

    def _first(self, cands: list[MNode], seen: list[int], host: bool) -> MNode:
        """The candidate first in policy order. Equal keys (split fragments share a creation
        stamp, so fifo / filo can tie on host duplicates) are an implementation choice: any
        tied node is right, so take the one the tree took first (``seen``: the first slot of
        each of its victims, in order)."""
        best = min(map(self.key, cands))
        tied = [c for c in cands if self.key(c) == best]
        order = {s: i for i, s in enumerate(seen)}

        def rank(c: MNode) -> int:
            slots = c.host if host else c.dev
            assert slots is not None
            return order.get(int(slots[0]), len(order))

        return min(tied, key=rank)

    def _remove(self, n: MNode) -> None:
        assert n.parent is not None
        del n.parent.children[n.pages[0]]
        todo = [n]
        while todo:
            d = todo.pop()
            self.dup_order.pop(d, None)
            todo.extend(d.children.values())

    def evict(self, n: int, seen: list[int]) -> tuple[list[list[int]], list[int], list[MNode]]:
        """Returns (device frees in order, host frees of deleted subtrees, write-back victims)."""
        freed = pending = 0
        frees: list[list[int]] = []
        hfrees: list[int] = []
        backups: list[MNode] = []
        # Write-back trees (FULL-only and hybrid alike: the FULL walk ranks leaves by FULL
        # alone) take a victim's parent once all its device children wait for their copies in
        # this call (the reference demotes each victim before the next pop; a parent with a
        # host copy is counted, and demoted by a later call).
        chain = self.write_back
        waiting: set[int] = set()
        owed, self.owed = self.owed, []
        live = {id(x) for x in self.nodes()}
        for x in owed:  # demoted first, in order (the reference did at once)
            if id(x) not in live or x.dev is None:
                continue
            if x.pending:
                self.owed.append(x)
            elif x.host is not None and all(c.dev is None for c in x.children.values()):
                frees.append(x.dev.tolist())
                freed += len(x.dev)
                x.dev = None

        def free_below(x: MNode) -> bool:
            return all(c.dev is None or (chain and id(c) in waiting)
                       for c in x.children.values())

        while freed + pending < n:
            leaves = [x for x in self.nodes() if x.dev is not None and not x.pending
                      and id(x) not in waiting and free_below(x)]
            if not leaves:
                break
            v = self._first(leaves, seen, host=False)
            assert v.dev is not None
            if chain and any(id(c) in waiting for c in v.children.values()):
                if v.host is None:
                    v.pending = True
                    backups.append(v)
                waiting.add(id(v))
                self.owed.append(v)
                pending += len(v.dev)
            elif v.host is not None:  # demote
                frees.append(v.dev.tolist())
                freed += len(v.dev)
                v.dev = None
            elif self.write_back:
                v.pending = True
                backups.append(v)
                waiting.add(id(v))
                self.owed.append(v)
                pending += len(v.dev)
            else:  # delete with the host-only subtree
                frees.append(v.dev.tolist())
                freed += len(v.dev)
                todo = list(v.children.values())
                while todo:
                    d = todo.pop()
                    assert d.dev is None and d.host is not None
                    hfrees.extend(d.host.tolist())
                    todo.extend(d.children.values())
                self._remove(v)
                parent = v.parent
                # An ancestor left a leaf without a state can never end a match: it goes too.
                while (self.mamba and parent is not self.root and parent is not None
                       and not parent.children and not parent.state):
                    assert parent.dev is not None
                    frees.append(parent.dev.tolist())
                    freed += len(parent.dev)
                    self._remove(parent)
                    parent = parent.parent
        return frees, hfrees, backups

    def evict_host(self, n: int, dups: bool | None, seen: list[int]) -> list[list[int]]:
        reclaim = self.write_back if dups is None else dups
        freed = 0
        out: list[list[int]] = []
        if self.write_back and reclaim:
            gone: list[MNode] = []
            for spare_leaves in (True, False):
                if freed >= n:
                    break
                for x in list(self.dup_order):
                    if freed >= n:
                        break
                    if x.dev is None or x.host is None:
                        gone.append(x)
                        continue
                    if x.pending:
                        continue
                    if spare_leaves and all(c.dev is None for c in x.children.values()):
                        continue
                    out.append(x.host.tolist())
                    freed += len(x.host)
                    x.host = None
                    gone.append(x)
            for x in gone:
                self.dup_order.pop(x, None)
        for kind in ("leaf",) if self.write_back else ("leaf", "dup"):
            if kind == "dup" and not reclaim:
                continue
            while freed < n:
                if kind == "leaf":
                    cands = [x for x in self.nodes()
                             if x.dev is None and x.host is not None and not x.children]
                else:
                    cands = [x for x in self.nodes() if x.dev is not None and x.host is not None
                             and all(c.host is None for c in x.children.values())]
                if not cands:
                    break
                v = self._first(cands, seen, host=True)
                assert v.host is not None
                out.append(v.host.tolist())
                freed += len(v.host)
                v.host = None
                if kind == "leaf":
                    self._remove(v)
        return out


class VictimMachine(RuleBasedStateMachine):
    HOST = False
    WRITE_POLICY = "write_through_selective"
    WINDOW = 0  # > 0: a hybrid tree with an SWA component of this window (never reached here)
    MAMBA = False  # a hybrid tree with a Mamba component (device only)

    # (arc: tests/tree/test_arc.py checks its victims against a reference model of its own)
    @initialize(ps=st.sampled_from([1, 16]), policy=st.sampled_from(sorted(set(POLICIES) - {"arc"})))
    def setup(self, ps: int, policy: str) -> None:
        self.ps = ps
        kw: dict[str, Any] = {"host_enabled": self.HOST, "write_policy": self.WRITE_POLICY}
        if self.WINDOW:
            kw["sliding_window"] = self.WINDOW
        if self.MAMBA:
            kw["mamba"] = True
        self.tree = RadixTree(page_size=ps, eviction_policy=policy, **kw)
        self.model = Model(ps, policy, self.HOST, self.WRITE_POLICY, self.MAMBA,
                           swa=bool(self.WINDOW))
        self.next_state = 0
        self.next_slot = 0
        self.by_slot: dict[int, MNode] = {}
        # Each evict's device frees and each evict_host's host frees (the replays below).
        self.victims: list[list[list[int]]] = []
        self.host_victims: list[list[list[int]]] = []

    def _slots(self, n: int) -> np.ndarray:
        out = np.arange(self.next_slot, self.next_slot + n, dtype=np.int64)
        self.next_slot += n
        return out

    def _tokens(self, key: list[int]) -> list[int]:
        return [s for s in key for _ in range(self.ps)]

    def _commit(self, reqs: list[Any], want: list[MNode]) -> None:
        """Commit every backup the tree asked for; they must be exactly the model's."""
        got = sorted(s for r in reqs for s in r.device_slots.tolist())
        assert got == sorted(s for m in want for s in m.dev.tolist())  # type: ignore[union-attr]
        for r in reqs:
            host = self._slots(r.num_tokens) + 10**6
            parts = {name: self._slots(len(v)) + 2 * 10**6
                     for name, v in (r.component_slots or {}).items()}
            self.tree.commit_backup(r.op_id, host, parts or None)
            (m,) = [m for m in want if m.dev is not None and m.dev[0] == r.device_slots[0]]
            self.model.backed_up(m, host)

    @rule(key=st.lists(st.integers(0, 3), min_size=1, max_size=5), prio=st.integers(0, 3),
          state=st.booleans())
    def insert(self, key: list[int], prio: int, state: bool) -> None:
        slots = self._slots(len(key) * self.ps)
        kw: dict[str, Any] = {}
        if self.MAMBA and state:
            self.next_state += 1
            kw["mamba_value"] = self.next_state
        res = self.tree.insert(self._tokens(key), slots, priority=prio, **kw)
        dups, backups = self.model.insert(key, slots, prio, bool(kw))
        got = [s for f in res.device_frees for s in f.tolist()]
        assert got == dups
        self._commit(res.backups, backups)

    @rule(key=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def match(self, key: list[int]) -> None:
        m = self.tree.match_prefix(self._tokens(key))
        assert (m.device_prefix_len, m.host_hit_length) == self.model.match(key)

    @rule(n=st.integers(1, 4))
    def evict(self, n: int) -> None:
        res = self.tree.evict(n * self.ps)
        seen = [int(f[0]) for f in res.device_frees] + [int(b.device_slots[0]) for b in res.backups]
        frees, hfrees, backups = self.model.evict(n * self.ps, seen)
        self.victims.append([f.tolist() for f in res.device_frees])
        assert self.victims[-1] == frees
        assert sorted(s for f in res.host_frees for s in f.tolist()) == sorted(hfrees)
        assert res.num_evicted == sum(map(len, frees))
        self._commit(res.backups, backups)

    @precondition(lambda self: self.HOST and not self.WINDOW and not self.MAMBA)
    @rule(key=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def load_back(self, key: list[int]) -> None:
        """Match ``key`` and load its host hit back (FULL-only trees)."""
        m = self.tree.match_prefix(self._tokens(key))
        assert (m.device_prefix_len, m.host_hit_length) == self.model.match(key)
        if not m.host_hit_length:
            return
        slots = self._slots(self.tree.load_back_sizes(m.best_node)["full"])
        ticket = self.tree.start_load_back(m.best_node, slots)
        assert ticket.host_slots.tolist() == self.model.load(key, slots)
        self.tree.commit_load_back(ticket.op_id)

    @precondition(lambda self: self.HOST)
    @rule(n=st.integers(1, 4), dups=st.sampled_from([None, True, False]))
    def evict_host(self, n: int, dups: bool | None) -> None:
        res = self.tree.evict_host(n * self.ps, reclaim_duplicates=dups)
        seen = [int(f[0]) for f in res.host_frees]
        want = self.model.evict_host(n * self.ps, dups, seen)
        self.host_victims.append([f.tolist() for f in res.host_frees])
        assert self.host_victims[-1] == want

    @invariant()
    def same_shape(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.sanity_check()
        assert self.tree.node_count == len(self.model.nodes())
        dev = sum(len(n.dev) for n in self.model.nodes() if n.dev is not None)
        host = sum(len(n.host) for n in self.model.nodes() if n.host is not None)
        assert (self.tree.device_size, self.tree.host_size) == (dev, host)


SETTINGS = stateful_settings(150)
TestDevice = machine_case(VictimMachine, "Device", SETTINGS)
TestHybridDevice = machine_case(VictimMachine, "HybridDevice", SETTINGS, WINDOW=4096)
# (More examples: a stateless tail matched past its best node, then an evict that tells it from
# a newer leaf, is a long sequence; 150 examples missed a stamping bug that 600 find.)
TestMambaDevice = machine_case(VictimMachine, "MambaDevice", stateful_settings(600), MAMBA=True)
TestHostWriteThrough = machine_case(VictimMachine, "HostWT", SETTINGS, HOST=True,
                                    WRITE_POLICY="write_through")
TestHostSelective = machine_case(VictimMachine, "HostWTS", SETTINGS, HOST=True)
TestHostWriteBack = machine_case(VictimMachine, "HostWB", SETTINGS, HOST=True,
                                 WRITE_POLICY="write_back")
TestHybridHostWriteThrough = machine_case(VictimMachine, "HybridHostWT", SETTINGS, HOST=True,
                                          WRITE_POLICY="write_through", WINDOW=4096)
TestHybridHostSelective = machine_case(VictimMachine, "HybridHostWTS", SETTINGS, HOST=True,
                                       WINDOW=4096)
TestHybridHostWriteBack = machine_case(VictimMachine, "HybridHostWB", SETTINGS, HOST=True,
                                       WRITE_POLICY="write_back", WINDOW=4096)


# ---------------------------------------------------------------- replays of soak findings
def _replay(steps: list[tuple[str, dict[str, Any]]], ps: int, policy: str,
            **attrs: Any) -> VictimMachine:
    """Run ``steps`` (rule name, arguments) on a machine with class ``attrs``, checking the
    tree's shape and invariants after each; returns the machine (its victims recorded)."""
    m = type("Replay", (VictimMachine,), attrs)()
    m.setup(ps=ps, policy=policy)
    m.same_shape()
    for name, kw in steps:
        getattr(m, name)(**kw)
        m.same_shape()
    m.teardown()
    return m


@pytest.mark.parametrize("ps", [1, 16])
def test_replay_mamba_state_stamps_count_in_lru_credit_lifetimes(ps: int) -> None:
    """A Mamba state's stamps tick the tree's one clock, so they count in a node's lifetime
    (lru_credit's credit). [1, 1] (with a state, whose stamps tick too) is hit by [1, 1, 0],
    then split by [1, 0]: the suffix holding the state is refreshed by the split, and its
    lifetime since [1, 1]'s creation, counting the state's ticks, puts it after [1, 0]'s new
    leaf (used once), which goes first."""
    ins = "insert"
    steps: list[tuple[str, dict[str, Any]]] = [
        (ins, {"key": [0], "prio": 0, "state": False}),
        (ins, {"key": [1, 1], "prio": 0, "state": True}),
        (ins, {"key": [1, 1, 0], "prio": 0, "state": False}),
        ("evict", {"n": 1}), ("evict", {"n": 1}),
        ("match", {"key": [0]}),
        (ins, {"key": [0], "prio": 0, "state": False}),
        (ins, {"key": [0], "prio": 0, "state": False}),
        (ins, {"key": [1, 0], "prio": 0, "state": False}),
        ("evict", {"n": 1}), ("evict", {"n": 1}), ("evict", {"n": 1}),
    ]
    got = _replay(steps, ps, "lru_credit", MAMBA=True).victims
    s = [[i * ps + j for j in range(ps)] for i in range(12)]  # slots, a page each
    # [0] (slot 0), [1, 1, 0]'s leaf (5), [0] (6), [1, 0]'s leaf (9), then the state's [1] (2)
    # with its parent [1] (1), left a leaf without a state
    assert got == [[s[0]], [s[5]], [s[6]], [s[9]], [s[2], s[1]]]


@pytest.mark.parametrize("ps", [1, 16])
def test_replay_hybrid_host_insert_stamps_a_split_in_walk_order(ps: int) -> None:
    """A hybrid insert with a host tier splits the node it ends inside when its walk reaches
    it, as every other insert does: after the walk stamped the nodes above (docs/tree.md). [0]
    is hit by a match and [0, 0, 0]; [2] is reused; [0, 0] splits [0, 0, 0]'s leaf below [0]:
    the suffix is refreshed after [0]'s stamps (its FULL and SWA values), so [2] goes first
    (with the split before those stamps, the suffix went)."""
    steps: list[tuple[str, dict[str, Any]]] = [
        ("insert", {"key": [0], "prio": 0, "state": False}),
        ("insert", {"key": [2], "prio": 0, "state": False}),
        ("match", {"key": [0]}),
        ("insert", {"key": [0, 0, 0], "prio": 0, "state": False}),
        ("insert", {"key": [2], "prio": 0, "state": False}),
        ("insert", {"key": [0, 0], "prio": 0, "state": False}),
        ("evict", {"n": 1}), ("evict", {"n": 1}),
    ]
    got = _replay(steps, ps, "lru_credit", HOST=True, WRITE_POLICY="write_through",
                  WINDOW=4096).victims
    # The machine hands out slots a page at a time, device and host alike: [0] 0 (host 1, SWA
    # host 2), [2] 3 (4, 5), [0, 0, 0] 6-8 (its leaf [0, 0] 7-8, host 9-10, SWA host 11-12).
    s = [[i * ps + j for j in range(ps)] for i in range(9)]
    # [2], then the split's suffix ([0, 0, 0]'s last page)
    assert got == [[s[3]], [s[8]]]


@pytest.mark.parametrize("ps", [1, 16])
def test_replay_hybrid_host_insert_splits_a_host_only_node_in_walk_order(ps: int) -> None:
    """The same when the node the insert ends inside is host-only: the walk splits it after
    stamping the nodes above, then gives the prefix the caller's slots. [0, 0, 1, 0] is split
    by [0], hit, and demoted; [0, 0, 0] stamps [0] (and its SWA value), then splits the
    host-only [0, 1, 0]: [1, 0] is refreshed after those stamps, and [0]'s new leaf created
    after it. Demoted, that leaf is the first host leaf to go (with the split before the
    stamps, [1, 0] went)."""
    ins = "insert"
    steps: list[tuple[str, dict[str, Any]]] = [
        (ins, {"key": [0, 0, 1, 0], "prio": 0, "state": False}),
        (ins, {"key": [0], "prio": 0, "state": False}),
        (ins, {"key": [0, 0, 1, 0], "prio": 0, "state": False}),
        ("evict", {"n": 1}),
        (ins, {"key": [0, 0, 0], "prio": 0, "state": False}),
        ("evict", {"n": 1}),
        ("evict_host", {"n": 1, "dups": None}),
    ]
    m = _replay(steps, ps, "lru_credit", HOST=True, WRITE_POLICY="write_through", WINDOW=4096)
    # Slots a page at a time: [0, 0, 1, 0] 0-3 (host 4-7, SWA host 8-11), 12 and 13-16 given
    # back, [0, 0, 0] 17-19 (17 given back, 18 to the split's prefix; the leaf's host 20).
    s = [[i * ps + j for j in range(ps)] for i in range(21)]
    assert m.victims == [[s[1] + s[2] + s[3]], [s[19]]]
    assert m.host_victims == [[[10**6 + i for i in s[20]]]]
