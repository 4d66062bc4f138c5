"""Exact-value scenarios for the SWA and Mamba components (behavior.md §1.3-1.7)."""

from __future__ import annotations

import numpy as np
import pytest

from asynccache.errors import ConfigError, InvalidInputError, LockError
from asynccache.transfers.allocator import PageAllocator
from asynccache.transfers.hybrid_pools import SWASlotMap
from asynccache.tree import RadixTree


def nodes(tree: RadixTree) -> list[tuple[list[int], bool, bool]]:
    """(tokens of the node itself, SWA live, holds a Mamba state) root-down, by key."""
    out = []
    for n in tree.iter_nodes():
        full = tree.node_key(n.id).tokens
        names = tree.components[1:]
        out.append((
            list(full),
            list(full[len(full) - n.ntok :]),
            "swa" in names and tree.component_slots_of(n.id, "swa") is not None,
            "mamba" in names and tree.component_slots_of(n.id, "mamba") is not None,
        ))
    out.sort(key=lambda t: (len(t[0]), t[0]))
    return [t[1:] for t in out]


def node_at(tree: RadixTree, tokens: list[int]):
    return next(n for n in tree.iter_nodes() if list(tree.node_key(n.id).tokens) == tokens)


def swa_of(tree: RadixTree, tokens: list[int]) -> list[int] | None:
    """The node's SWA entry: its own FULL slot array (the very same object) when SWA-live, None
    for a tombstone. The tree names SWA data by FULL slots."""
    n = node_at(tree, tokens)
    v = tree.component_slots_of(n.id, "swa")
    if v is None:
        return None
    assert v is n.value
    return v.tolist()


def swa_live_full(pool: SWASlotMap) -> list[int]:
    """The FULL slots whose SWA side the pool still holds."""
    return np.flatnonzero(pool.full_to_swa >= 0).tolist()


def flat(arrays: list[np.ndarray]) -> list[int]:
    return np.concatenate(arrays).tolist() if arrays else []


# ---------------------------------------------------------------- SWA
def test_swa_tombstones_from_birth_below_the_evicted_floor() -> None:
    # The observed SWA-tomb scenario.
    tree = RadixTree(page_size=1, sliding_window=4)
    r = tree.insert(list(range(8)), np.arange(8), component_evicted_seqlens={"swa": 4})
    tree.sanity_check()
    assert (r.prefix_len, r.cached_len, r.device_frees, r.component_frees) == (
        0, 8, [], {"swa": []})
    assert r.swa_adopted == []
    assert [(len(t), live) for t, live, _ in nodes(tree)] == [(4, False), (4, True)]
    assert swa_of(tree, [0, 1, 2, 3]) is None
    assert swa_of(tree, list(range(8))) == [4, 5, 6, 7]  # its FULL slots
    assert tree.component_slots("swa").tolist() == [4, 5, 6, 7]
    assert tree.component_sizes("swa") == (4, 0)
    assert tree.component_sizes("full") == (8, 0)
    m = tree.match_prefix(list(range(8)))
    assert (m.device_prefix_len, m.device_indices.tolist(), m.full_kv_hit_length) == (
        8, list(range(8)), 8)
    assert m.swa_branching_seqlen is None
    m6 = tree.match_prefix(list(range(6)))
    assert (m6.device_prefix_len, m6.full_kv_hit_length, m6.swa_branching_seqlen) == (0, 6, 6)
    m4 = tree.match_prefix(list(range(4)))
    assert (m4.device_prefix_len, m4.last_device_node, m4.swa_branching_seqlen) == (0, 0, 4)
    tree.sanity_check()
    assert tree.match_prefix(list(range(8))).device_prefix_len == 8


def test_unaligned_floor_frees_the_partly_freed_page_and_keeps_the_rest() -> None:
    tree = RadixTree(page_size=4, sliding_window=4)
    r = tree.insert(list(range(14)), np.arange(100, 114), component_evicted_seqlens={"swa": 5})
    tree.sanity_check()
    # Page [4, 8) is partly freed: a tombstone, and the SWA side of the caller's FULL slots of
    # positions 5..7 is given up (named by those FULL slots, which the tree keeps).
    assert flat(r.component_frees["swa"]) == [105, 106, 107]
    assert r.device_frees == [] and r.cached_len == 12
    assert [(len(t), live) for t, live, _ in nodes(tree)] == [(8, False), (4, True)]
    assert swa_of(tree, list(range(8))) is None
    assert swa_of(tree, list(range(12))) == [108, 109, 110, 111]
    head = node_at(tree, list(range(8))).value
    assert head is not None and head.tolist() == list(range(100, 108))  # FULL KV kept


