"""match_prefix / insert: page alignment, splits, match results, prev_prefix_len, priority,
hit counting and un-evicting host-only nodes (behavior.md 1.2-1.4)."""

from __future__ import annotations

import numpy as np
import pytest

from asynccache.tree import RadixKey, RadixTree

PAGE_SIZES = (1, 4, 16, 64)


def _toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---------------------------------------------------------------- page alignment
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_unaligned_tail_is_not_cached(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps)
    tail = ps - 1 if ps > 1 else 0
    key = _toks(1, 2 * ps + tail)
    value = alloc.take(len(key))
    res = tree.insert(key, value)
    assert (res.prefix_len, res.cached_len, res.device_frees, res.backups) == (0, 2 * ps, [], [])
    assert res.last_node == 1
    assert tree.device_size == tree.evictable_size == 2 * ps
    assert tree.protected_size == 0
    assert tree.node_count == 1
    assert sorted(tree.device_slots().tolist()) == value[: 2 * ps].tolist()
    m = tree.match_prefix(key)
    assert m.device_prefix_len == 2 * ps
    assert m.device_indices.tolist() == value[: 2 * ps].tolist()
    assert (m.last_device_node, m.best_node, m.host_hit_length, m.pending_loads) == (1, 1, 0, ())
    assert m.total_hit_length == 2 * ps
    tree.sanity_check()


@pytest.mark.parametrize("ps", (4, 16, 64))
def test_key_shorter_than_a_page_caches_nothing(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps)
    res = tree.insert(_toks(1, ps - 1), alloc.take(ps - 1))
    assert (res.prefix_len, res.cached_len, res.last_node, res.device_frees) == (0, 0, 0, [])
    assert tree.node_count == 0
    assert tree.device_size == 0
    tree.insert(_toks(1, ps), alloc.take(ps))
    m = tree.match_prefix(_toks(1, ps - 1))
    assert (m.device_prefix_len, m.best_node, m.last_device_node) == (0, 0, 0)
    assert m.device_indices.tolist() == []
    tree.sanity_check()


def test_empty_key_and_empty_tree() -> None:
    tree = RadixTree(page_size=4)
    m = tree.match_prefix([])
    assert (m.device_prefix_len, m.last_device_node, m.best_node, m.host_hit_length) == (0, 0, 0, 0)
    assert m.device_indices.tolist() == []
    res = tree.insert([], [])
    assert (res.prefix_len, res.cached_len, res.last_node) == (0, 0, 0)
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert (m.device_prefix_len, m.best_node) == (0, 0)
    assert tree.node_count == 0
    tree.sanity_check()


# ---------------------------------------------------------------- splits
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_split_suffix_keeps_id_prefix_is_new(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps)
    a = _toks(1, 3 * ps)
    va = alloc.take(3 * ps)
    assert tree.insert(a, va).last_node == 1
    b = [*a[:ps], *_toks(5000, ps)]
    vb = alloc.take(2 * ps)
    res = tree.insert(b, vb)
    assert (res.prefix_len, res.cached_len) == (ps, 2 * ps)
    assert [f.tolist() for f in res.device_frees] == [vb[:ps].tolist()]
    # Node 1 (the original) keeps its id and now is the suffix; node 2 is the new prefix;
    # node 3 is the new leaf.
    assert tree.node_count == 3
    assert res.last_node == 3
    assert tree.node_key(1).tokens == a
    assert tree.node_key(2).tokens == a[:ps]
    assert tree.node_key(3).tokens == b
    m = tree.match_prefix(a)
    assert (m.last_device_node, m.best_node, m.device_prefix_len) == (1, 1, 3 * ps)
    assert m.device_indices.tolist() == va.tolist()
    m = tree.match_prefix(b)
    assert (m.last_device_node, m.device_prefix_len) == (3, 2 * ps)
    assert m.device_indices.tolist() == [*va[:ps].tolist(), *vb[ps:].tolist()]
    tree.sanity_check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_splits_on_partial_match(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps)
    a = _toks(1, 3 * ps)
    va = alloc.take(3 * ps)
    tree.insert(a, va)
    probe = [*a[: 2 * ps], *_toks(9000, ps)]
    m = tree.match_prefix(probe)
    assert m.device_prefix_len == 2 * ps
    assert m.device_indices.tolist() == va[: 2 * ps].tolist()
    assert (m.best_node, m.last_device_node, m.host_hit_length) == (2, 2, 0)
    assert tree.node_count == 2
    assert tree.node_key(2).tokens == a[: 2 * ps]
    assert tree.node_key(1).tokens == a
    # The match freed nothing and moved no size.
    assert tree.evictable_size == 3 * ps
    assert sorted(tree.device_slots().tolist()) == va.tolist()
    tree.sanity_check()


