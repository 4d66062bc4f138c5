"""Exact-value scenarios for the SWA and Mamba components (behavior.md §1.3-1.7)."""

from __future__ import annotations

import numpy as np
import pytest

from asynccache.errors import ConfigError, InvalidInputError, LockError
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
    v = tree.component_slots_of(node_at(tree, tokens).id, "swa")
    return None if v is None else v.tolist()


def flat(arrays: list[np.ndarray]) -> list[int]:
    return np.concatenate(arrays).tolist() if arrays else []


# ---------------------------------------------------------------- SWA
def test_swa_tombstones_from_birth_below_the_evicted_floor() -> None:
    # The observed SWA-tomb scenario.
    tree = RadixTree(page_size=1, sliding_window=4)
    r = tree.insert(list(range(8)), np.arange(8), swa_value=np.arange(100, 108),
                    component_evicted_seqlens={"swa": 4})
    tree.sanity_check()
    assert (r.prefix_len, r.cached_len, r.device_frees, r.component_frees) == (
        0, 8, [], {"swa": []})
    assert [(len(t), live) for t, live, _ in nodes(tree)] == [(4, False), (4, True)]
    assert swa_of(tree, [0, 1, 2, 3]) is None
    assert swa_of(tree, list(range(8))) == [104, 105, 106, 107]
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
    r = tree.insert(list(range(14)), np.arange(14), swa_value=np.arange(100, 114),
                    component_evicted_seqlens={"swa": 5})
    tree.sanity_check()
    # Page [4, 8) is partly freed: a tombstone, and the caller's SWA slots 5..7 come back.
    assert flat(r.component_frees["swa"]) == [105, 106, 107]
    assert r.device_frees == [] and r.cached_len == 12
    assert [(len(t), live) for t, live, _ in nodes(tree)] == [(8, False), (4, True)]
    assert swa_of(tree, list(range(12))) == [108, 109, 110, 111]


def test_window_validator_needs_a_live_window_after_a_tombstone() -> None:
    tree = RadixTree(page_size=1, sliding_window=4)
    tree.insert(list(range(12)), np.arange(12), swa_value=np.arange(100, 112))
    # Cap-split: the leaf holds exactly one window.
    assert [(len(t), live) for t, live, _ in nodes(tree)] == [(8, True), (4, True)]
    r = tree.evict(0, swa_num_tokens=1)  # the LRU SWA node is the older ancestor
    tree.sanity_check()
    assert (r.num_evicted, r.swa_num_evicted, flat(r.component_frees["swa"])) == (
        0, 8, list(range(100, 108)))
    assert tree.component_sizes("swa") == (4, 0)
    assert tree.match_prefix(list(range(12))).device_prefix_len == 12
    m = tree.match_prefix(list(range(10)))  # splits the leaf: only 2 live tokens after it
    tree.sanity_check()
    assert (m.device_prefix_len, m.full_kv_hit_length, m.swa_branching_seqlen) == (0, 10, 10)
    assert tree.match_prefix(list(range(8))).device_prefix_len == 0
    assert tree.match_prefix(list(range(12))).device_prefix_len == 12


def test_insert_recovers_an_in_window_tombstone_from_the_callers_slots() -> None:
    tree = RadixTree(page_size=1, sliding_window=4)
    tree.insert(list(range(12)), np.arange(12), swa_value=np.arange(100, 112))
    tree.evict(0, swa_num_tokens=1)  # [0..7] becomes an SWA tombstone
    assert tree.match_prefix(list(range(8))).device_prefix_len == 0
    r = tree.insert(list(range(8)), np.arange(20, 28), swa_value=np.arange(200, 208))
    tree.sanity_check()
    # Only the last window [4, 8) is recovered (split there); the rest are duplicates.
    assert flat(r.device_frees) == list(range(20, 28))
    assert flat(r.component_frees["swa"]) == [200, 201, 202, 203]
    assert [(f.tolist(), s.tolist()) for f, s in r.swa_adopted] == [
        ([4, 5, 6, 7], [204, 205, 206, 207])]
    assert swa_of(tree, [0, 1, 2, 3]) is None
    assert swa_of(tree, list(range(8))) == [204, 205, 206, 207]
    m = tree.match_prefix(list(range(8)))
    assert (m.device_prefix_len, m.device_indices.tolist()) == (8, list(range(8)))
    assert tree.component_sizes("swa") == (8, 0)


