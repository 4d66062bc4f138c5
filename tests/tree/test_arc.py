"""The ``arc`` eviction policy (asynccache/tree/arc.py, docs/eviction.md): exact victims on
hand-made sequences, the target's moves on ghost hits, the fallback between classes, a property
test against a page-level reference model of the ARC rules, and host-tier / hybrid smoke runs.
Every step is followed by ``sanity_check`` (which checks the arc bookkeeping too)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.errors import ConfigError
from asynccache.tree import RadixKey, RadixTree, TreeConfig
from asynccache.tree.arc import Arc


class Driver:
    """Requests as the engine serves them: match, lock the matched node, make room, insert with
    ``prev_prefix_len`` = the match, unlock. Page ``i`` of a path is ``ps`` tokens of its
    symbol; each new token gets a fresh slot; the slots of every victim are recorded."""

    def __init__(self, capacity_pages: int, ps: int = 1, **kw: Any) -> None:
        self.ps = ps
        self.tree = RadixTree(page_size=ps, eviction_policy="arc",
                              device_tokens=capacity_pages * ps, **kw)
        self.capacity = capacity_pages
        self.next = 1000
        self.owner: dict[int, tuple[int, ...]] = {}  # first slot of a page -> its path

    @property
    def arc(self) -> Arc:
        arc = self.tree._arc
        assert arc is not None
        return arc

    def tokens(self, path: tuple[int, ...]) -> list[int]:
        return [t for s in path for t in [s] * self.ps]

    def serve(self, path: tuple[int, ...], *, room: bool = True) -> int:
        """Serve ``path`` (page symbols); returns the pages matched on device."""
        t = self.tree
        key = self.tokens(path)
        m = t.match_prefix(key)
        receipt = t.lock(m.last_device_node)
        matched = m.device_prefix_len // self.ps
        need = (len(path) - matched) * self.ps
        if room:
            while t.device_size + need > self.capacity * self.ps:
                if not t.evict(self.ps).num_evicted:
                    break
                t.sanity_check()
        slots = np.concatenate([m.device_indices,
                                np.arange(self.next, self.next + need, dtype=np.int64)])
        for i in range(matched, len(path)):
            self.owner[self.next + (i - matched) * self.ps] = path[: i + 1]
        self.next += need
        res = t.insert(key, slots, prev_prefix_len=m.device_prefix_len)
        assert not res.device_frees
        t.unlock(receipt)
        t.sanity_check()
        return matched

    def evict_one(self) -> list[tuple[int, ...]]:
        """Evict one node; returns its pages' paths."""
        res = self.tree.evict(1)
        self.tree.sanity_check()
        out = []
        for f in res.device_frees:
            out += [self.owner[int(f[i])] for i in range(0, len(f), self.ps)]
        return out

    def cls(self, path: tuple[int, ...]) -> int:
        """The arc class of the node holding the last page of ``path``."""
        m = self.tree.match_prefix(self.tokens(path))
        assert m.device_prefix_len == len(path) * self.ps
        return int(self.tree._node(m.last_device_node).aux[self.arc.at])


@pytest.mark.parametrize("ps", [1, 4])
def test_once_used_tail_goes_before_a_reused_prefix(ps: int) -> None:
    d = Driver(8, ps)
    d.serve((1, 2))  # R: inserted ...
    d.serve((1, 2))  # ... and hit by a later request: reused
    assert d.cls((1, 2)) == 1 and d.arc.reused == 2 * ps
    for s in (10, 20, 30):
        d.serve((s,))  # once-used leaves, all more recent than R
    # 3 once pages + 2 reused: the once class (3) is over the target (4)? no: 3 <= 4, so the
    # reused class goes first ...
    assert d.arc.p == 4 and d.arc.once_tokens() == 3 * ps
    d.serve((40,))
    d.serve((50,))
    # ... now 5 once pages > p = 4: the least recently used once leaf goes, not the older R.
    assert d.evict_one() == [(10,)]
    # 4 once pages <= p: the reused class, LRU first (the whole node: both of R's pages).
    assert d.evict_one() == [(1,), (1, 2)]
    # The reused class is empty now: the once class again (the fallback).
    assert d.evict_one() == [(20,)]
    lru = RadixTree(page_size=ps, device_tokens=8 * ps)
    for toks in ([1, 2], [1, 2], [10], [20], [30], [40], [50]):
        key = [t for s in toks for t in [s] * ps]
        m = lru.match_prefix(key)
        lru.insert(key, np.arange(1000 + 100 * toks[0], 1000 + 100 * toks[0] + len(key)),
                   prev_prefix_len=m.device_prefix_len)
    assert lru.evict(1).device_frees[0][0] == 1100  # LRU takes the old reused prefix first