def test_window_validator_needs_a_live_window_after_a_tombstone() -> None:
    tree = RadixTree(page_size=1, sliding_window=4)
    tree.insert(list(range(12)), np.arange(12))
    # Cap-split: the leaf holds exactly one window.
    assert [(len(t), live) for t, live, _ in nodes(tree)] == [(8, True), (4, True)]
    r = tree.evict(0, swa_num_tokens=1)  # the LRU SWA node is the older ancestor
    tree.sanity_check()
    # The tombstoned node's FULL slots name the SWA side given up; its FULL KV stays.
    assert (r.num_evicted, r.swa_num_evicted, flat(r.component_frees["swa"])) == (
        0, 8, list(range(8)))
    assert r.device_frees == []
    assert tree.component_sizes("swa") == (4, 0)
    assert tree.component_sizes("full") == (12, 0)
    assert tree.component_slots("swa").tolist() == [8, 9, 10, 11]
    assert tree.match_prefix(list(range(12))).device_prefix_len == 12
    m = tree.match_prefix(list(range(10)))  # splits the leaf: only 2 live tokens after it
    tree.sanity_check()
    assert (m.device_prefix_len, m.full_kv_hit_length, m.swa_branching_seqlen) == (0, 10, 10)
    assert tree.match_prefix(list(range(8))).device_prefix_len == 0
    assert tree.match_prefix(list(range(12))).device_prefix_len == 12


def test_insert_recovers_an_in_window_tombstone_from_the_callers_slots() -> None:
    # A real slot map: every tree result is applied to it, and the FULL slots with a live SWA
    # side are exactly the tree's SWA-live FULL slots after each step.
    pool = SWASlotMap(PageAllocator(32, 1), PageAllocator(32, 1))
    tree = RadixTree(page_size=1, sliding_window=4)
    a = pool.alloc(12)
    assert a is not None and a.tolist() == list(range(12))
    r = tree.insert(list(range(12)), a)
    assert (r.device_frees, r.component_frees["swa"], r.swa_adopted) == ([], [], [])
    e = tree.evict(0, swa_num_tokens=1)  # [0..7] becomes an SWA tombstone
    assert flat(e.component_frees["swa"]) == list(range(8)) and e.device_frees == []
    pool.apply_tree_frees(e.device_frees, e.component_frees["swa"])
    assert swa_live_full(pool) == tree.component_slots("swa").tolist() == list(range(8, 12))
    assert (pool.full.used_size, pool.swa.used_size) == (12, 4)
    assert tree.match_prefix(list(range(8))).device_prefix_len == 0
    b = pool.alloc(8)
    assert b is not None and b.tolist() == list(range(12, 20))
    assert pool.translate(b).tolist() == list(range(8))  # the SWA slots the evict gave back
    r = tree.insert(list(range(8)), b)
    tree.sanity_check()
    # Only the last window [4, 8) is recovered (split there), from the SWA side of the caller's
    # FULL slots 16..19; the SWA side of 12..15 is given up; all of b duplicates FULL KV.
    assert flat(r.device_frees) == list(range(12, 20))
    assert flat(r.component_frees["swa"]) == [12, 13, 14, 15]
    assert [(f.tolist(), s.tolist()) for f, s in r.swa_adopted] == [
        ([4, 5, 6, 7], [16, 17, 18, 19])]
    assert swa_of(tree, [0, 1, 2, 3]) is None
    assert swa_of(tree, list(range(8))) == [4, 5, 6, 7]
    m = tree.match_prefix(list(range(8)))
    assert (m.device_prefix_len, m.device_indices.tolist()) == (8, list(range(8)))
    assert tree.component_sizes("swa") == (8, 0)
    pool.apply_tree_frees(r.device_frees, r.component_frees["swa"], r.swa_adopted)
    pool.check()
    # The node's FULL slots 4..7 now translate to the caller's SWA slots 4..7; b is all freed.
    assert pool.translate(np.arange(4, 8)).tolist() == [4, 5, 6, 7]
    assert swa_live_full(pool) == tree.component_slots("swa").tolist() == list(range(4, 12))
    assert (pool.full.used_size, pool.swa.used_size) == (12, 8)
    e = tree.evict(100, swa_num_tokens=100)
    tree.sanity_check()
    assert (e.num_evicted, e.swa_num_evicted) == (12, 8)
    pool.apply_tree_frees(e.device_frees, e.component_frees["swa"])
    pool.check()
    assert (pool.full.used_size, pool.swa.used_size) == (0, 0)


