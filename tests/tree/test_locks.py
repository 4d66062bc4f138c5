"""Device and host locks, receipts and evictable/protected sizes (behavior.md 1.6)."""

from __future__ import annotations

import dataclasses

import pytest

from asynccache.errors import LockError
from asynccache.tree import RadixTree

PAGE_SIZES = (1, 4, 16, 64)


def test_s07_lock_protects_prefix(alloc) -> None:
    tree = RadixTree(page_size=1)
    tree.insert([1, 2, 3], [1, 2, 3])
    tree.insert([4, 5, 6], [4, 5, 6])
    m = tree.match_prefix([1, 2, 3])
    receipt = tree.lock(m.last_device_node)
    assert (tree.evictable_size, tree.protected_size) == (3, 3)
    assert receipt.delta == 3
    assert receipt.node_id == m.last_device_node
    assert tree.held_locks == 1
    res = tree.evict(100)
    assert res.num_evicted == 3
    assert [f.tolist() for f in res.device_frees] == [[4, 5, 6]]
    assert (tree.evictable_size, tree.protected_size) == (0, 3)
    m2 = tree.match_prefix([1, 2, 3])
    assert (m2.device_prefix_len, m2.device_indices.tolist()) == (3, [1, 2, 3])
    assert tree.unlock(receipt) == 3
    assert (tree.evictable_size, tree.protected_size, tree.held_locks) == (3, 0, 0)
    assert tree.evict(100).num_evicted == 3
    tree.sanity_check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_path_lock_sizes_and_deltas(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps)
    a = list(range(1, 2 * ps + 1))
    tree.insert(a, alloc.take(2 * ps))
    b = [*a[:ps], *range(500, 500 + 2 * ps)]
    rb = tree.insert(b, alloc.take(3 * ps))
    # Nodes: prefix [0, ps) shared, suffix of a (ps), leaf of b (2ps); 4ps tokens on device.
    assert tree.device_size == 4 * ps
    r1 = tree.lock(rb.last_node)
    assert r1.delta == 3 * ps
    assert (tree.evictable_size, tree.protected_size) == (ps, 3 * ps)
    r2 = tree.lock(rb.last_node)
    assert r2.delta == 0
    ra = tree.lock(tree.match_prefix(a).last_device_node)
    assert ra.delta == ps  # the shared prefix is already protected
    assert (tree.evictable_size, tree.protected_size) == (0, 4 * ps)
    assert tree.lock_ref(rb.last_node) == (2, 0)
    prefix_id = tree.match_prefix(a[:ps]).last_device_node
    assert tree.lock_ref(prefix_id) == (3, 0)
    assert tree.evict(10 * ps).num_evicted == 0
    assert tree.unlock(r2) == 0
    assert tree.unlock(ra) == ps
    assert tree.unlock(r1) == 3 * ps
    assert (tree.evictable_size, tree.protected_size, tree.held_locks) == (4 * ps, 0, 0)
    tree.sanity_check()


def test_lock_root_is_a_no_op_receipt() -> None:
    tree = RadixTree(page_size=1)
    r = tree.lock(tree.root_id)
    assert (r.delta, r.node_id, tree.held_locks) == (0, 0, 1)
    assert tree.unlock(r) == 0
    assert tree.held_locks == 0
    tree.sanity_check()


def test_lock_survives_a_split_above_it(alloc) -> None:
    tree = RadixTree(page_size=2)
    tree.insert([1, 2, 3, 4, 5, 6], alloc.take(6))
    r = tree.lock(1)
    assert r.delta == 6
    tree.insert([1, 2, 9, 9], alloc.take(4))  # splits node 1 at 2 tokens
    prefix = tree.match_prefix([1, 2]).last_device_node
    assert prefix == 2
    assert tree.lock_ref(prefix) == (1, 0)
    assert (tree.evictable_size, tree.protected_size) == (2, 6)
    tree.sanity_check()
    assert tree.evict(100).num_evicted == 2
    assert tree.unlock(r) == 6
    assert (tree.evictable_size, tree.protected_size) == (6, 0)
    tree.sanity_check()


