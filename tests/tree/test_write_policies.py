"""Write policies, backups in flight, splits of pending nodes and load-back
(behavior.md 1.4, 1.5, 1.8, 1.17)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from asynccache.errors import InvalidInputError, LockError
from asynccache.tree import (
    DEFAULT_NAMESPACE,
    BlockRemoved,
    BlockStored,
    Medium,
    RadixTree,
    event_hash,
)

PAGE_SIZES = (1, 4, 16, 64)


def _key(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---------------------------------------------------------------- write_through
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_write_through_backs_up_at_first_insert(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through")
    k = _key(1, 2 * ps)
    v = alloc.take(2 * ps)
    res = tree.insert(k, v)
    (req,) = res.backups
    assert (req.node_id, req.device_slots.tolist(), req.write_back, req.num_tokens) == (
        1, v.tolist(), False, 2 * ps,
    )
    # Locked while the copy is in flight: cannot be evicted half-written.
    assert tree.pending_ops == 1
    assert tree.lock_ref(1) == (1, 0)
    assert (tree.evictable_size, tree.protected_size, tree.held_locks) == (0, 2 * ps, 0)
    assert tree.evict(100 * ps).num_evicted == 0
    assert tree.evict_host(100 * ps).num_evicted == 0
    tree.sanity_check()
    h = alloc.take(2 * ps)
    assert tree.commit_backup(req.op_id, h) == [1]
    assert (tree.pending_ops, tree.lock_ref(1), tree.host_size) == (0, (0, 0), 2 * ps)
    assert (tree.evictable_size, tree.protected_size) == (2 * ps, 0)
    assert tree.insert(k, alloc.take(2 * ps)).backups == []  # already backed up
    res = tree.evict(1)
    assert (res.num_evicted, res.host_frees) == (2 * ps, [])
    m = tree.match_prefix(k)
    assert (m.device_prefix_len, m.host_hit_length) == (0, 2 * ps)
    assert sorted(tree.host_slots().tolist()) == h.tolist()
    tree.sanity_check()


def test_write_through_chain_is_root_first(alloc) -> None:
    tree = RadixTree(page_size=2, host_enabled=True, write_policy="write_through")
    v0 = alloc.take(2)
    (first,) = tree.insert([1, 2], v0).backups
    tree.abort_backup(first.op_id)  # node 1 stays un-backed
    assert (tree.pending_ops, tree.protected_size, tree.evictable_size) == (0, 0, 2)
    v = alloc.take(6)
    res = tree.insert([1, 2, 3, 4, 5, 6], v, inserted_len=2)  # node 1 gets no hit
    assert [(r.node_id, r.device_slots.tolist()) for r in res.backups] == [
        (1, v0.tolist()),
        (2, v[2:].tolist()),
    ]
    assert [f.tolist() for f in res.device_frees] == [v[:2].tolist()]
    assert tree.lock_ref(1) == (2, 0)  # pinned by both copies (path locks)
    assert tree.lock_ref(2) == (1, 0)
    tree.sanity_check()
    tree.commit_backup(res.backups[1].op_id, alloc.take(4))
    tree.commit_backup(res.backups[0].op_id, alloc.take(2))
    assert (tree.host_size, tree.protected_size, tree.pending_ops) == (6, 0, 0)
    tree.sanity_check()


def test_write_through_events(alloc) -> None:
    """CPU BlockStored on the ack, GPU BlockRemoved on demotion, host hit afterwards."""
    tree = RadixTree(page_size=2, host_enabled=True, write_policy="write_through",
                     enable_kv_events=True)
    (req,) = tree.insert([1, 2, 3, 4, 5, 6], alloc.take(6)).backups
    (gpu,) = tree.take_events()
    assert (gpu.medium, gpu.token_ids) == (Medium.GPU, [1, 2, 3, 4, 5, 6])
    tree.commit_backup(req.op_id, alloc.take(6))
    assert tree.take_events() == [
        BlockStored(
            block_hashes=gpu.block_hashes,
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4, 5, 6],
            block_size=2,
            medium=Medium.CPU_PINNED,
        )
    ]
    tree.evict(100)
    assert tree.take_events() == [BlockRemoved(block_hashes=gpu.block_hashes, medium=Medium.GPU)]
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).host_hit_length == 6


# ---------------------------------------------------------------- write_through_selective
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_selective_backs_up_on_second_insert(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through_selective")
    assert tree.config.write_through_threshold == 2
    k = _key(1, 2 * ps)
    v = alloc.take(2 * ps)
    assert tree.insert(k, v).backups == []
    assert tree.pending_ops == 0
    (req,) = tree.insert(k, alloc.take(2 * ps)).backups
    assert (req.node_id, req.device_slots.tolist()) == (1, v.tolist())
    tree.commit_backup(req.op_id, alloc.take(2 * ps))
    # The extension is hit once only: never backed up.
    res = tree.insert([*k, *_key(500, ps)], alloc.take(3 * ps))
    assert res.backups == []
    res = tree.evict(100 * ps)
    assert res.num_evicted == 3 * ps
    m = tree.match_prefix([*k, *_key(500, ps)])
    assert (m.device_prefix_len, m.host_hit_length, m.best_node) == (0, 2 * ps, 1)
    assert tree.node_count == 1
    tree.sanity_check()


def test_no_backups_without_host(alloc) -> None:
    tree = RadixTree(page_size=1, write_policy="write_through")
    for _ in range(3):
        assert tree.insert([1, 2], alloc.take(2)).backups == []
    assert tree.evict(2).backups == []
    assert (tree.pending_ops, tree.host_size) == (0, 0)


# ---------------------------------------------------------------- write_back
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_write_back_backs_up_at_eviction(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_back",
                     enable_kv_events=True)
    k = _key(1, 2 * ps)
    v = alloc.take(2 * ps)
    for _ in range(3):
        assert tree.insert(k, v).backups == []
    tree.take_events()
    res = tree.evict(2 * ps)
    assert (res.num_evicted, res.pending_tokens, res.device_frees) == (0, 2 * ps, [])
    (req,) = res.backups
    assert (req.node_id, req.device_slots.tolist(), req.write_back) == (1, v.tolist(), True)
    assert tree.lock_ref(1) == (1, 0)
    assert (tree.evictable_size, tree.protected_size, tree.pending_ops) == (0, 2 * ps, 1)
    again = tree.evict(2 * ps)  # the pending node is not evicted or requested twice
    assert (again.num_evicted, again.pending_tokens, again.backups) == (0, 0, [])
    tree.sanity_check()
    h = alloc.take(2 * ps)
    assert tree.commit_backup(req.op_id, h) == [1]
    res = tree.evict(2 * ps)
    assert (res.num_evicted, res.pending_tokens, res.backups) == (2 * ps, 0, [])
    assert [f.tolist() for f in res.device_frees] == [v.tolist()]
    events = tree.take_events()
    assert [(type(e).__name__, e.medium) for e in events] == [
        ("BlockStored", Medium.CPU_PINNED),
        ("BlockRemoved", Medium.GPU),
    ]
    assert events[0].block_hashes == events[1].block_hashes
    assert len(events[0].block_hashes) == 2
    m = tree.match_prefix(k)
    assert (m.device_prefix_len, m.host_hit_length) == (0, 2 * ps)
    tree.sanity_check()


def test_write_back_abort_makes_node_evictable_again(alloc) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_back")
    tree.insert([1, 2], alloc.take(2))
    (req,) = tree.evict(1).backups
    tree.abort_backup(req.op_id)
    assert (tree.evictable_size, tree.protected_size, tree.pending_ops) == (2, 0, 0)
    tree.sanity_check()
    (req2,) = tree.evict(1).backups
    assert req2.op_id != req.op_id
    assert req2.node_id == 1


def test_write_back_takes_the_parent_once_its_children_wait(alloc) -> None:
    # The reference demotes a victim before the next pop, so its parent then competes with the
    # other leaves; here the parent becomes a candidate once all its device children wait for
    # their copies, and its backup is marked ``after_children``.
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_back")
    tree.insert([1], alloc.take(1))
    tree.insert([1, 2], alloc.take(2))
    res = tree.evict(10)
    assert [(r.node_id, r.after_children) for r in res.backups] == [(2, False), (1, True)]
    assert res.pending_tokens == 2 and res.num_evicted == 0
    tree.sanity_check()
    for r in res.backups:
        tree.commit_backup(r.op_id, alloc.take(r.num_tokens))
    res = tree.evict(10)
    assert (res.num_evicted, res.backups) == (2, [])
    assert (tree.device_size, tree.host_size) == (0, 2)
    tree.sanity_check()


def test_write_back_leaves_a_parent_another_request_pins(alloc) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_back")
    tree.insert([1], alloc.take(1))
    tree.insert([1, 2], alloc.take(2))
    tree.insert([1, 3], alloc.take(2))
    receipt = tree.lock(tree.match_prefix([1, 3]).last_device_node)
    res = tree.evict(10)
    assert [r.node_id for r in res.backups] == [2]  # 1 is pinned through [1, 3]
    tree.abort_backup(res.backups[0].op_id)
    tree.unlock(receipt)
    tree.sanity_check()


def test_write_back_counts_a_backed_up_parent_after_its_children(alloc) -> None:
    # A parent that already has a host copy waits for its children's copies too: it is
    # counted, not demoted before them, and demoted by the next call.
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_back")
    tree.insert([1], alloc.take(1))
    (req,) = tree.evict(1).backups
    tree.commit_backup(req.op_id, alloc.take(1))
    assert tree.evict(1).num_evicted == 1  # [1] is on host only
    m = tree.match_prefix([1])
    ticket = tree.start_load_back(m.best_node, alloc.take(1))
    tree.commit_load_back(ticket.op_id)  # on device again, its host copy kept
    tree.insert([1, 2], np.concatenate([tree.match_prefix([1]).device_indices, alloc.take(1)]),
                prev_prefix_len=1)
    res = tree.evict(10)
    assert [r.node_id for r in res.backups] == [tree.match_prefix([1, 2]).last_device_node]
    assert (res.pending_tokens, res.num_evicted) == (2, 0)  # [2] copies, [1] waits for it
    tree.sanity_check()
    tree.commit_backup(res.backups[0].op_id, alloc.take(1))
    res = tree.evict(10)
    assert (res.num_evicted, res.backups) == (2, [])
    assert (tree.device_size, tree.host_size) == (0, 2)
    tree.sanity_check()


# ---------------------------------------------------------------- split while pending
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_split_while_backup_in_flight(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through",
                     enable_kv_events=True)
    k = _key(1, 4 * ps)
    v = alloc.take(4 * ps)
    (req,) = tree.insert(k, v).backups
    branch = [*k[: 2 * ps], *_key(9000, ps)]
    res = tree.insert(branch, alloc.take(3 * ps))  # splits node 1 at 2 pages
    prefix_id = tree.match_prefix(k[: 2 * ps]).best_node
    assert prefix_id == 2
    # Only the new leaf is asked for: the prefix fragment rides on the pending copy.
    assert [r.node_id for r in res.backups] == [res.last_node]
    assert tree.lock_ref(2) == (2, 0) and tree.lock_ref(1) == (1, 0)
    tree.sanity_check()
    tree.take_events()
    h = alloc.take(4 * ps)
    assert tree.commit_backup(req.op_id, h) == [2, 1]
    frags = {n.id: n for n in tree.iter_nodes()}
    assert frags[2].host_value.tolist() == h[: 2 * ps].tolist()
    assert frags[1].host_value.tolist() == h[2 * ps :].tolist()
    (cpu,) = tree.take_events()  # one coalesced CPU store covering both fragments
    assert cpu.medium is Medium.CPU_PINNED
    assert cpu.parent_block_hash is None
    assert cpu.token_ids == k
    assert len(cpu.block_hashes) == 4
    tree.commit_backup(res.backups[0].op_id, alloc.take(ps))
    assert (tree.host_size, tree.protected_size, tree.pending_ops) == (5 * ps, 0, 0)
    tree.evict(100 * ps)
    assert (tree.device_size, tree.host_size, tree.node_count) == (0, 5 * ps, 3)
    tree.sanity_check()


def test_split_while_backup_in_flight_then_abort(alloc) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through")
    (req,) = tree.insert([1, 2, 3], alloc.take(3)).backups
    tree.match_prefix([1, 9])  # split at 1
    tree.abort_backup(req.op_id)
    assert (tree.pending_ops, tree.protected_size, tree.evictable_size, tree.host_size) == (
        0, 0, 3, 0,
    )
    tree.sanity_check()
    assert tree.evict(100).num_evicted == 3


def test_pending_loads_excludes_backups(alloc) -> None:
    """A node whose D->H copy is in flight is readable: it is no pending load."""
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through")
    (req,) = tree.insert([1, 2, 3], alloc.take(3)).backups
    m = tree.match_prefix([1, 2, 3])
    assert (m.device_prefix_len, m.pending_loads, tree.pending_ops) == (3, (), 1)
    tree.commit_backup(req.op_id, alloc.take(3))


# ---------------------------------------------------------------- load-back
def _host_only(tree: RadixTree, alloc, key: list[int]):
    """Insert ``key``, back it up, demote it; returns (device slots, host slots)."""
    v = alloc.take(len(key))
    reqs = tree.insert(key, v).backups
    hs = []
    for r in reqs:
        h = alloc.take(r.num_tokens)
        hs.append(h)
        tree.commit_backup(r.op_id, h)
    tree.evict(10**6)
    return v, hs


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_load_back_commit(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through",
                     enable_kv_events=True)
    k = _key(1, 3 * ps)
    _, (h,) = _host_only(tree, alloc, k)
    events = tree.take_events()
    gpu_hashes = events[0].block_hashes
    m = tree.match_prefix(k)
    assert (m.device_prefix_len, m.host_hit_length, m.best_node, m.last_device_node) == (
        0, 3 * ps, 1, 0,
    )
    assert tree.host_chain(m.best_node) == [1]
    d = alloc.take(3 * ps)
    ticket = tree.start_load_back(m.best_node, d)
    assert ticket.node_ids == (1,)
    assert ticket.host_slots.tolist() == h.tolist()
    assert ticket.device_slots.tolist() == d.tolist()
    assert ticket.num_tokens == 3 * ps
    # In flight: still a host hit (not readable yet), naming the load to wait for.
    m = tree.match_prefix(k)
    assert (m.device_prefix_len, m.host_hit_length, m.pending_loads) == (0, 3 * ps, (ticket.op_id,))
    assert (m.best_node, m.last_device_node, m.device_indices.tolist()) == (1, 0, [])
    assert (tree.protected_size, tree.evictable_size, tree.pending_ops) == (3 * ps, 0, 1)
    assert tree.evict(10**6).num_evicted == 0
    assert tree.evict_host(10**6).num_evicted == 0
    assert tree.take_events() == []
    tree.sanity_check()
    tree.commit_load_back(ticket.op_id)
    assert tree.take_events() == [
        BlockStored(
            block_hashes=gpu_hashes, parent_block_hash=None, token_ids=k, block_size=ps,
            medium=Medium.GPU,
        )
    ]
    m = tree.match_prefix(k)
    assert (m.device_prefix_len, m.pending_loads) == (3 * ps, ())
    assert (tree.protected_size, tree.evictable_size, tree.host_size) == (0, 3 * ps, 3 * ps)
    # Now a host duplicate: write-through keeps it unless asked; then the node stays on device.
    assert tree.evict_host(1).num_evicted == 0
    res = tree.evict_host(1, reclaim_duplicates=True)
    assert [f.tolist() for f in res.host_frees] == [h.tolist()]
    assert tree.match_prefix(k).device_prefix_len == 3 * ps
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 4, 16))
def test_load_back_multi_node_chain(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through")
    a = _key(1, ps)
    ab = [*a, *_key(100, 2 * ps)]
    reqs = tree.insert(a, alloc.take(ps)).backups + tree.insert(ab, alloc.take(3 * ps)).backups
    hs = [alloc.take(r.num_tokens) for r in reqs]
    for r, h in zip(reqs, hs, strict=True):
        tree.commit_backup(r.op_id, h)
    # Keep a on device by evicting only the leaf b.
    assert tree.evict(1).num_evicted == 2 * ps
    m = tree.match_prefix(ab)
    assert (m.device_prefix_len, m.host_hit_length, m.last_device_node, m.best_node) == (
        ps, 2 * ps, 1, 2,
    )
    tree.evict(10**6)
    m = tree.match_prefix(ab)
    assert (m.device_prefix_len, m.host_hit_length, m.best_node) == (0, 3 * ps, 2)
    assert tree.host_chain(2) == [1, 2]
    assert tree.host_chain(1) == [1]
    d = alloc.take(3 * ps)
    ticket = tree.start_load_back(2, d)
    assert ticket.node_ids == (1, 2)
    assert ticket.host_slots.tolist() == [*hs[0].tolist(), *hs[1].tolist()]
    assert tree.host_chain(2) == []
    tree.commit_load_back(ticket.op_id)
    m = tree.match_prefix(ab)
    assert (m.device_prefix_len, m.device_indices.tolist()) == (3 * ps, d.tolist())
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 4))
def test_load_back_abort(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through",
                     enable_kv_events=True)
    k = _key(1, 2 * ps)
    _host_only(tree, alloc, k)
    tree.take_events()
    d = alloc.take(2 * ps)
    ticket = tree.start_load_back(1, d)
    frees = tree.abort_load_back(ticket.op_id)
    assert [f.tolist() for f in frees] == [d.tolist()]
    assert tree.take_events() == []
    m = tree.match_prefix(k)
    assert (m.device_prefix_len, m.host_hit_length, m.pending_loads) == (0, 2 * ps, ())
    assert (tree.device_size, tree.host_size, tree.pending_ops) == (0, 2 * ps, 0)
    tree.sanity_check()
    with pytest.raises(InvalidInputError, match=f"no load in flight with id {ticket.op_id}"):
        tree.commit_load_back(ticket.op_id)


def test_split_while_load_in_flight(alloc) -> None:
    tree = RadixTree(page_size=2, host_enabled=True, write_policy="write_through")
    _host_only(tree, alloc, [1, 2, 3, 4, 5, 6])
    d = alloc.take(6)
    ticket = tree.start_load_back(1, d)
    m = tree.match_prefix([1, 2, 3, 4, 9, 9])  # splits the loading node
    assert (m.best_node, m.device_prefix_len, m.host_hit_length, m.pending_loads) == (
        2, 0, 4, (ticket.op_id,),
    )
    tree.sanity_check()
    tree.commit_load_back(ticket.op_id)
    assert (tree.pending_ops, tree.protected_size, tree.evictable_size) == (0, 0, 6)
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.device_prefix_len, m.pending_loads, m.device_indices.tolist()) == (6, (), d.tolist())
    tree.sanity_check()


def test_abort_after_split_of_loading_node(alloc) -> None:
    tree = RadixTree(page_size=2, host_enabled=True, write_policy="write_through")
    _host_only(tree, alloc, [1, 2, 3, 4, 5, 6])
    d = alloc.take(6)
    ticket = tree.start_load_back(1, d)
    tree.match_prefix([1, 2, 3, 4, 9, 9])  # splits the loading node into [1..4] + [5, 6]
    frees = tree.abort_load_back(ticket.op_id)
    assert [f.tolist() for f in frees] == [d[4:].tolist(), d[:4].tolist()]  # deepest first
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.device_prefix_len, m.host_hit_length, m.best_node, m.pending_loads) == (0, 6, 1, ())
    assert (tree.device_size, tree.host_size, tree.protected_size) == (0, 6, 0)
    tree.sanity_check()


def test_start_load_back_errors_leave_tree_unchanged(alloc, snapshot) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through")
    _host_only(tree, alloc, [1, 2, 3])
    tree.insert([7], alloc.take(1))
    for r in tree.insert([7], alloc.take(1)).backups:
        tree.abort_backup(r.op_id)
    before = snapshot(tree)
    with pytest.raises(InvalidInputError, match="needs 3 device slots, got 2"):
        tree.start_load_back(1, alloc.take(2))
    with pytest.raises(InvalidInputError, match="node 0 has nothing to load"):
        tree.start_load_back(0, [])
    dev_node = tree.match_prefix([7]).last_device_node
    with pytest.raises(InvalidInputError, match=f"node {dev_node} has nothing to load"):
        tree.start_load_back(dev_node, [])
    assert snapshot(tree) == before
    tree.sanity_check()


def test_commit_backup_wrong_size_leaves_tree_unchanged(alloc, snapshot) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through")
    (req,) = tree.insert([1, 2, 3], alloc.take(3)).backups
    before = snapshot(tree)
    with pytest.raises(InvalidInputError, match=f"backup {req.op_id} needs 3 host slots, got 2"):
        tree.commit_backup(req.op_id, alloc.take(2))
    with pytest.raises(InvalidInputError, match="host_slots must hold integer slot indices"):
        tree.commit_backup(req.op_id, [1.5, 2.5, 3.5])
    assert snapshot(tree) == before
    tree.sanity_check()
    assert tree.commit_backup(req.op_id, alloc.take(3)) == [1]
    with pytest.raises(InvalidInputError, match=f"no backup in flight with id {req.op_id}"):
        tree.commit_backup(req.op_id, alloc.take(3))


def test_reset_refused_with_copy_in_flight(alloc, snapshot) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through")
    (req,) = tree.insert([1, 2, 3], alloc.take(3)).backups
    before = snapshot(tree)
    with pytest.raises(InvalidInputError, match="cannot reset with 1 copies in flight"):
        tree.reset()
    assert snapshot(tree) == before
    tree.commit_backup(req.op_id, [7, 8, 9])
    device, host = tree.reset()
    assert ([d.tolist() for d in device], [h.tolist() for h in host]) == (
        [[1000, 1001, 1002]], [[7, 8, 9]],
    )
    assert (tree.node_count, tree.device_size, tree.host_size) == (0, 0, 0)
    tree.sanity_check()


def _loading_tree(alloc):
    """Page 1, write-through: node 1 = [5] on host only, then a load-back of it in flight."""
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through",
                     enable_kv_events=True)
    (r,) = tree.insert([5], [10]).backups
    tree.commit_backup(r.op_id, [20])
    tree.evict(1)
    ticket = tree.start_load_back(1, [30])
    return tree, ticket


def test_loading_node_cannot_be_locked(alloc, snapshot) -> None:
    """A reader may not pin KV that is still being copied in (it could outlive a failed copy)."""
    tree, ticket = _loading_tree(alloc)
    before = snapshot(tree)
    with pytest.raises(LockError, match=f"node 1 is still being loaded; wait for load {ticket.op_id}"):
        tree.lock(1)
    assert snapshot(tree) == before
    tree.commit_load_back(ticket.op_id)
    assert tree.lock(1).delta == 1


def test_insert_stops_before_a_loading_node(alloc) -> None:
    tree, ticket = _loading_tree(alloc)
    mine = alloc.take(3)
    res = tree.insert([5, 6, 7], mine)
    # Nothing is adopted below the loading node and nothing is freed: the caller keeps its slots.
    assert (res.prefix_len, res.cached_len, res.last_node, res.device_frees, res.backups) == (
        0, 0, 0, [], [],
    )
    assert (tree.node_count, tree.device_size) == (1, 1)
    assert sorted(tree.device_slots().tolist()) == [30]
    tree.sanity_check()
    tree.commit_load_back(ticket.op_id)
    res = tree.insert([5, 6, 7], mine)  # after the commit it extends the loaded node
    assert (res.prefix_len, res.cached_len) == (1, 3)
    assert [f.tolist() for f in res.device_frees] == [mine[:1].tolist()]


def test_abort_load_back_returns_every_slot(alloc) -> None:
    tree, ticket = _loading_tree(alloc)
    events = tree.take_events()
    tree.match_prefix([5, 6])
    tree.insert([5, 6], alloc.take(2))
    assert [f.tolist() for f in tree.abort_load_back(ticket.op_id)] == [[30]]
    m = tree.match_prefix([5])
    assert (m.device_prefix_len, m.host_hit_length, m.pending_loads) == (0, 1, ())
    assert (tree.device_size, tree.host_size, tree.pending_ops, tree.protected_size) == (0, 1, 0, 0)
    tree.sanity_check()
    # Router view stays consistent: the aborted block was never announced on GPU.
    events += tree.take_events()
    assert events == [
        BlockStored([event_hash(_d([5]), DEFAULT_NAMESPACE)], None, [5], 1, Medium.GPU),
        BlockStored([event_hash(_d([5]), DEFAULT_NAMESPACE)], None, [5], 1, Medium.CPU_PINNED),
        BlockRemoved([event_hash(_d([5]), DEFAULT_NAMESPACE)], Medium.GPU),
    ]


def _d(tokens: list[int]) -> bytes:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}I", *tokens)).digest()


def test_load_back_below_a_loading_node_is_refused(alloc, snapshot) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through")
    reqs = tree.insert([1], [10]).backups + tree.insert([1, 2], [10, 11]).backups
    for r in reqs:
        tree.commit_backup(r.op_id, alloc.take(r.num_tokens))
    tree.evict(10)  # [1] -> [2], both host only
    outer = tree.start_load_back(1, [50])
    m = tree.match_prefix([1, 2])
    assert (m.device_prefix_len, m.host_hit_length, m.pending_loads) == (0, 2, (outer.op_id,))
    before = snapshot(tree)
    with pytest.raises(InvalidInputError, match="node 1 is already being loaded"):
        tree.start_load_back(2, [51])
    assert snapshot(tree) == before
    assert [f.tolist() for f in tree.abort_load_back(outer.op_id)] == [[50]]
    tree.sanity_check()


# ---------------------------------------------------------------- behavior.md 1.17 scenarios
def _eh(tokens: list[int]) -> list[int]:
    """Event hashes of each page-2 page of ``tokens`` (default namespace)."""
    out, prev = [], b""
    for off in range(0, len(tokens), 2):
        prev = hashlib.sha256(prev + struct.pack("<2I", *tokens[off : off + 2])).digest()
        out.append(event_hash(prev, DEFAULT_NAMESPACE))
    return out


def test_scenario_write_through_page2(alloc) -> None:
    tree = RadixTree(page_size=2, host_enabled=True, write_policy="write_through",
                     enable_kv_events=True)
    reqs = tree.insert([1, 2, 3, 4], alloc.take(4)).backups
    assert [r.node_id for r in reqs] == [1]  # launched at once
    reqs += tree.insert([1, 2, 3, 4, 5, 6], alloc.take(6)).backups
    tree.take_events()
    for r in reqs:
        tree.commit_backup(r.op_id, alloc.take(r.num_tokens))
    h = _eh([1, 2, 3, 4, 5, 6])
    assert tree.take_events() == [
        BlockStored(h, None, [1, 2, 3, 4, 5, 6], 2, Medium.CPU_PINNED)
    ]
    tree.evict(100)
    (removed,) = tree.take_events()
    assert (removed.medium, sorted(removed.block_hashes)) == (Medium.GPU, sorted(h))
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).host_hit_length == 6


def test_scenario_selective_page2(alloc) -> None:
    tree = RadixTree(page_size=2, host_enabled=True, write_policy="write_through_selective")
    assert tree.insert([1, 2, 3, 4], alloc.take(4)).backups == []
    (r,) = tree.insert([1, 2, 3, 4], alloc.take(4)).backups
    tree.commit_backup(r.op_id, alloc.take(4))
    assert tree.insert([1, 2, 3, 4, 5, 6], alloc.take(6)).backups == []
    tree.evict(100)
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).host_hit_length == 4


def test_scenario_write_back_page2(alloc) -> None:
    tree = RadixTree(page_size=2, host_enabled=True, write_policy="write_back",
                     enable_kv_events=True)
    assert tree.insert([1, 2, 3, 4, 5, 6], alloc.take(6)).backups == []
    tree.take_events()
    (r,) = tree.evict(6).backups
    tree.commit_backup(r.op_id, alloc.take(6))
    assert tree.evict(6).num_evicted == 6
    h = _eh([1, 2, 3, 4, 5, 6])
    assert tree.take_events() == [
        BlockStored(h, None, [1, 2, 3, 4, 5, 6], 2, Medium.CPU_PINNED),
        BlockRemoved(h, Medium.GPU),
    ]
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.host_hit_length == 6
    ticket = tree.start_load_back(m.best_node, alloc.take(6))
    tree.commit_load_back(ticket.op_id)
    res = tree.evict_host(6)
    assert res.num_evicted == 6  # the 6 duplicate tokens are reclaimed
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).device_prefix_len == 6
    assert tree.host_size == 0
    tree.sanity_check()