def test_recovery_from_the_nodes_own_slots_reports_no_adoption() -> None:
    # The caller's FULL slots are the node's own (as when a host-only node was given them):
    # below the recovery boundary their SWA side is still given up; above it nothing moves.
    tree = RadixTree(page_size=1, sliding_window=4)
    tree.insert(list(range(12)), np.arange(12))
    tree.evict(0, swa_num_tokens=1)  # [0..7] becomes an SWA tombstone
    r = tree.insert(list(range(8)), np.arange(8))
    tree.sanity_check()
    assert (r.device_frees, flat(r.component_frees["swa"]), r.swa_adopted) == (
        [], [0, 1, 2, 3], [])
    assert [(len(t), live) for t, live, _ in nodes(tree)] == [(4, False), (4, True), (4, True)]
    assert swa_of(tree, list(range(8))) == [4, 5, 6, 7]
    assert tree.match_prefix(list(range(8))).device_prefix_len == 8


def test_duplicates_below_the_floor_free_the_full_side_only() -> None:
    pool = SWASlotMap(PageAllocator(32, 2), PageAllocator(32, 2))
    tree = RadixTree(page_size=2, sliding_window=2)
    a = pool.alloc(4)
    assert a is not None and a.tolist() == [0, 1, 2, 3]
    tree.insert([1, 2, 3, 4], a)
    b = pool.alloc(6)
    assert b is not None and b.tolist() == [4, 5, 6, 7, 8, 9]
    pool.free_swa(pool.translate(b[:2]))  # the caller already freed the SWA side of [0, 2)
    r = tree.insert([1, 2, 3, 4, 5, 6], b, component_evicted_seqlens={"swa": 2})
    tree.sanity_check()
    # The duplicates come back as FULL slots only: freeing them frees whatever SWA side they
    # still have (6, 7), and nothing is freed twice (4, 5 have none any more).
    assert flat(r.device_frees) == [4, 5, 6, 7]
    assert (r.component_frees["swa"], r.swa_adopted) == ([], [])
    assert swa_of(tree, [1, 2, 3, 4, 5, 6]) == [8, 9]
    pool.apply_tree_frees(r.device_frees, r.component_frees["swa"], r.swa_adopted)
    pool.check()
    assert (pool.full.used_size, pool.swa.used_size) == (6, 6)
    assert swa_live_full(pool) == sorted(tree.component_slots("swa").tolist()) == [
        0, 1, 2, 3, 8, 9]
    # Handing back the tree's own slots is no duplicate (prev_prefix_len or same slots).
    r = tree.insert([1, 2, 3, 4, 5, 6], np.array([0, 1, 2, 3, 8, 9]))
    assert (r.device_frees, r.component_frees["swa"], r.prefix_len) == ([], [], 6)
    tree.sanity_check()


def test_duplicates_come_back_as_one_array_per_run_of_nodes() -> None:
    tree = RadixTree(page_size=2, sliding_window=4, mamba=True)
    tree.insert([1, 2, 3, 4, 5, 6], np.arange(6), mamba_value=0)
    # Splits [1..6] after 4: the path now has two nodes.
    tree.insert([1, 2, 3, 4, 7, 8], np.arange(10, 16), mamba_value=1)
    r = tree.insert([1, 2, 3, 4, 5, 6, 9, 9], np.arange(20, 28), mamba_value=2)
    tree.sanity_check()
    # One run over both cached nodes; no separate SWA frees (the FULL free takes them along).
    assert [a.tolist() for a in r.device_frees] == [[20, 21, 22, 23, 24, 25]]
    assert (r.component_frees["swa"], r.swa_adopted) == ([], [])
    assert swa_of(tree, [1, 2, 3, 4, 5, 6, 9, 9]) == [26, 27]
    # The tree's own slots for the first node break the run: only the second node's come back.
    r = tree.insert([1, 2, 3, 4, 5, 6, 9, 9], np.array([0, 1, 2, 3, 34, 35, 26, 27]),
                    mamba_value=2)
    tree.sanity_check()
    assert [a.tolist() for a in r.device_frees] == [[34, 35]]
    assert (r.component_frees["swa"], r.swa_adopted) == ([], [])
    assert r.mamba_exist and flat(r.component_frees["mamba"]) == []


