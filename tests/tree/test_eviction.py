"""Eviction: policy order, demote vs delete, leaf-then-parent, host eviction
(behavior.md 1.2, 1.5, 1.17)."""

from __future__ import annotations

import pytest

from asynccache.tree import POLICIES, RadixTree

PAGE_SIZES = (1, 4, 16, 64)

# The hand-built tree of _build_policy_tree: four single-node leaves K1..K4.
#   creation order      K1 K2 K3 K4
#   priority            2  0  3  1
#   counted hits        1  1  3  2
#   last access order   K3 < K4 < K2 < K1
EXPECTED_ORDER = {
    "lru": [3, 4, 2, 1],
    "mru": [1, 2, 4, 3],
    "fifo": [1, 2, 3, 4],
    "filo": [4, 3, 2, 1],
    "lfu": [2, 1, 4, 3],
    "priority": [2, 4, 1, 3],
    # keys (last access + half the lifetime of a reused node, last access): K1 (9, 9),
    # K2 (8, 8), K3 (6 + (6 - 3) // 2, 6) = (7, 6), K4 (7 + (7 - 4) // 2, 7) = (8, 7)
    "lru_credit": [3, 4, 2, 1],
    # K3 and K4 were re-inserted (hit): the reused class; K1 and K2 only matched: once. The
    # once class (2 pages) is under the target (half the capacity of 64 pages): reused first.
    "arc": [3, 4, 2, 1],
}


def _page(i: int, ps: int) -> list[int]:
    return [i] * ps


def _build_policy_tree(tree: RadixTree, alloc, ps: int) -> dict[int, int]:
    """Returns {first slot of each key's node: key number}."""
    owner = {}
    for i, prio in ((1, 2), (2, 0), (3, 3), (4, 1)):
        v = alloc.take(ps)
        owner[int(v[0])] = i
        tree.insert(_page(i, ps), v, priority=prio)
    for i in (3, 3, 4):  # re-inserts: hits and recency
        res = tree.insert(_page(i, ps), alloc.take(ps))
        for b in res.backups:  # host-enabled trees back up hot nodes; drop those copies
            tree.abort_backup(b.op_id)
    tree.match_prefix(_page(2, ps))
    tree.match_prefix(_page(1, ps))
    return owner


def _victims(tree: RadixTree, owner: dict[int, int], ps: int) -> list[int]:
    order = []
    for _ in range(4):
        res = tree.evict(1)
        assert res.num_evicted == ps
        assert len(res.device_frees) == 1
        order.append(owner[int(res.device_frees[0][0])])
        tree.sanity_check()
    assert tree.evict(1).num_evicted == 0
    return order


