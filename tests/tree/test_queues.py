"""Eviction cost: each step is O(log n); no call re-heaps all leaves (issue 2)."""

from __future__ import annotations

import pytest

import asynccache.tree.queues as queues
from asynccache.tree import RadixTree


@pytest.mark.parametrize("policy", ["lru", "lfu", "priority", "fifo"])
def test_evict_never_reheaps_all_leaves(policy: str, monkeypatch) -> None:
    tree = RadixTree(page_size=1, eviction_policy=policy)
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


def test_queue_stays_compact_under_many_touches() -> None:
    tree = RadixTree(page_size=1, eviction_policy="lru")
    for i in range(100):
        tree.insert([i], [i])
    for _ in range(50):
        for i in range(100):
            tree.match_prefix([i])  # every touch re-keys the leaf (lazy deletion)
    dq = tree._queues[0]
    assert len(dq) == 100
    assert len(dq._heap) <= 2 * len(dq) + 64
    order = [int(tree.evict(1).device_frees[0][0]) for _ in range(100)]
    assert order == list(range(100))  # still exact LRU after all the re-keying
    tree.sanity_check()