def test_ghost_hit_on_a_once_page_grows_p() -> None:
    d = Driver(8)
    d.serve((1,))
    d.serve((1,))  # reused
    for s in (10, 20, 30, 40, 50):
        d.serve((s,))
    assert d.evict_one() == [(10,)]
    assert list(d.arc.ghosts[0]) and not d.arc.ghosts[1]
    assert d.arc.p == 4
    d.serve((10,))  # its key is in the once ghost list: p grows by max(1, 0 / 1) = 1
    assert d.arc.p == 5 and d.arc.ghost_hits == [1, 0]
    assert d.cls((10,)) == 1 and not d.arc.ghosts[0]


def test_ghost_hit_on_a_reused_page_shrinks_p() -> None:
    d = Driver(4)
    d.serve((1,))
    d.serve((1,))
    d.serve((2,))
    d.serve((2,))  # two reused leaves, no once page: reused first
    assert d.evict_one() == [(1,)]
    assert len(d.arc.ghosts[1]) == 1
    d.serve((5,))  # once page; (1,)'s key is in the reused ghost list
    assert d.evict_one() == [(2,)]  # 1 once page <= p = 2: the reused class
    assert d.evict_one() == [(5,)]  # the reused class is empty: the fallback takes once
    d.serve((1,))  # a reused-ghost hit: p shrinks by max(1, |once| / |reused|) = 1
    assert d.arc.p == 1 and d.arc.ghost_hits == [0, 1]
    assert d.cls((1,)) == 1


def test_p_stays_within_bounds_and_ghosts_are_trimmed() -> None:
    d = Driver(3)
    for r in range(60):
        d.serve((r % 5,))
        if r % 3 == 0:
            d.serve((r % 2, 9))
    assert 0 <= d.arc.p <= 3
    assert all(len(g) <= 6 for g in d.arc.ghosts)
    assert sum(d.arc.ghost_hits) > 0


def test_fallback_when_the_chosen_class_has_no_evictable_leaf() -> None:
    d = Driver(8)
    d.serve((1, 2, 3))
    d.serve((1, 2, 3))  # a reused node of 3 pages
    d.serve((1, 2, 3, 4))  # a once leaf below it: the reused node is inner now
    for s in (7, 8):
        d.serve((s,))
    d.serve((7,))
    d.serve((8,))  # (7,) and (8,) reused
    # once = 1 page <= p: the reused class first, LRU: (7,)
    assert d.evict_one() == [(7,)]
    # lock the reused (8,): the reused class has no evictable leaf, the once class's goes
    m = d.tree.match_prefix([8])
    rec = d.tree.lock(m.last_device_node)
    assert d.evict_one() == [(1, 2, 3, 4)]
    assert d.evict_one() == [(1,), (1, 2), (1, 2, 3)]  # now a reused leaf
    assert d.evict_one() == []
    d.tree.unlock(rec)
    d.tree.sanity_check()