def test_swa_lock_pins_one_window_and_release_swa_frees_it_early() -> None:
    tree = RadixTree(page_size=2, sliding_window=3)  # window rounds up to 4 tokens
    tree.insert(list(range(10)), np.arange(10))
    assert [(len(t), live) for t, live, _ in nodes(tree)] == [(6, True), (4, True)]
    leaf = tree.match_prefix(list(range(10))).last_device_node
    r = tree.lock(leaf)
    tree.sanity_check()
    assert (r.delta, r.swa_span, r.mamba_locked) == (10, 4, False)
    assert tree.component_sizes("swa") == (6, 4)
    assert tree.component_sizes("full") == (0, 10)
    # A split inside the pinned window keeps the pins exact (both halves are pinned).
    tree.match_prefix(list(range(8)))
    tree.sanity_check()
    assert tree.component_sizes("swa") == (6, 4)
    e = tree.evict(100, swa_num_tokens=100)
    tree.sanity_check()
    assert (e.num_evicted, e.swa_num_evicted, flat(e.component_frees["swa"])) == (
        0, 6, list(range(6)))
    assert sorted(tree.component_slots("swa").tolist()) == [6, 7, 8, 9]  # the pinned window
    tree.release_swa(r)
    tree.sanity_check()
    assert tree.component_sizes("swa") == (4, 0)
    with pytest.raises(LockError, match="already released"):
        tree.release_swa(r)
    # FULL is still pinned: SWA eviction tombstones the pinned leaf instead of deleting it.
    e = tree.evict(100, swa_num_tokens=100)
    tree.sanity_check()
    assert (e.num_evicted, e.swa_num_evicted) == (0, 4)
    # Both halves of the split window (the leaf keeps the older id, so it goes first).
    assert [a.tolist() for a in e.component_frees["swa"]] == [[8, 9], [6, 7]]
    assert tree.component_slots("swa").tolist() == []
    assert tree.match_prefix(list(range(10))).device_prefix_len == 0
    assert tree.unlock(r) == 10
    tree.sanity_check()
    # Everything is a tombstone now: evicting the leaf deletes the whole dead chain.
    # Their SWA side is gone already: only FULL slots come back.
    e = tree.evict(1)
    assert (e.num_evicted, tree.node_count, tree.device_size) == (10, 0, 0)
    assert (sorted(flat(e.device_frees)), e.component_frees["swa"], e.swa_num_evicted) == (
        list(range(10)), [], 0)
    tree.sanity_check()


def test_swa_lock_spans_the_root_when_the_path_is_shorter_than_the_window() -> None:
    tree = RadixTree(page_size=1, sliding_window=8)
    tree.insert([1, 2, 3], np.arange(3))
    r = tree.lock(tree.match_prefix([1, 2, 3]).last_device_node)
    assert r.swa_span == 3
    assert tree.component_sizes("swa") == (0, 3)
    root = tree.lock(0)
    assert (root.swa_span, root.delta) == (0, 0)
    tree.unlock(root)
    tree.unlock(r)
    tree.sanity_check()
    assert tree.component_sizes("swa") == (3, 0)


def test_swa_match_refreshes_only_a_bounded_window_of_ancestors() -> None:
    tree = RadixTree(page_size=1, sliding_window=2)
    for k in (4, 6, 8):
        tree.insert(list(range(k)), np.arange(k), prev_prefix_len=k - 2)
    tree.sanity_check()
    assert [len(t) for t, _, _ in nodes(tree)] == [2, 2, 2, 2]
    assert tree.match_prefix(list(range(8))).device_prefix_len == 8
    # The match refreshed the last window + one page (nodes [6,7] and [4,5]) only.
    e = tree.evict(0, swa_num_tokens=1)
    assert flat(e.component_frees["swa"]) == [0, 1]
    e = tree.evict(0, swa_num_tokens=1)
    assert flat(e.component_frees["swa"]) == [2, 3]
    tree.sanity_check()
    assert tree.match_prefix(list(range(8))).device_prefix_len == 8
    assert tree.match_prefix(list(range(4))).device_prefix_len == 0