@pytest.mark.parametrize("ps", (4, 16, 64))
def test_divergence_inside_a_page_rounds_down(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps)
    a = _toks(1, 3 * ps)
    va = alloc.take(3 * ps)
    tree.insert(a, va)
    probe = list(a)
    probe[ps + 1] = 99_999  # differs in the second page
    m = tree.match_prefix(probe)
    assert m.device_prefix_len == ps
    assert m.device_indices.tolist() == va[:ps].tolist()
    assert m.best_node == 2
    assert tree.node_key(2).tokens == a[:ps]
    # An insert of that probe diverges at the same page boundary.
    vp = alloc.take(3 * ps)
    res = tree.insert(probe, vp)
    assert (res.prefix_len, res.cached_len) == (ps, 3 * ps)
    assert [f.tolist() for f in res.device_frees] == [vp[:ps].tolist()]
    assert tree.device_size == 5 * ps
    tree.sanity_check()


def test_match_stops_at_first_mismatching_page(alloc) -> None:
    tree = RadixTree(page_size=2)
    tree.insert([1, 2, 3, 4], alloc.take(4))
    m = tree.match_prefix([9, 2, 3, 4])
    assert (m.device_prefix_len, m.best_node, m.last_device_node) == (0, 0, 0)
    assert tree.node_count == 1


# ---------------------------------------------------------------- insert / ownership
def test_s02_ownership_rule(alloc) -> None:
    """S02: after [1,2,3,4] then [1,2,5] the tree holds exactly 5 slots."""
    tree = RadixTree(page_size=1)
    r1 = tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert (r1.prefix_len, r1.cached_len, r1.device_frees) == (0, 4, [])
    r2 = tree.insert([1, 2, 5], [20, 21, 22])
    assert (r2.prefix_len, r2.cached_len) == (2, 3)
    assert [f.tolist() for f in r2.device_frees] == [[20, 21]]
    assert sorted(tree.device_slots().tolist()) == [10, 11, 12, 13, 22]
    assert tree.device_size == 5
    assert tree.match_prefix([1, 2, 5]).device_indices.tolist() == [10, 11, 22]
    tree.sanity_check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_prev_prefix_len_duplicates(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps)
    k1 = _toks(1, 2 * ps)
    v1 = alloc.take(2 * ps)
    tree.insert(k1, v1)
    k2 = [*k1, *_toks(700, ps)]
    # The caller owns [0, ps) already: duplicates are reported only for [ps, 2ps).
    v2 = alloc.take(3 * ps)
    res = tree.insert(k2, v2, prev_prefix_len=ps)
    assert (res.prefix_len, res.cached_len) == (2 * ps, 3 * ps)
    assert [f.tolist() for f in res.device_frees] == [v2[ps : 2 * ps].tolist()]
    assert sorted(tree.device_slots().tolist()) == sorted([*v1.tolist(), *v2[2 * ps :].tolist()])
    # prev_prefix_len = 0: every overlapping slot is a duplicate.
    k3 = [*k1, *_toks(800, ps)]
    v3 = alloc.take(3 * ps)
    res = tree.insert(k3, v3)
    assert [f.tolist() for f in res.device_frees] == [v3[: 2 * ps].tolist()]
    # prev_prefix_len covering the whole overlap: nothing is a duplicate.
    k4 = [*k1, *_toks(900, ps)]
    v4 = alloc.take(3 * ps)
    res = tree.insert(k4, v4, prev_prefix_len=2 * ps)
    assert res.device_frees == []
    # A duplicate spanning two nodes comes back as one run.
    k5 = [*k4, *_toks(950, ps)]
    v5 = alloc.take(4 * ps)
    res = tree.insert(k5, v5, prev_prefix_len=ps)
    assert [f.tolist() for f in res.device_frees] == [v5[ps : 3 * ps].tolist()]
    assert tree.device_size == 2 * ps + 4 * ps
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 4))
def test_reinserting_the_trees_own_slots_frees_nothing(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps)
    k = _toks(1, 2 * ps)
    v = alloc.take(2 * ps)
    tree.insert(k, v)
    m = tree.match_prefix(k)
    ext = alloc.take(ps)
    res = tree.insert([*k, *_toks(400, ps)], np.concatenate([m.device_indices, ext]))
    assert res.device_frees == []
    assert sorted(tree.device_slots().tolist()) == sorted([*v.tolist(), *ext.tolist()])
    tree.sanity_check()