def test_new_leaf_split_into_runs_of_one_class() -> None:
    d = Driver(6)
    d.serve((1, 2, 3))
    for s in (10, 20, 30):
        d.serve((s,))
    # a once node of 3 pages: its keys go to the ghosts
    assert d.evict_one() == [(1,), (1, 2), (1, 2, 3)]
    assert len(d.arc.ghosts[0]) == 3
    d.serve((1, 2, 9, 9))  # pages 1, 2 are ghost hits, 9, 9 new: two nodes
    assert d.arc.ghost_hits == [2, 0]
    assert d.cls((1, 2)) == 1 and d.cls((1, 2, 9, 9)) == 0
    assert d.arc.reused == 2 and d.tree.node_count == 4


def test_chunked_prefill_does_not_promote_its_own_pages() -> None:
    """The second insert of the same request (inserted_len) counts no hit on what it inserted."""
    t = RadixTree(page_size=1, eviction_policy="arc", device_tokens=16)
    t.insert([1, 2, 3], np.arange(3))
    t.insert([1, 2, 3, 4, 5], np.arange(5), prev_prefix_len=3, inserted_len=3)
    t.sanity_check()
    assert t._arc is not None and t._arc.reused == 0


def test_arc_needs_the_device_capacity() -> None:
    with pytest.raises(ConfigError, match="eviction_policy 'arc' needs device_tokens"):
        TreeConfig(page_size=4, eviction_policy="arc")
    with pytest.raises(ConfigError, match="device_tokens must be an int >= 0, got -1"):
        TreeConfig(device_tokens=-1)
    with pytest.raises(ConfigError, match="unknown eviction policy 'ARC'"):
        TreeConfig(eviction_policy="ARC", device_tokens=16)


def test_reset_clears_the_arc_state() -> None:
    d = Driver(4)
    for s in (1, 2, 3, 4, 5, 6):
        d.serve((s,))
    d.serve((6,))
    d.tree.reset()
    d.tree.sanity_check()
    assert d.arc.p == 2 and d.arc.reused == 0 and not any(d.arc.ghosts)