def test_duplicates_below_the_floor_free_the_full_side_only() -> None:
    tree = RadixTree(page_size=2, sliding_window=2)
    tree.insert([1, 2, 3, 4], np.arange(4), swa_value=np.arange(100, 104))
    r = tree.insert([1, 2, 3, 4, 5, 6], np.arange(10, 16), swa_value=np.arange(110, 116),
                    component_evicted_seqlens={"swa": 2})
    tree.sanity_check()
    assert flat(r.device_frees) == [10, 11, 12, 13]
    assert flat(r.component_frees["swa"]) == [112, 113]  # [0, 2) was already freed
    assert swa_of(tree, [1, 2, 3, 4, 5, 6]) == [114, 115]
    # Handing back the tree's own slots is no duplicate (prev_prefix_len or same slots).
    r = tree.insert([1, 2, 3, 4, 5, 6], np.array([0, 1, 2, 3, 14, 15]),
                    swa_value=np.array([100, 101, 102, 103, 114, 115]))
    assert (r.device_frees, r.component_frees["swa"], r.prefix_len) == ([], [], 6)


def test_duplicates_come_back_as_one_array_per_run_of_nodes() -> None:
    tree = RadixTree(page_size=2, sliding_window=4, mamba=True)
    tree.insert([1, 2, 3, 4, 5, 6], np.arange(6), swa_value=np.arange(100, 106), mamba_value=0)
    tree.insert([1, 2, 3, 4, 7, 8], np.arange(10, 16), swa_value=np.arange(110, 116),
                mamba_value=1)  # splits [1..6] after 4: the path now has two nodes
    r = tree.insert([1, 2, 3, 4, 5, 6, 9, 9], np.arange(20, 28), swa_value=np.arange(120, 128),
                    mamba_value=2)
    tree.sanity_check()
    # One run over both cached nodes, for each pool.
    assert [a.tolist() for a in r.device_frees] == [[20, 21, 22, 23, 24, 25]]
    assert [a.tolist() for a in r.component_frees["swa"]] == [[120, 121, 122, 123, 124, 125]]
    # The tree's own slots for the first node break the run: only the second node's come back.
    r = tree.insert([1, 2, 3, 4, 5, 6, 9, 9], np.array([0, 1, 2, 3, 34, 35, 26, 27]),
                    swa_value=np.array([100, 101, 102, 103, 134, 135, 126, 127]), mamba_value=2)
    tree.sanity_check()
    assert [a.tolist() for a in r.device_frees] == [[34, 35]]
    assert [a.tolist() for a in r.component_frees["swa"]] == [[134, 135]]
    assert r.mamba_exist and flat(r.component_frees["mamba"]) == []


def test_swa_lock_pins_one_window_and_release_swa_frees_it_early() -> None:
    tree = RadixTree(page_size=2, sliding_window=3)  # window rounds up to 4 tokens
    tree.insert(list(range(10)), np.arange(10), swa_value=np.arange(100, 110))
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
        0, 6, list(range(100, 106)))
    tree.release_swa(r)
    tree.sanity_check()
    assert tree.component_sizes("swa") == (4, 0)
    with pytest.raises(LockError, match="already released"):
        tree.release_swa(r)
    # FULL is still pinned: SWA eviction tombstones the pinned leaf instead of deleting it.
    e = tree.evict(100, swa_num_tokens=100)
    tree.sanity_check()
    assert (e.num_evicted, e.swa_num_evicted) == (0, 4)
    assert tree.match_prefix(list(range(10))).device_prefix_len == 0
    assert tree.unlock(r) == 10
    tree.sanity_check()
    # Everything is a tombstone now: evicting the leaf deletes the whole dead chain.
    e = tree.evict(1)
    assert (e.num_evicted, tree.node_count, tree.device_size) == (10, 0, 0)
    tree.sanity_check()


def test_swa_lock_spans_the_root_when_the_path_is_shorter_than_the_window() -> None:
    tree = RadixTree(page_size=1, sliding_window=8)
    tree.insert([1, 2, 3], np.arange(3), swa_value=np.arange(10, 13))
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
        tree.insert(list(range(k)), np.arange(k), swa_value=np.arange(100, 100 + k),
                    prev_prefix_len=k - 2)
    tree.sanity_check()
    assert [len(t) for t, _, _ in nodes(tree)] == [2, 2, 2, 2]
    assert tree.match_prefix(list(range(8))).device_prefix_len == 8
    # The match refreshed the last window + one page (nodes [6,7] and [4,5]) only.
    e = tree.evict(0, swa_num_tokens=1)
    assert flat(e.component_frees["swa"]) == [100, 101]
    e = tree.evict(0, swa_num_tokens=1)
    assert flat(e.component_frees["swa"]) == [102, 103]
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
    tree.insert([1, 2, 3, 4], np.arange(4), swa_value=np.arange(10, 14), mamba_value=7)
    tree.insert([1, 2], np.arange(2), swa_value=np.arange(10, 12), mamba_value=8)
    assert nodes(tree) == [([1, 2], True, True), ([3, 4], True, True)]
    r = tree.lock(tree.match_prefix([1, 2, 3, 4]).last_device_node)
    e = tree.evict(0, swa_num_tokens=1)
    tree.sanity_check()
    assert (e.swa_num_evicted, e.mamba_num_evicted) == (2, 1)
    assert (flat(e.component_frees["swa"]), flat(e.component_frees["mamba"])) == ([10, 11], [8])
    assert nodes(tree) == [([1, 2], False, False), ([3, 4], True, True)]
    assert tree.match_prefix([1, 2, 3, 4]).device_prefix_len == 4  # the window is live
    assert tree.match_prefix([1, 2]).device_prefix_len == 0
    tree.unlock(r)
    # Mamba eviction of an unlocked leaf deletes it atomically, with its dead parent.
    e = tree.evict(0, mamba_num=1)
    tree.sanity_check()
    assert (e.num_evicted, e.swa_num_evicted, e.mamba_num_evicted) == (4, 2, 1)
    assert (flat(e.device_frees), flat(e.component_frees["swa"])) == ([2, 3, 0, 1], [12, 13])
    assert tree.node_count == 0
    assert tree.component_sizes("swa") == tree.component_sizes("mamba") == (0, 0)