# ---------------------------------------------------------------- Mamba
def test_mamba_match_stops_at_the_deepest_state() -> None:
    tree = RadixTree(page_size=2, mamba=True, mamba_track_interval=4)
    a = list(range(8))
    b = [0, 1, 2, 3, 20, 21, 22, 23]
    assert tree.insert(a, np.arange(8), mamba_value=50).component_frees == {"mamba": []}
    tree.insert(b, np.arange(10, 18), mamba_value=51)
    tree.sanity_check()
    assert nodes(tree) == [([0, 1, 2, 3], False, False), ([4, 5, 6, 7], False, True),
                           ([20, 21, 22, 23], False, True)]
    m = tree.match_prefix(a, cow_mamba=True)
    assert (m.device_prefix_len, m.mamba_cow_slot, m.mamba_branching_seqlen) == (8, 50, None)
    m = tree.match_prefix(a[:6])  # splits [4..7]: the state stays on the suffix
    tree.sanity_check()
    assert (m.device_prefix_len, m.full_kv_hit_length, m.mamba_branching_seqlen) == (0, 6, 4)
    assert m.mamba_cow_slot is None
    m = tree.match_prefix([*a[:6], 9, 9, 9])
    assert (m.device_prefix_len, m.mamba_branching_seqlen) == (0, 4)
    # A state for the shared prefix is adopted; a second one for the same node is a duplicate.
    r = tree.insert(a[:4], np.arange(4), mamba_value=70)
    assert (r.mamba_exist, r.component_frees, r.prefix_len) == (False, {"mamba": []}, 4)
    r = tree.insert(a[:4], np.arange(4), mamba_value=71)
    assert (r.mamba_exist, flat(r.component_frees["mamba"])) == (True, [71])
    r = tree.insert(a[:4], np.arange(4), mamba_value=70)
    assert (r.mamba_exist, r.component_frees) == (True, {"mamba": []})
    assert tree.match_prefix(a[:6]).device_prefix_len == 4
    assert tree.component_sizes("mamba") == (3, 0)
    tree.sanity_check()


def test_mamba_lock_is_single_node_and_skippable() -> None:
    tree = RadixTree(page_size=1, mamba=True)
    tree.insert([1, 2, 3, 4], np.arange(4), mamba_value=5)
    tree.insert([1, 2], np.arange(2), mamba_value=6)
    leaf = tree.match_prefix([1, 2, 3, 4]).last_device_node
    r = tree.lock(leaf)
    assert (r.mamba_locked, tree.component_sizes("mamba")) == (True, (1, 1))
    skip = tree.lock(leaf, skip=("mamba",))
    assert skip.mamba_locked is False
    tree.sanity_check()
    # The pinned leaf keeps its state; the unpinned internal state is tombstoned.
    e = tree.evict(0, mamba_num=5)
    assert (e.mamba_num_evicted, flat(e.component_frees["mamba"]), e.num_evicted) == (1, [6], 0)
    tree.unlock(r)
    tree.sanity_check()
    # FULL is still pinned by `skip`: the leaf's state is tombstoned, the leaf kept.
    e = tree.evict(0, mamba_num=1)
    assert (e.mamba_num_evicted, flat(e.component_frees["mamba"]), e.num_evicted) == (1, [5], 0)
    assert tree.node_count == 2
    tree.unlock(skip)
    e = tree.evict(1)
    assert (e.num_evicted, flat(e.device_frees), tree.node_count) == (4, [2, 3, 0, 1], 0)
    tree.sanity_check()