def test_expected_order_covers_every_policy() -> None:
    assert set(EXPECTED_ORDER) == set(POLICIES)


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("policy", sorted(set(EXPECTED_ORDER) - {"lfu"}))
def test_policy_victim_order(policy: str, ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, eviction_policy=policy, device_tokens=64 * ps)
    owner = _build_policy_tree(tree, alloc, ps)
    assert _victims(tree, owner, ps) == EXPECTED_ORDER[policy]
    assert (tree.device_size, tree.node_count) == (0, 0)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lfu_victim_order_with_host(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, eviction_policy="lfu", host_enabled=True)
    owner = _build_policy_tree(tree, alloc, ps)
    assert _victims(tree, owner, ps) == EXPECTED_ORDER["lfu"]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lfu_victim_order_without_host(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, eviction_policy="lfu")
    owner = _build_policy_tree(tree, alloc, ps)
    assert _victims(tree, owner, ps) == EXPECTED_ORDER["lfu"]


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("host", [False, True])
def test_lru_credit_keeps_a_reused_node_longer(ps: int, host: bool, alloc) -> None:
    """lru_credit: a reused node (hit_count >= 2) ranks as if last used half its lifetime
    later. A (created at tick 1, reused at tick 5: key 5 + (5 - 1) // 2 = 7) outlives B (6),
    used after it, but not C (7, used at 7: the tie goes to the older access)."""
    tree = RadixTree(page_size=ps, eviction_policy="lru_credit", host_enabled=host)
    owner = {}
    for i in (1, 2, 3, 4, 1, 5, 6):  # A = 1, X1..X3 = 2..4, B = 5, C = 6
        v = alloc.take(ps)
        res = tree.insert(_page(i, ps), v)
        for b in res.backups:
            tree.abort_backup(b.op_id)
        owner.setdefault(int(v[0]), i)
    order = []
    for _ in range(6):
        res = tree.evict(1)
        order.append(owner[int(res.device_frees[0][0])])
        tree.sanity_check()
    assert order == [2, 3, 4, 5, 1, 6]
    lru = RadixTree(page_size=ps, eviction_policy="lru")
    owner = {}
    for i in (1, 2, 3, 4, 1, 5, 6):
        v = alloc.take(ps)
        lru.insert(_page(i, ps), v)
        owner.setdefault(int(v[0]), i)
    assert [owner[int(lru.evict(1).device_frees[0][0])] for _ in range(6)] == [2, 3, 4, 1, 5, 6]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_leaf_before_parent(ps: int, alloc) -> None:
    """A parent becomes evictable only once its device children are gone."""
    tree = RadixTree(page_size=ps, eviction_policy="lru")
    p = alloc.take(ps)
    tree.insert(_page(1, ps), p)
    c1 = alloc.take(2 * ps)
    tree.insert([*_page(1, ps), *_page(2, ps)], c1)
    c2 = alloc.take(2 * ps)
    tree.insert([*_page(1, ps), *_page(3, ps)], c2)
    tree.match_prefix(_page(1, ps))  # the parent is now the most recently used node
    got = [tree.evict(1).device_frees[0].tolist() for _ in range(3)]
    assert got == [c1[ps:].tolist(), c2[ps:].tolist(), p.tolist()]
    tree.sanity_check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_evict_frees_whole_nodes(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps)
    v = alloc.take(3 * ps)
    tree.insert(list(range(3 * ps)), v)
    res = tree.evict(1)
    assert res.num_evicted == 3 * ps
    assert [f.tolist() for f in res.device_frees] == [v.tolist()]
    assert (res.pending_tokens, res.host_frees, res.backups) == (0, [], [])
    assert tree.evict(0).num_evicted == 0
    tree.sanity_check()


def test_evict_zero_frees_nothing(alloc) -> None:
    tree = RadixTree(page_size=1)
    tree.insert([1, 2], alloc.take(2))
    res = tree.evict(0)
    assert (res.num_evicted, res.device_frees) == (0, [])
    assert tree.device_size == 2