def test_receipt_errors_leave_tree_unchanged(alloc, snapshot) -> None:
    tree = RadixTree(page_size=1, host_enabled=True)
    tree.insert([1, 2, 3], alloc.take(3))
    dev = tree.lock(1)
    host = tree.lock_host(1)
    before = snapshot(tree)
    with pytest.raises(LockError, match=f"receipt {dev.token} is a device lock"):
        tree.unlock_host(dev)
    with pytest.raises(LockError, match=f"receipt {host.token} is a host lock"):
        tree.unlock(host)
    forged = dataclasses.replace(dev, node_id=0)
    with pytest.raises(LockError, match="anchored at node 1, not 0"):
        tree.unlock(forged)
    with pytest.raises(LockError, match="expected a LockReceipt, got 'nope'"):
        tree.unlock("nope")  # type: ignore[arg-type]
    assert snapshot(tree) == before
    tree.sanity_check()
    # Still host-pinned without a host copy: eviction could only delete it, so it stays protected.
    assert tree.unlock(dev) == 0
    after_unlock = snapshot(tree)
    with pytest.raises(LockError, match=f"lock receipt {dev.token} is not held"):
        tree.unlock(dev)  # double unlock
    assert snapshot(tree) == after_unlock
    assert tree.unlock_host(host) == 3
    with pytest.raises(LockError, match=f"lock receipt {host.token} is not held"):
        tree.unlock_host(host)
    assert (tree.held_locks, tree.evictable_size, tree.protected_size) == (0, 3, 0)
    tree.sanity_check()


def test_lock_host_only_node_is_refused(alloc, snapshot) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through")
    (req,) = tree.insert([1, 2], alloc.take(2)).backups
    tree.commit_backup(req.op_id, alloc.take(2))
    tree.evict(2)
    before = snapshot(tree)
    with pytest.raises(LockError, match="node 1 is not on device"):
        tree.lock(1)
    assert snapshot(tree) == before
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 4, 16))
def test_host_lock_protects_from_evict_host(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through")
    k = list(range(2 * ps))
    (req,) = tree.insert(k, alloc.take(2 * ps)).backups
    h = alloc.take(2 * ps)
    tree.commit_backup(req.op_id, h)
    tree.evict(2 * ps)  # demoted: host only
    m = tree.match_prefix(k)
    assert (m.device_prefix_len, m.host_hit_length, m.best_node) == (0, 2 * ps, 1)
    r = tree.lock_host(m.best_node)
    assert (r.delta, r.host) == (2 * ps, True)
    assert tree.lock_ref(1) == (0, 1)
    res = tree.evict_host(100 * ps)
    assert (res.num_evicted, res.host_frees) == (0, [])
    assert tree.host_size == 2 * ps
    tree.sanity_check()
    assert tree.unlock_host(r) == 2 * ps
    res = tree.evict_host(100 * ps)
    assert res.num_evicted == 2 * ps
    assert [f.tolist() for f in res.host_frees] == [h.tolist()]
    assert (tree.host_size, tree.node_count) == (0, 0)
    tree.sanity_check()


def test_host_lock_split_copies_pin_to_prefix(alloc) -> None:
    tree = RadixTree(page_size=2, host_enabled=True, write_policy="write_through")
    (req,) = tree.insert([1, 2, 3, 4], alloc.take(4)).backups
    tree.commit_backup(req.op_id, alloc.take(4))
    tree.evict(4)
    r = tree.lock_host(1)
    tree.match_prefix([1, 2, 7, 7])  # splits the host-only node
    assert tree.lock_ref(2) == (0, 1)
    assert tree.lock_ref(1) == (0, 1)
    assert tree.evict_host(100).num_evicted == 0
    tree.sanity_check()
    assert tree.unlock_host(r) == 4
    assert tree.evict_host(100).num_evicted == 4
    tree.sanity_check()


def test_evictable_size_is_what_evict_can_free_under_host_lock(alloc) -> None:
    tree = RadixTree(page_size=1, host_enabled=True)
    tree.insert([1, 2, 3], alloc.take(3))  # selective: not backed up
    tree.lock_host(1)
    evictable = tree.evictable_size
    assert tree.evict(100).num_evicted == evictable