# ---------------------------------------------------------------- cascade
def test_swa_eviction_of_an_internal_node_drops_its_mamba_state_too() -> None:
    tree = RadixTree(page_size=1, sliding_window=2, mamba=True)
    tree.insert([1, 2, 3, 4], np.arange(4), mamba_value=7)
    tree.insert([1, 2], np.arange(2), mamba_value=8)
    assert nodes(tree) == [([1, 2], True, True), ([3, 4], True, True)]
    r = tree.lock(tree.match_prefix([1, 2, 3, 4]).last_device_node)
    e = tree.evict(0, swa_num_tokens=1)
    tree.sanity_check()
    assert (e.swa_num_evicted, e.mamba_num_evicted) == (2, 1)
    assert (flat(e.component_frees["swa"]), flat(e.component_frees["mamba"])) == ([0, 1], [8])
    assert e.device_frees == []  # the tombstone keeps its FULL KV
    assert nodes(tree) == [([1, 2], False, False), ([3, 4], True, True)]
    assert tree.match_prefix([1, 2, 3, 4]).device_prefix_len == 4  # the window is live
    assert tree.match_prefix([1, 2]).device_prefix_len == 0
    tree.unlock(r)
    # Mamba eviction of an unlocked leaf deletes it atomically, with its dead parent: the
    # SWA-live leaf's FULL slots come back in both lists, the tombstone parent's in FULL only.
    e = tree.evict(0, mamba_num=1)
    tree.sanity_check()
    assert (e.num_evicted, e.swa_num_evicted, e.mamba_num_evicted) == (4, 2, 1)
    assert (flat(e.device_frees), flat(e.component_frees["swa"])) == ([2, 3, 0, 1], [2, 3])
    assert flat(e.component_frees["mamba"]) == [7]
    assert tree.node_count == 0
    assert tree.component_sizes("swa") == tree.component_sizes("mamba") == (0, 0)


def test_full_eviction_deletes_leaves_with_all_components() -> None:
    tree = RadixTree(page_size=1, sliding_window=2, mamba=True)
    tree.insert([1, 2, 3], np.arange(3), mamba_value=1)
    r = tree.insert([1, 2, 9], np.arange(20, 23), mamba_value=2)
    tree.sanity_check()
    # The duplicates come back as FULL slots only (their SWA side goes with them).
    assert ([a.tolist() for a in r.device_frees], r.component_frees) == (
        [[20, 21]], {"swa": [], "mamba": []})
    e = tree.evict(1)  # LRU leaf [3] goes; its parent [1, 2] still has a child
    assert (e.num_evicted, flat(e.device_frees)) == (1, [2])
    assert (e.swa_num_evicted, flat(e.component_frees["swa"])) == (1, [2])
    assert (e.mamba_num_evicted, flat(e.component_frees["mamba"])) == (1, [1])
    tree.sanity_check()
    # [1, 2] holds no state: once its last leaf goes it is a dead leaf and goes too.
    # Every deleted node was SWA-live: its FULL slots come back in both lists.
    e = tree.evict(1)
    assert (e.num_evicted, sorted(flat(e.device_frees))) == (3, [0, 1, 22])
    assert (e.swa_num_evicted, flat(e.component_frees["swa"])) == (3, flat(e.device_frees))
    assert (e.mamba_num_evicted, flat(e.component_frees["mamba"])) == (1, [2])
    assert tree.node_count == 0
    assert tree.component_sizes("swa") == tree.component_sizes("mamba") == (0, 0)
    tree.sanity_check()


# ---------------------------------------------------------------- errors
def test_bad_component_input_names_the_value_and_changes_nothing(snapshot) -> None:
    tree = RadixTree(page_size=2, sliding_window=2, mamba=True)
    tree.insert([1, 2, 3, 4], np.arange(4), mamba_value=1)
    before = snapshot(tree)
    bad = [
        (dict(component_evicted_seqlens={"swa": 7}), "seqlen 7"),
        (dict(component_evicted_seqlens={"mamba": 1}), "'mamba'"),
        (dict(mamba_value=-1), "-1"),
        (dict(mamba_value=np.arange(2)), "got 2 values"),
    ]
    for kwargs, msg in bad:
        with pytest.raises(InvalidInputError, match=msg):
            tree.insert([1, 2, 3, 4, 5, 6], np.arange(20, 26), **kwargs)
        assert snapshot(tree) == before
    # The tree takes no SWA slots any more: the argument is gone.
    with pytest.raises(TypeError, match="swa_value"):
        tree.insert([1, 2, 3, 4, 5, 6], np.arange(20, 26), swa_value=np.arange(6))
    assert snapshot(tree) == before
    with pytest.raises(InvalidInputError, match="'full'"):
        tree.lock(0, skip=("full",))
    with pytest.raises(InvalidInputError, match="-2"):
        tree.evict(0, swa_num_tokens=-2)
    with pytest.raises(InvalidInputError, match="'c128'"):
        tree.component_sizes("c128")
    assert snapshot(tree) == before
    tree.sanity_check()
    full = RadixTree(page_size=1)
    with pytest.raises(InvalidInputError, match="swa_num_tokens=3"):
        full.evict(1, swa_num_tokens=3)
    with pytest.raises(InvalidInputError, match=r"names 'swa'.*components are \[\]"):
        full.insert([1], [1], component_evicted_seqlens={"swa": 1})
    with pytest.raises(TypeError, match="swa_value"):
        full.insert([1], [1], swa_value=[2])
    with pytest.raises(InvalidInputError, match="no Mamba component"):
        full.insert([1], [1], mamba_value=2)
    with pytest.raises(LockError, match="no SWA component"):
        full.release_swa(full.lock(0))
    assert full.node_count == 0