def test_insert_does_not_alias_the_callers_array(alloc) -> None:
    tree = RadixTree(page_size=1)
    v = alloc.take(3)
    tree.insert([1, 2, 3], v)
    v[:] = -1
    assert tree.match_prefix([1, 2, 3]).device_indices.tolist() == [1000, 1001, 1002]


def test_insert_accepts_lists_numpy_and_torch(alloc) -> None:
    torch = pytest.importorskip("torch")
    tree = RadixTree(page_size=1)
    tree.insert([1], [5])
    tree.insert([2], np.array([6], dtype=np.int32))
    tree.insert(torch.tensor([3]), torch.tensor([7]))
    assert sorted(tree.device_slots().tolist()) == [5, 6, 7]
    assert tree.match_prefix(torch.tensor([3])).device_indices.tolist() == [7]
    assert tree.match_prefix(np.array([2], dtype=np.uint16)).device_indices.tolist() == [6]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_result_fields_after_branching(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps)
    base = _toks(1, 2 * ps)
    vb = alloc.take(2 * ps)
    tree.insert(base, vb)
    leaf_a = [*base, *_toks(100, ps)]
    leaf_b = [*base, *_toks(200, 2 * ps)]
    va = alloc.take(3 * ps)
    vbb = alloc.take(4 * ps)
    ra = tree.insert(leaf_a, va)
    rb = tree.insert(leaf_b, vbb)
    m = tree.match_prefix([*leaf_b, 1, 2, 3])
    assert m.device_prefix_len == 4 * ps
    assert m.device_indices.tolist() == [*vb.tolist(), *vbb[2 * ps :].tolist()]
    assert (m.last_device_node, m.best_node, m.host_hit_length) == (rb.last_node, rb.last_node, 0)
    m = tree.match_prefix(leaf_a[: 2 * ps + ps // 2])  # stops at the shared node
    assert (m.device_prefix_len, m.best_node) == (2 * ps, 1)
    assert ra.last_node != rb.last_node
    assert tree.node_count == 3
    tree.sanity_check()


# ---------------------------------------------------------------- priority / hits
def test_priority_is_max_over_inserts(alloc) -> None:
    tree = RadixTree(page_size=1, eviction_policy="priority")
    tree.insert([1], alloc.take(1), priority=3)
    tree.insert([2], alloc.take(1), priority=1)
    tree.insert([3], alloc.take(1), priority=2)
    tree.insert([1], alloc.take(1), priority=0)  # stays 3
    tree.insert([2], alloc.take(1), priority=10)  # raised to 10
    order = []
    for _ in range(3):
        res = tree.evict(1)
        assert res.num_evicted == 1
        order.append(res.device_frees[0].tolist())
    assert order == [[1002], [1000], [1001]]
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 4))
def test_hit_counting_respects_inserted_len(ps: int, alloc) -> None:
    """write_through_selective backs a node up on its second counted hit."""
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through_selective")
    k = _toks(1, 2 * ps)
    assert tree.insert(k, alloc.take(2 * ps)).backups == []
    # The node ends at 2ps, not past inserted_len = 2ps: not a hit.
    assert tree.insert(k, alloc.take(2 * ps), inserted_len=2 * ps).backups == []
    assert tree.insert(k, alloc.take(2 * ps), inserted_len=5 * ps).backups == []
    # inserted_len 2ps - 1: the node ends past it, so this is the second hit.
    res = tree.insert(k, alloc.take(2 * ps), inserted_len=2 * ps - 1)
    assert [(b.node_id, b.num_tokens) for b in res.backups] == [(1, 2 * ps)]
    assert tree.pending_ops == 1
    tree.sanity_check()


def test_lfu_counts_hits_with_host_enabled(alloc) -> None:
    tree = RadixTree(page_size=1, eviction_policy="lfu", host_enabled=True)
    tree.insert([1], [10])
    tree.insert([2], [20])
    backups = tree.insert([1], [11]).backups  # second hit of [1]
    assert [b.node_id for b in backups] == [1]
    tree.abort_backup(backups[0].op_id)
    tree.insert([3], [30])
    # hits: [1] 2, [2] 1, [3] 1; [2] is older than [3].
    assert [tree.evict(1).device_frees[0].tolist() for _ in range(3)] == [[20], [30], [10]]
    tree.sanity_check()