def test_full_eviction_deletes_leaves_with_all_components() -> None:
    tree = RadixTree(page_size=1, sliding_window=2, mamba=True)
    tree.insert([1, 2, 3], np.arange(3), swa_value=np.arange(10, 13), mamba_value=1)
    tree.insert([1, 2, 9], np.arange(20, 23), swa_value=np.arange(30, 33), mamba_value=2)
    tree.sanity_check()
    e = tree.evict(1)  # LRU leaf [3] goes; its parent [1, 2] still has a child
    assert (e.num_evicted, flat(e.device_frees)) == (1, [2])
    assert (e.swa_num_evicted, flat(e.component_frees["swa"])) == (1, [12])
    assert (e.mamba_num_evicted, flat(e.component_frees["mamba"])) == (1, [1])
    tree.sanity_check()
    # [1, 2] holds no state: once its last leaf goes it is a dead leaf and goes too.
    e = tree.evict(1)
    assert (e.num_evicted, sorted(flat(e.device_frees))) == (3, [0, 1, 22])
    assert tree.node_count == 0
    tree.sanity_check()


# ---------------------------------------------------------------- errors
def test_bad_component_input_names_the_value_and_changes_nothing(snapshot) -> None:
    tree = RadixTree(page_size=2, sliding_window=2, mamba=True)
    tree.insert([1, 2, 3, 4], np.arange(4), swa_value=np.arange(10, 14), mamba_value=1)
    before = snapshot(tree)
    bad = [
        (dict(), "swa_value is required"),
        (dict(swa_value=np.arange(3)), "swa_value has 3 slots"),
        (dict(swa_value=np.arange(6), component_evicted_seqlens={"swa": 7}), "seqlen 7"),
        (dict(swa_value=np.arange(6), component_evicted_seqlens={"mamba": 1}), "'mamba'"),
        (dict(swa_value=np.arange(6), mamba_value=-1), "-1"),
        (dict(swa_value=np.arange(6), mamba_value=np.arange(2)), "got 2 values"),
    ]
    for kwargs, msg in bad:
        with pytest.raises(InvalidInputError, match=msg):
            tree.insert([1, 2, 3, 4, 5, 6], np.arange(20, 26), **kwargs)
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
    with pytest.raises(InvalidInputError, match="no SWA component"):
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
                    swa_value=np.arange(1000 + 100 * i, 1000 + 100 * i + len(k)),
                    mamba_value=i, component_evicted_seqlens={"swa": 2 * i})
    tree.insert(list(range(5)), np.arange(300, 305), swa_value=np.arange(1300, 1305),
                mamba_value=7)
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
    r = tree.insert(list(range(8)), np.arange(8), swa_value=np.arange(100, 108),
                    component_evicted_seqlens={"swa": 4}, mamba_value=7)
    tail = node_at(tree, list(range(8)))
    head = node_at(tree, [0, 1, 2, 3])
    assert r.last_node == tail.id
    assert tree.component_slots_of(tail.id, "swa").tolist() == [104, 105, 106, 107]
    assert tree.component_slots_of(tail.id, "mamba").tolist() == [7]
    assert tree.component_slots_of(head.id, "swa") is None  # a tombstone from birth
    assert tree.component_slots_of(head.id, "mamba") is None
    assert tree.component_host_slots_of(tail.id, "swa") is None  # no host tier
    with pytest.raises(InvalidInputError, match=r"no auxiliary component 'full'.*\['swa', 'mamba'\]"):
        tree.component_slots_of(tail.id, "full")
    with pytest.raises(InvalidInputError, match="no auxiliary component 'nope'"):
        tree.component_host_slots_of(tail.id, "nope")
    with pytest.raises(UnknownNodeError, match="no node with id 999"):
        tree.component_slots_of(999, "swa")