def test_hybrid_config_errors() -> None:
    with pytest.raises(ConfigError, match="mamba_track_interval 6"):
        RadixTree(page_size=4, mamba=True, mamba_track_interval=6)
    with pytest.raises(ConfigError, match="-1"):
        RadixTree(sliding_window=-1)
    with pytest.raises(ConfigError, match="'yes'"):
        RadixTree(mamba="yes")


def test_component_accepts_hooks_agree_with_the_inline_match_walk() -> None:
    tree = RadixTree(page_size=1, sliding_window=3, mamba=True)
    keys = [list(range(10)), [*range(5), 50, 51, 52, 53], [*range(3), 60, 61]]
    for i, k in enumerate(keys):
        tree.insert(k, np.arange(100 * i, 100 * i + len(k)),
                    mamba_value=i, component_evicted_seqlens={"swa": 2 * i})
    tree.insert(list(range(5)), np.arange(300, 305), mamba_value=7)
    tree.evict(0, swa_num_tokens=1)
    tree.sanity_check()
    swa, mamba = tree._aux
    probes = [k[:j] for k in keys for j in range(1, len(k) + 1)]
    accepted_somewhere = 0
    for probe in probes:
        m = tree.match_prefix(probe)
        end = next(n for n in tree.iter_nodes()
                   if list(tree.node_key(n.id).tokens) == probe[: m.full_kv_hit_length]
                   ) if m.full_kv_hit_length else None
        path = []
        while end is not None and end.parent is not None:
            path.append(end)
            end = end.parent
        live, depth, best = 1 << 62, 0, 0
        for n in reversed(path):
            depth += n.ntok
            live = live + n.ntok if swa.value(n) is not None else 0
            if swa.accepts(n, live) and mamba.accepts(n, live):
                best = depth
        assert m.device_prefix_len == best, probe
        accepted_somewhere += best > 0
    assert 0 < accepted_somewhere < len(probes)


def test_component_slots_of_reads_one_node_and_rejects_bad_names_and_ids() -> None:
    from asynccache.errors import UnknownNodeError

    tree = RadixTree(page_size=1, sliding_window=4, mamba=True)
    r = tree.insert(list(range(8)), np.arange(100, 108), component_evicted_seqlens={"swa": 4},
                    mamba_value=7)
    tail = node_at(tree, list(range(8)))
    head = node_at(tree, [0, 1, 2, 3])
    assert r.last_node == tail.id
    # The SWA entry is the node's FULL slot array itself.
    assert tree.component_slots_of(tail.id, "swa") is tail.value
    assert tree.component_slots_of(tail.id, "swa").tolist() == [104, 105, 106, 107]
    assert tree.component_slots_of(tail.id, "mamba").tolist() == [7]
    assert tree.component_slots_of(head.id, "swa") is None  # a tombstone from birth
    assert tree.component_slots_of(head.id, "mamba") is None
    assert tree.component_host_slots_of(tail.id, "swa") is None  # no host tier
    with pytest.raises(
        InvalidInputError, match=r"no auxiliary component 'full'.*\['swa', 'mamba'\]"
    ):
        tree.component_slots_of(tail.id, "full")
    with pytest.raises(InvalidInputError, match="no auxiliary component 'nope'"):
        tree.component_host_slots_of(tail.id, "nope")
    with pytest.raises(UnknownNodeError, match="no node with id 999"):
        tree.component_slots_of(999, "swa")