# ---------------------------------------------------------------------------- reference model
class PageModel:
    """The ARC rules on whole pages (scripts/sim_eviction.py, in the engine's order: a request
    matches and touches its cached prefix, then eviction makes room with the matched pages
    locked, then its insert counts a hit on the matched pages (reused) and admits the new one).
    Every request adds at most one page, so every node of the tree is one page."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.stamp: dict[tuple[int, ...], int] = {}
        self.reused: set[tuple[int, ...]] = set()
        self.ghost: tuple[dict[tuple[int, ...], None], dict[tuple[int, ...], None]] = ({}, {})
        self.p = capacity / 2
        self.clock = 0

    def leaves(self, locked: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
        parents = {k[:-1] for k in self.stamp}
        return [k for k in self.stamp if k not in parents and k not in locked]

    def evict(self, locked: set[tuple[int, ...]]) -> tuple[int, ...]:
        once = len(self.stamp) - len(self.reused)
        first = 0 if once > self.p else 1
        cands = self.leaves(locked)
        for cls in (first, 1 - first):
            mine = [k for k in cands if (k in self.reused) == bool(cls)]
            if mine:
                victim = min(mine, key=self.stamp.__getitem__)
                del self.stamp[victim]
                self.reused.discard(victim)
                g = self.ghost[cls]
                g.pop(victim, None)
                g[victim] = None
                while len(g) > 2 * self.capacity:
                    del g[next(iter(g))]
                return victim
        raise AssertionError("nothing evictable")

    def admit(self, page: tuple[int, ...]) -> None:
        once, reused = self.ghost
        if page in once:
            self.p = min(self.capacity, self.p + max(1.0, len(reused) / len(once)))
            del once[page]
            self.reused.add(page)
        elif page in reused:
            self.p = max(0.0, self.p - max(1.0, len(once) / len(reused)))
            del reused[page]
            self.reused.add(page)

    def touch(self, page: tuple[int, ...]) -> None:
        self.clock += 1
        self.stamp[page] = self.clock


path = st.lists(st.integers(0, 3), min_size=1, max_size=4).map(tuple)
# Requests drawn from a small pool of paths, so that pages come back (hits, ghost hits).
requests = st.lists(path, min_size=2, max_size=12).flatmap(
    lambda pool: st.lists(st.sampled_from(pool), min_size=1, max_size=120))


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(reqs=requests, capacity=st.integers(6, 9), ps=st.sampled_from([1, 2]))
def test_victims_match_the_reference_model(reqs: list[tuple[int, ...]], capacity: int,
                                           ps: int) -> None:
    _check_against_model(reqs, capacity, ps)


@pytest.mark.parametrize("seed", range(12))
def test_long_random_runs_match_the_reference_model(seed: int) -> None:
    rng = random.Random(seed)
    pool = [tuple(rng.randrange(4) for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(4, 16))]
    reqs = [rng.choice(pool) for _ in range(400)]
    _check_against_model(reqs, rng.randint(5, 12), rng.choice([1, 2]))


def _check_against_model(reqs: list[tuple[int, ...]], capacity: int, ps: int) -> None:
    d = Driver(capacity, ps)
    model = PageModel(capacity)
    for path in reqs:
        key = d.tokens(path)
        t = d.tree
        m = t.match_prefix(key)
        matched = m.device_prefix_len // ps
        assert matched == max((i for i in range(len(path) + 1) if path[:i] in model.stamp
                               or i == 0), default=0)
        for i in range(1, matched + 1):
            model.touch(path[:i])
        want = path[: matched + 1]  # at most one new page
        receipt = t.lock(m.last_device_node)
        locked = {path[:i] for i in range(1, matched + 1)}
        if len(want) > matched and len(model.stamp) >= capacity:
            victim = model.evict(locked)
            got = d.evict_one()
            assert got == [victim], (got, victim)
        slots = np.concatenate([m.device_indices,
                                np.arange(d.next, d.next + (len(want) - matched) * ps)])
        if len(want) > matched:
            d.owner[d.next] = want
            d.next += ps
        t.insert(d.tokens(want), slots, prev_prefix_len=m.device_prefix_len)
        t.unlock(receipt)
        t.sanity_check()
        for i in range(1, matched + 1):
            model.reused.add(path[:i])
            model.touch(path[:i])
        if len(want) > matched:
            model.admit(want)
            model.touch(want)
        assert d.arc.p == pytest.approx(model.p)
        assert d.arc.reused == len(model.reused) * ps
        assert {k for k in model.stamp} == set(_cached_paths(d))
        assert [len(g) for g in d.arc.ghosts] == [len(g) for g in model.ghost]


def _cached_paths(d: Driver) -> list[tuple[int, ...]]:
    out = []
    for n in d.tree.iter_nodes():
        if n.value is not None:
            toks = d.tree.node_key(n.id).tokens
            out.append(tuple(toks[:: d.ps]))
    return out


# ---------------------------------------------------------------------------- host tier, hybrid
def test_host_tier_demote_and_load_back_keep_the_bookkeeping() -> None:
    t = RadixTree(page_size=2, eviction_policy="arc", device_tokens=8, host_enabled=True,
                  write_policy="write_through")
    host = iter(range(10_000, 20_000, 2))
    dev = iter(range(0, 10_000, 2))

    def insert(tokens: list[int]) -> int:
        m = t.match_prefix(tokens)
        slots = np.concatenate([m.device_indices] + [
            np.arange(s, s + 2) for s in (next(dev) for _ in range((len(tokens) -
                                                                    m.device_prefix_len) // 2))])
        res = t.insert(tokens, slots, prev_prefix_len=m.device_prefix_len)
        for b in res.backups:
            t.commit_backup(b.op_id, np.concatenate(
                [np.arange(s, s + 2) for s in (next(host) for _ in range(len(b.device_slots) // 2))]))
        t.sanity_check()
        return res.last_node

    a = insert([1, 1, 2, 2])
    insert([1, 1, 2, 2])  # reused
    insert([5, 5])
    r = t.evict(4)  # demotes (backed up): keys go to the ghost lists
    t.sanity_check()
    assert r.num_evicted >= 4
    arc = t._arc
    assert arc is not None
    ghosts = len(arc.ghosts[0]) + len(arc.ghosts[1])
    assert ghosts >= 2
    node = t._node(a)
    if node.value is None:
        chain = t.host_chain(a)
        need = sum(t._node(i).ntok for i in chain if t._node(i).value is None)
        ticket = t.start_load_back(a, np.arange(50_000, 50_000 + need))
        t.sanity_check()
        assert sum(arc.ghost_hits) >= 1  # its pages were in a ghost list
        t.commit_load_back(ticket.op_id)
        t.sanity_check()
    insert([1, 1, 2, 2, 3, 3])
    t.evict(100)
    t.sanity_check()
    t.evict_host(100)
    t.sanity_check()
    assert t.device_size == 0 and arc.reused == 0


def test_hybrid_swa_tree_evicts_through_the_full_queue() -> None:
    t = RadixTree(page_size=1, eviction_policy="arc", device_tokens=12, sliding_window=2)
    nxt = 0
    for path in ([1, 2, 3], [1, 2, 3], [4, 5], [6, 7], [1, 2, 3, 8], [9], [4, 5]):
        m = t.match_prefix(path)
        n = len(path) - m.device_prefix_len
        while t.device_size + n > 12:
            assert t.evict(1).num_evicted
            t.sanity_check()
        slots = np.concatenate([m.device_indices, np.arange(nxt, nxt + n)])
        nxt += n
        t.insert(path, slots, prev_prefix_len=m.device_prefix_len)
        t.sanity_check()
        t.evict(0, swa_num_tokens=1)
        t.sanity_check()
    assert t._arc is not None and sum(len(g) for g in t._arc.ghosts) > 0


def test_namespaces_have_their_own_page_keys() -> None:
    """The same tokens in another namespace are other pages: no ghost hit across namespaces."""
    t = RadixTree(page_size=2, eviction_policy="arc", device_tokens=8)
    arc = t._arc
    assert arc is not None
    lora = RadixKey([1, 1, 2, 2], extra_key="lora-a")
    t.insert(lora, np.arange(4))
    t.sanity_check()
    assert t.evict(4).num_evicted == 4
    t.sanity_check()
    assert len(arc.ghosts[0]) == 2
    t.insert(RadixKey([1, 1, 2, 2]), np.arange(10, 14))  # default namespace: new pages
    t.sanity_check()
    assert arc.ghost_hits == [0, 0]
    t.insert(RadixKey([1, 1, 2, 2], extra_key="lora-a"), np.arange(20, 24))
    t.sanity_check()
    assert arc.ghost_hits == [2, 0] and arc.reused == 4


def test_eagle_tree_under_arc() -> None:
    t = RadixTree(page_size=2, eviction_policy="arc", device_tokens=8, eagle=True)
    arc = t._arc
    assert arc is not None
    t.insert([1, 2, 3, 4, 5], np.arange(5))  # 4 bigram positions: 2 pages
    t.insert([1, 2, 3, 4, 5], np.arange(5))  # hit: reused
    t.insert([7, 8, 9], np.arange(10, 13))
    t.sanity_check()
    assert arc.reused == 4 and arc.once_tokens() == 2
    # 1 once page <= p = 2 pages: the reused leaf goes first (its 2 pages, 4 positions)
    assert t.evict(1).num_evicted == 4
    t.sanity_check()
    assert (len(arc.ghosts[0]), len(arc.ghosts[1])) == (0, 2)
    t.insert([1, 2, 3, 4, 5], np.arange(20, 25))  # back: two reused-ghost hits
    t.sanity_check()
    assert arc.ghost_hits == [0, 2] and arc.reused == 4