# ---------------------------------------------------------------- demote vs delete
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_backed_up_leaf_is_demoted_unbacked_deleted(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through_selective")
    a = _page(1, 2 * ps)
    va = alloc.take(2 * ps)
    tree.insert(a, va)
    (req,) = tree.insert(a, alloc.take(2 * ps)).backups  # second hit backs it up
    assert (req.node_id, req.device_slots.tolist(), req.write_back) == (1, va.tolist(), False)
    ha = alloc.take(2 * ps)
    assert tree.commit_backup(req.op_id, ha) == [1]
    b = _page(2, 2 * ps)
    vb = alloc.take(2 * ps)
    tree.insert(b, vb)
    tree.match_prefix(b)  # a is the LRU victim
    res = tree.evict(1)
    assert res.num_evicted == 2 * ps
    assert [f.tolist() for f in res.device_frees] == [va.tolist()]
    assert res.host_frees == []
    assert tree.node_count == 2  # a stays, as host only
    m = tree.match_prefix(a)
    assert (m.device_prefix_len, m.host_hit_length, m.best_node, m.last_device_node) == (
        0, 2 * ps, 1, 0,
    )
    res = tree.evict(1)
    assert [f.tolist() for f in res.device_frees] == [vb.tolist()]
    assert res.host_frees == []
    assert tree.node_count == 1  # b was deleted
    assert tree.match_prefix(b).best_node == 0
    assert (tree.device_size, tree.host_size) == (0, 2 * ps)
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 4, 16))
def test_unbacked_leaf_is_deleted_with_host_only_subtree(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through_selective")
    a = _page(1, ps)
    ab = [*a, *_page(2, ps)]
    va = alloc.take(ps)
    tree.insert(a, va)
    vb = alloc.take(2 * ps)
    tree.insert(ab, vb, inserted_len=ps)  # a gets no hit
    res = tree.insert(ab, alloc.take(2 * ps), inserted_len=ps)  # b's second hit
    # The chain of un-backed ancestors is backed up too, root first.
    assert [(r.node_id, r.device_slots.tolist()) for r in res.backups] == [
        (1, va.tolist()),
        (2, vb[ps:].tolist()),
    ]
    tree.abort_backup(res.backups[0].op_id)  # a stays un-backed
    hb = alloc.take(ps)
    assert tree.commit_backup(res.backups[1].op_id, hb) == [2]
    r1 = tree.evict(1)  # b is demoted
    assert [f.tolist() for f in r1.device_frees] == [vb[ps:].tolist()]
    assert (tree.node_count, tree.host_size) == (2, ps)
    tree.sanity_check()
    r2 = tree.evict(1)  # a is a device leaf now (its child is host only): deleted, b with it
    assert r2.num_evicted == ps
    assert [f.tolist() for f in r2.device_frees] == [va.tolist()]
    assert [f.tolist() for f in r2.host_frees] == [hb.tolist()]
    assert r2.dropped_host_tokens == ps
    assert (tree.node_count, tree.device_size, tree.host_size) == (0, 0, 0)
    tree.sanity_check()


def test_demoted_children_make_parent_a_device_leaf(alloc) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through")
    reqs = tree.insert([1, 2], alloc.take(2)).backups
    reqs += tree.insert([1, 2, 3], alloc.take(3)).backups
    assert [r.node_id for r in reqs] == [1, 2]
    for r in reqs:
        tree.commit_backup(r.op_id, alloc.take(r.num_tokens))
    assert tree.evict(1).num_evicted == 1  # the leaf [3]
    tree.sanity_check()
    res = tree.evict(1)  # [1, 2]: a D-leaf although it still has a (host-only) child
    assert res.num_evicted == 2
    assert tree.node_count == 2
    m = tree.match_prefix([1, 2, 3])
    assert (m.device_prefix_len, m.host_hit_length, m.best_node) == (0, 3, 2)
    tree.sanity_check()


# ---------------------------------------------------------------- host eviction
def _two_backed_up_nodes(tree: RadixTree, alloc, ps: int):
    va, vb = alloc.take(ps), alloc.take(ps)
    ha, hb = alloc.take(ps), alloc.take(ps)
    for key, v, h in ((_page(1, ps), va, ha), (_page(2, ps), vb, hb)):
        (req,) = tree.insert(key, v).backups
        tree.commit_backup(req.op_id, h)
    return va, vb, ha, hb


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_evict_host_takes_host_only_leaves_first(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through")
    va, vb, ha, hb = _two_backed_up_nodes(tree, alloc, ps)
    tree.match_prefix(_page(2, ps))  # a is older
    assert [f.tolist() for f in tree.evict(1).device_frees] == [va.tolist()]
    # a is host only (H-leaf), b is a host duplicate of a device node.
    res = tree.evict_host(1)
    assert res.num_evicted == ps
    assert [f.tolist() for f in res.host_frees] == [ha.tolist()]
    assert tree.node_count == 1
    tree.sanity_check()
    assert tree.evict_host(1).num_evicted == 0  # write-through keeps duplicates by default
    res = tree.evict_host(1, reclaim_duplicates=True)  # asked: reclaimed; b stays on device
    assert [f.tolist() for f in res.host_frees] == [hb.tolist()]
    m = tree.match_prefix(_page(2, ps))
    assert (m.device_prefix_len, m.host_hit_length) == (ps, 0)
    assert m.device_indices.tolist() == vb.tolist()
    assert (tree.host_size, tree.device_size) == (0, ps)
    assert tree.evict_host(1, reclaim_duplicates=True).num_evicted == 0
    tree.sanity_check()


@pytest.mark.parametrize("policy", ("write_through", "write_through_selective", "write_back"))
def test_evict_host_can_skip_duplicates(policy: str, alloc) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy=policy)
    if policy == "write_back":
        tree.insert([1], alloc.take(1))
        tree.insert([2], alloc.take(1))
        for _ in range(2):  # back both up at eviction, then load them back
            (req,) = tree.evict(1).backups
            tree.commit_backup(req.op_id, alloc.take(1))
            tree.evict(1)
        for key in ([1], [2]):
            m = tree.match_prefix(key)
            tree.commit_load_back(tree.start_load_back(m.best_node, alloc.take(1)).op_id)
    else:
        if policy == "write_through_selective":  # the second insert backs up
            tree.insert([1], alloc.take(1))
            tree.insert([2], alloc.take(1))
        _two_backed_up_nodes(tree, alloc, 1)
    assert tree.host_size == 2 and tree.device_size == 2
    res = tree.evict_host(10, reclaim_duplicates=False)
    assert (res.num_evicted, res.host_frees) == (0, [])
    assert tree.evict_host(10).num_evicted == (2 if policy == "write_back" else 0)
    assert tree.evict_host(10, reclaim_duplicates=True).num_evicted == (
        0 if policy == "write_back" else 2)
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 4, 16))
def test_write_back_reclaims_duplicates_first(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_back")
    va, vb = alloc.take(ps), alloc.take(ps)
    tree.insert(_page(1, ps), va)
    tree.insert(_page(2, ps), vb)
    ha, hb = alloc.take(ps), alloc.take(ps)
    for v, h in ((va, ha), (vb, hb)):
        res = tree.evict(1)
        (req,) = res.backups
        assert req.device_slots.tolist() == v.tolist()
        tree.commit_backup(req.op_id, h)
        assert [f.tolist() for f in tree.evict(1).device_frees] == [v.tolist()]
    # Both host only. Load a back: it becomes a host duplicate.
    m = tree.match_prefix(_page(1, ps))
    da = alloc.take(ps)
    ticket = tree.start_load_back(m.best_node, da)
    tree.commit_load_back(ticket.op_id)
    res = tree.evict_host(1)
    assert [f.tolist() for f in res.host_frees] == [ha.tolist()]  # the duplicate first
    assert tree.match_prefix(_page(1, ps)).device_prefix_len == ps
    res = tree.evict_host(1)
    assert [f.tolist() for f in res.host_frees] == [hb.tolist()]
    assert (tree.node_count, tree.host_size, tree.device_size) == (1, 0, ps)
    tree.sanity_check()


def test_evict_host_deletes_parent_chain(alloc) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through")
    reqs = tree.insert([1, 2], alloc.take(2)).backups
    reqs += tree.insert([1, 2, 3], alloc.take(3)).backups
    h = [alloc.take(r.num_tokens) for r in reqs]
    for r, hs in zip(reqs, h, strict=True):
        tree.commit_backup(r.op_id, hs)
    tree.evict(100)
    res = tree.evict_host(3)  # leaf first, then its parent becomes a host leaf
    assert [f.tolist() for f in res.host_frees] == [h[1].tolist(), h[0].tolist()]
    assert (tree.node_count, tree.host_size) == (0, 0)
    tree.sanity_check()
