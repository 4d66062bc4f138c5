"""Eviction queues: each step is O(log n), no call re-heaps all leaves (issue 2); entries hold no
node references; the component LRU order."""

from __future__ import annotations

import gc

import pytest

import asynccache.tree.queues as queues
from asynccache.tree import RadixTree
from asynccache.tree.components.layout import EMPTY, QE, QUEUES, STAMP
from asynccache.tree.components.lru import LruQueue
from asynccache.tree.keys import DEFAULT_NAMESPACE
from asynccache.tree.node import DLEAF, Node


@pytest.mark.parametrize(("policy", "sessions"), [("lru", True), ("lfu", False),
                                                  ("priority", False), ("fifo", False)])
def test_evict_never_reheaps_all_leaves(policy: str, sessions: bool, monkeypatch) -> None:
    tree = RadixTree(page_size=1, eviction_policy=policy, enable_sessions=sessions)
    for i in range(2000):
        tree.insert([i // 40, 10_000 + i], [2 * i, 2 * i + 1])  # 50 parents x 40 leaves
    dq = tree._queues[0]
    calls = {"key": 0, "heapify": 0}
    key = dq._key

    def counting_key(node):
        calls["key"] += 1
        return key(node)

    real_heapify = queues.heapq.heapify

    def counting_heapify(heap):
        calls["heapify"] += 1
        real_heapify(heap)

    dq._key = counting_key
    monkeypatch.setattr(queues.heapq, "heapify", counting_heapify)
    freed = 0
    for _ in range(500):
        res = tree.evict(1)
        freed += res.num_evicted
    assert freed == 500
    assert calls["heapify"] == 0
    # Keys are only computed for parents that become leaves: at most one per victim.
    assert calls["key"] <= 500
    tree.sanity_check()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_queue_stays_compact_under_many_touches(policy: str) -> None:
    tree = RadixTree(page_size=1, eviction_policy=policy)
    for i in range(100):
        tree.insert([i], [i])
    for _ in range(50):
        for i in range(100):
            tree.match_prefix([i])  # every touch re-keys the leaf
    dq = tree._queues[0]
    assert len(dq) == 100
    if isinstance(dq, queues.StampQueue):  # lru: no stale entry at all
        assert len(dq._ids) == 100 and not dq._dups and sum(dq._counts.values()) == 100
    else:  # lazy deletion: orphans bounded by the live entries
        assert len(dq._heap) <= 2 * len(dq) + 64
    order = [int(tree.evict(1).device_frees[0][0]) for _ in range(100)]
    assert order == list(range(100))  # still exact LRU after all the re-keying
    tree.sanity_check()


@pytest.mark.parametrize("policy", ["lru", "mru"])
def test_stamp_queue_has_no_orphans_after_a_match_pass(policy: str) -> None:
    """A match pass that touches every leaf leaves nothing stale: the next evict takes one
    find for its victim (with a heap the first call popped through one orphan per leaf)."""
    tree = RadixTree(page_size=1, eviction_policy=policy)
    for i in range(2000):
        tree.insert([i // 40, 10_000 + i], [2 * i, 2 * i + 1])
    for i in range(2000):
        tree.match_prefix([i // 40, 10_000 + i])
    dq = tree._queues[0]
    assert isinstance(dq, queues.StampQueue)
    assert len(dq._ids) == len(dq) == 2000 and not dq._dups
    first = 10_000 if policy == "lru" else 11_999
    res = tree.evict(1)
    assert res.device_frees[0].tolist() == [2 * (first - 10_000) + 1]
    assert len(dq._ids) == len(dq) == 1999
    tree.sanity_check()


def test_stamp_queue_equal_stamps_and_old_stamps() -> None:
    """Equal stamps keep filing order; a node filed under a stamp below the base moves it."""
    nodes: dict[int, Node] = {}
    q = queues.StampQueue(DLEAF, nodes)
    made = {}
    for node_id, stamp in ((1, 100_000), (2, 100_000), (3, 5), (4, 200_000)):
        n = Node(node_id, None, b"", DEFAULT_NAMESPACE, [None] * QUEUES)
        n.last_access = stamp
        nodes[node_id] = made[node_id] = n
        q.push(n)
    made[2].last_access = 7  # re-filed lower
    q.push(made[2])
    q.discard(made[4])
    assert [q.pop().id for _ in range(3)] == [3, 2, 1]
    assert q.pop() is None and len(q) == 0
    assert all(n.aux[DLEAF] is None for n in made.values())
    for node_id in (4, 1, 2):  # equal stamps come out in filing order
        made[node_id].last_access = 50
        q.push(made[node_id])
    q.discard(made[1])
    assert [q.pop().id for _ in range(2)] == [4, 2] and q.pop() is None


def test_queue_entries_hold_no_nodes() -> None:
    """Entries name their node by id: the collector untracks the tree queues' tuples and never
    tracks the component LRU entries (ints), so queued nodes add nothing to its collections."""
    tree = RadixTree(page_size=1, sliding_window=2, mamba=True)
    for i in range(4):
        tree.insert([0, 1, 10 + i, 20 + i], [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3],
                    mamba_value=i)
    gc.collect()
    nodes = list(tree.iter_nodes())
    leaves = [n for n in nodes if not n.children]
    assert len(leaves) == 4
    for n in leaves:
        entry = n.aux[DLEAF]  # lru: the node's access stamp (a StampQueue entry)
        assert type(entry) is int and entry == n.last_access
        assert not gc.is_tracked(entry)
    swa, mamba = tree._swa, tree._mamba
    assert swa is not None and mamba is not None
    for c in (swa, mamba):
        entries = [n.aux[c.at + QE] for n in nodes if n.aux[c.at + QE] is not None]
        assert entries and all(type(e) is int for e in entries)
    tree.sanity_check()


def test_lru_queue_order_refile_and_orphans() -> None:
    """LruQueue: least recent stamp first, ties by node id (oldest first); a node touched
    since it was queued is re-filed under its new stamp; a deleted or discarded node is
    skipped."""
    nodes: dict[int, Node] = {}
    q = LruQueue(QUEUES, nodes)
    made = []
    for node_id, stamp in ((5, 7), (3, 7), (4, 2), (9, 1), (8, 6)):
        n = Node(node_id, None, b"", DEFAULT_NAMESPACE, [None] * QUEUES + list(EMPTY))
        n.aux[QUEUES + STAMP] = stamp
        nodes[node_id] = n
        made.append(n)
        q.push(n)
    assert len(q) == 5
    nodes[9].aux[QUEUES + STAMP] = 8  # touched since queued: re-filed, now the most recent
    q.discard(nodes[8])
    q.discard(nodes[4])
    del nodes[4]  # deleted: the pop finds no node for its orphaned entry
    assert len(q) == 3
    popped = []
    while (n := q.pop()) is not None:
        popped.append(n.id)
    assert popped == [3, 5, 9]
    assert len(q) == 0
    assert all(m.aux[QUEUES + QE] is None for m in made)