# ---------------------------------------------------------------- un-evict
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_unevicts_host_only_node(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through",
                     enable_kv_events=True)
    k = _toks(1, 2 * ps)
    v = alloc.take(2 * ps)
    res = tree.insert(k, v)
    (req,) = res.backups
    h = alloc.take(2 * ps)
    assert tree.commit_backup(req.op_id, h) == [1]
    ev = tree.evict(2 * ps)
    assert ev.num_evicted == 2 * ps
    assert [f.tolist() for f in ev.device_frees] == [v.tolist()]
    assert (tree.device_size, tree.host_size) == (0, 2 * ps)
    stored = tree.take_events()
    gpu_hashes = stored[0].block_hashes
    tail = [7] * (ps - 1)  # an unaligned tail (none for page size 1)
    fresh = alloc.take(2 * ps + len(tail))
    res = tree.insert([*k, *tail], fresh)
    assert (res.prefix_len, res.cached_len, res.last_node) == (2 * ps, 2 * ps, 1)
    assert res.device_frees == []  # the caller's slots were adopted
    assert res.backups == []  # already backed up
    assert tree.device_size == tree.evictable_size == 2 * ps
    assert tree.host_size == 2 * ps
    assert sorted(tree.device_slots().tolist()) == fresh[: 2 * ps].tolist()
    assert sorted(tree.host_slots().tolist()) == h.tolist()
    m = tree.match_prefix(k)
    assert (m.device_prefix_len, m.host_hit_length, m.last_device_node) == (2 * ps, 0, 1)
    assert m.device_indices.tolist() == fresh[: 2 * ps].tolist()
    events = tree.take_events()
    assert len(events) == 1
    assert events[0].medium.value == "GPU"
    assert events[0].block_hashes == gpu_hashes
    assert events[0].parent_block_hash is None
    tree.sanity_check()


def test_unevict_partial_host_node_splits_it(alloc) -> None:
    ps = 4
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through")
    k = _toks(1, 3 * ps)
    (req,) = tree.insert(k, alloc.take(3 * ps)).backups
    h = alloc.take(3 * ps)
    tree.commit_backup(req.op_id, h)
    tree.evict(100)
    fresh = alloc.take(ps)
    res = tree.insert(k[:ps], fresh)
    assert (res.prefix_len, res.cached_len, res.device_frees) == (ps, ps, [])
    assert res.last_node == 2  # the new prefix fragment, now on device
    m = tree.match_prefix(k)
    assert (m.device_prefix_len, m.host_hit_length, m.last_device_node, m.best_node) == (
        ps, 2 * ps, 2, 1,
    )
    assert m.device_indices.tolist() == fresh.tolist()
    assert (tree.device_size, tree.host_size) == (ps, 3 * ps)
    tree.sanity_check()


def test_radix_key_reused_for_match_and_insert(alloc) -> None:
    tree = RadixTree(page_size=2)
    key = RadixKey([1, 2, 3, 4, 5], extra_key="x")
    res = tree.insert(key, alloc.take(5))
    assert res.cached_len == 4
    m = tree.match_prefix(key)
    assert m.device_prefix_len == 4
    assert tree.match_prefix([1, 2, 3, 4]).device_prefix_len == 0


def test_a_match_over_several_nodes_joins_their_slots_read_only() -> None:
    """The match concatenates its path's slot arrays with bytes.join (node.joined): the same
    int64 values as np.concatenate, in a read-only array that aliases no node's slots."""
    from asynccache.tree.node import joined

    parts = [np.arange(3, dtype=np.int64), np.array([2**40, 0], np.int64), np.array([7], np.int64)]
    out = joined(parts)
    assert out.dtype == np.int64 and not out.flags.writeable
    assert np.array_equal(out, np.concatenate(parts))
    assert joined([parts[0]]).tolist() == [0, 1, 2]
    for ps in (1, 4):
        tree = RadixTree(page_size=ps)
        tree.insert(RadixKey(list(range(16))), np.arange(100, 116, dtype=np.int64))
        tree.insert(RadixKey(list(range(8)) + [50] * 8), np.arange(200, 216, dtype=np.int64))
        tree.insert(RadixKey(list(range(12)) + [60] * 4), np.arange(300, 316, dtype=np.int64))
        m = tree.match_prefix(RadixKey(list(range(16))))
        assert m.device_prefix_len == 16
        assert m.device_indices.tolist() == list(range(100, 116))
        assert not m.device_indices.flags.writeable
        tree.sanity_check()
