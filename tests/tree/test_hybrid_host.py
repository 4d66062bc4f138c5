"""The host (L2) tier of hybrid trees: component host copies, demotion, load-back, host
eviction (behavior.md §1.2-1.7, §1.3 step 2: device-or-host vs device-only validators)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from asynccache.errors import InvalidInputError
from asynccache.transfers.allocator import PageAllocator
from asynccache.transfers.hybrid_pools import SWASlotMap
from asynccache.tree import RadixTree


def L(arrays: Any) -> Any:
    """Slot arrays as plain lists (a list of arrays, a dict of them, or one array)."""
    if isinstance(arrays, dict):
        return {k: L(v) for k, v in arrays.items()}
    if isinstance(arrays, list | tuple):
        return [L(a) for a in arrays]
    return arrays.tolist()


def node_at(tree: RadixTree, tokens: list[int]) -> Any:
    return next(n for n in tree.iter_nodes() if list(tree.node_key(n.id).tokens) == tokens)


def comp(tree: RadixTree, tokens: list[int], name: str) -> tuple[Any, Any]:
    """(device slots, host slots) of a component on the node ending at ``tokens``."""
    nid = node_at(tree, tokens).id
    dev = tree.component_slots_of(nid, name)
    host = tree.component_host_slots_of(nid, name)
    return (
        None if dev is None else dev.tolist(),
        None if host is None else host.tolist(),
    )


def commit_all(tree: RadixTree, backups: Any, host: int = 500, chost: int = 600) -> None:
    for b in backups:
        n = len(b.device_slots)
        parts = {}
        for name, v in b.component_slots.items():
            parts[name] = np.arange(chost, chost + len(v))
            chost += len(v)
        tree.commit_backup(b.op_id, np.arange(host, host + n), parts)
        host += n
        tree.sanity_check()


def swa_tree(**kw: Any) -> RadixTree:
    kw.setdefault("write_policy", "write_through")
    return RadixTree(page_size=1, sliding_window=4, host_enabled=True, **kw)


def test_swa_backup_demote_load_back_round_trip() -> None:
    t = swa_tree()
    r = t.insert(list(range(8)), np.arange(100, 108))
    t.sanity_check()
    # Cap-split into [0..3] and [4..7]; write-through backs both up, root first, SWA included.
    # The SWA part of a backup names the node's FULL device slots (the cache translates them).
    assert [(b.device_slots.tolist(), L(b.component_slots)) for b in r.backups] == [
        ([100, 101, 102, 103], {"swa": [100, 101, 102, 103]}),
        ([104, 105, 106, 107], {"swa": [104, 105, 106, 107]}),
    ]
    commit_all(t, r.backups)
    assert t.host_size == 8
    assert L(t.component_host_slots("swa")) == list(range(600, 608))
    assert comp(t, [0, 1, 2, 3], "swa") == ([100, 101, 102, 103], [600, 601, 602, 603])
    e = t.evict(8)
    t.sanity_check()
    assert (e.num_evicted, e.swa_num_evicted) == (8, 8)
    assert L(e.device_frees) == [[104, 105, 106, 107], [100, 101, 102, 103]]
    # Demotion gives up the SWA side of the demoted nodes' FULL slots.
    assert L(e.component_frees) == {"swa": [[104, 105, 106, 107], [100, 101, 102, 103]]}
    assert L(e.component_host_frees) == {"swa": []}
    assert comp(t, list(range(8)), "swa") == (None, [604, 605, 606, 607])
    assert t.component_sizes("swa") == (0, 0)
    m = t.match_prefix(list(range(8)))
    leaf = node_at(t, list(range(8))).id
    assert (m.device_prefix_len, m.last_device_node, m.best_node, m.host_hit_length) == (
        0, 0, leaf, 8)
    assert t.load_back_sizes(leaf) == {"full": 8, "swa": 8}
    tk = t.start_load_back(leaf, np.arange(20, 28), {"swa": np.arange(30, 38)})
    t.sanity_check()
    assert L(tk.host_slots) == list(range(500, 508))
    assert L(tk.component_host_slots) == {"swa": list(range(600, 608))}
    assert L(tk.component_device_slots) == {"swa": list(range(30, 38))}
    # The loaded nodes' new FULL slots, paired with the SWA slots the caller gave.
    assert tk.swa_pairs is not None and L(list(tk.swa_pairs)) == [
        list(range(20, 28)), list(range(30, 38))]
    assert comp(t, [0, 1, 2, 3], "swa") == ([20, 21, 22, 23], [600, 601, 602, 603])
    assert comp(t, list(range(8)), "swa") == ([24, 25, 26, 27], [604, 605, 606, 607])
    during = t.match_prefix(list(range(8)))
    assert (during.device_prefix_len, during.host_hit_length, during.pending_loads) == (
        0, 8, (tk.op_id,))
    t.commit_load_back(tk.op_id)
    t.sanity_check()
    m = t.match_prefix(list(range(8)))
    assert (L(m.device_indices), m.host_hit_length, m.last_device_node) == (
        list(range(20, 28)), 0, leaf)
    assert t.component_sizes("swa") == (8, 0)
    assert L(t.component_slots("swa")) == list(range(20, 28))
    assert t.component_slots_of(leaf, "swa") is node_at(t, list(range(8))).value
    # Host copies stay as duplicates (write-through keeps them unless asked); reclaiming them
    # frees the component copies too.
    assert t.evict_host(8).num_evicted == 0
    h = t.evict_host(8, reclaim_duplicates=True)
    t.sanity_check()
    assert (h.num_evicted, L(h.host_frees), L(h.component_host_frees)) == (  # leaf first
        8, [[504, 505, 506, 507], [500, 501, 502, 503]],
        {"swa": [[604, 605, 606, 607], [600, 601, 602, 603]]})
    assert (t.host_size, len(t.component_host_slots("swa"))) == (0, 0)


def test_swa_only_on_host_is_loaded_without_full_kv() -> None:
    t = swa_tree()
    r = t.insert(list(range(8)), np.arange(100, 108))
    commit_all(t, r.backups)
    e = t.evict(0, swa_num_tokens=8)  # internal and backed-up leaf: tombstoned, not deleted
    t.sanity_check()
    assert (e.num_evicted, e.swa_num_evicted, t.node_count) == (0, 8, 2)
    # The FULL slots whose SWA side goes; the FULL KV itself stays.
    assert (L(e.device_frees), L(e.component_frees)) == (
        [], {"swa": [[100, 101, 102, 103], [104, 105, 106, 107]]})
    assert L(t.device_slots()) == list(range(100, 108))
    assert comp(t, [0, 1, 2, 3], "swa") == (None, [600, 601, 602, 603])
    m = t.match_prefix(list(range(8)))
    leaf = node_at(t, list(range(8))).id
    # Device-only validators accept nothing; device-or-host ones accept the leaf.
    assert (m.device_prefix_len, m.best_node, m.host_hit_length, m.full_kv_hit_length) == (
        0, leaf, 8, 8)
    assert t.load_back_sizes(leaf) == {"full": 0, "swa": 8}
    with pytest.raises(InvalidInputError, match="needs 8 swa device slots, got 2"):
        t.start_load_back(leaf, [], {"swa": [1, 2]})
    with pytest.raises(InvalidInputError, match="needs 0 full device slots, got 1"):
        t.start_load_back(leaf, [9], {"swa": np.arange(40, 48)})
    t.sanity_check()
    tk = t.start_load_back(leaf, [], {"swa": np.arange(40, 48)})
    t.sanity_check()
    assert (L(tk.device_slots), L(tk.component_host_slots)) == ([], {"swa": list(range(600, 608))})
    # The nodes' own FULL slots, paired with the SWA slots the caller gave.
    assert tk.swa_pairs is not None and L(list(tk.swa_pairs)) == [
        list(range(100, 108)), list(range(40, 48))]
    assert comp(t, list(range(8)), "swa") == ([104, 105, 106, 107], [604, 605, 606, 607])
    # Abort: FULL stays on device, the SWA slots are the caller's again.
    assert t.abort_load_back(tk.op_id) == []
    t.sanity_check()
    assert comp(t, list(range(8)), "swa") == (None, [604, 605, 606, 607])
    assert comp(t, [0, 1, 2, 3], "swa") == (None, [600, 601, 602, 603])
    tk = t.start_load_back(leaf, [], {"swa": np.arange(40, 48)})
    t.commit_load_back(tk.op_id)
    t.sanity_check()
    m = t.match_prefix(list(range(8)))
    assert (m.device_prefix_len, m.host_hit_length) == (8, 0)
    assert comp(t, [0, 1, 2, 3], "swa") == ([100, 101, 102, 103], [600, 601, 602, 603])
    assert comp(t, list(range(8)), "swa") == ([104, 105, 106, 107], [604, 605, 606, 607])


def test_a_short_window_needs_only_the_tail_on_device() -> None:
    t = swa_tree()
    r = t.insert(list(range(8)), np.arange(100, 108))
    commit_all(t, r.backups)
    e = t.evict(0, swa_num_tokens=1)  # the LRU one: the internal node [0..3]
    t.sanity_check()
    assert (e.swa_num_evicted, L(e.component_frees)) == (4, {"swa": [[100, 101, 102, 103]]})
    assert (comp(t, [0, 1, 2, 3], "swa"), comp(t, list(range(8)), "swa")) == (
        (None, [600, 601, 602, 603]), ([104, 105, 106, 107], [604, 605, 606, 607]))
    m = t.match_prefix(list(range(8)))
    assert (m.device_prefix_len, m.host_hit_length) == (8, 0)
    assert (t.match_prefix([0, 1, 2]).device_prefix_len,
            t.match_prefix([0, 1, 2]).host_hit_length) == (0, 3)


def test_mamba_state_host_round_trip_loads_the_anchor_state_only() -> None:
    t = RadixTree(page_size=1, mamba=True, host_enabled=True, write_policy="write_through")
    r = t.insert([1, 2, 3, 4], [10, 11, 12, 13], mamba_value=7)
    assert [(L(b.device_slots), L(b.component_slots)) for b in r.backups] == [
        ([10, 11, 12, 13], {"mamba": [7]})]
    t.commit_backup(r.backups[0].op_id, [50, 51, 52, 53], {"mamba": [9]})
    r = t.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15], mamba_value=8)
    assert (r.prefix_len, L(r.device_frees), L(r.component_frees)) == (4, [], {"mamba": []})
    assert [(L(b.device_slots), L(b.component_slots)) for b in r.backups] == [
        ([14, 15], {"mamba": [8]})]
    t.commit_backup(r.backups[0].op_id, [54, 55], {"mamba": [19]})
    t.sanity_check()
    e = t.evict(6)
    t.sanity_check()
    assert (e.num_evicted, e.mamba_num_evicted, L(e.component_frees)) == (
        6, 2, {"mamba": [[8], [7]]})
    m = t.match_prefix([1, 2, 3, 4, 5, 6])
    leaf = node_at(t, [1, 2, 3, 4, 5, 6]).id
    assert (m.device_prefix_len, m.best_node, m.host_hit_length) == (0, leaf, 6)
    assert t.load_back_sizes(leaf) == {"full": 6, "mamba": 1}
    tk = t.start_load_back(leaf, [20, 21, 22, 23, 24, 25], {"mamba": [3]})
    t.sanity_check()
    assert (L(tk.host_slots), L(tk.component_host_slots), L(tk.component_device_slots)) == (
        [50, 51, 52, 53, 54, 55], {"mamba": [19]}, {"mamba": [3]})
    assert tk.swa_pairs is None
    t.commit_load_back(tk.op_id)
    t.sanity_check()
    m = t.match_prefix([1, 2, 3, 4, 5, 6], cow_mamba=True)
    assert (m.device_prefix_len, m.mamba_cow_slot) == (6, 3)
    # The inner node's state is still on host only: a match ending there is a host hit.
    inner = node_at(t, [1, 2, 3, 4]).id
    m = t.match_prefix([1, 2, 3, 4])
    assert (m.device_prefix_len, m.best_node, m.host_hit_length) == (0, inner, 4)
    assert t.load_back_sizes(inner) == {"full": 0, "mamba": 1}
    assert comp(t, [1, 2, 3, 4], "mamba") == (None, [9])


def test_write_back_copies_components_then_demotes_and_reinsert_adopts() -> None:
    t = RadixTree(page_size=2, sliding_window=2, mamba=True, host_enabled=True,
                  write_policy="write_back")
    t.insert([1, 2, 3, 4, 5, 6], np.arange(6), mamba_value=5)  # [1..4] -> [5, 6] (cap-split)
    e = t.evict(2)  # (more would take the parent [1..4] too: tests/tree/test_hybrid_write_back.py)
    t.sanity_check()
    assert (e.num_evicted, e.pending_tokens) == (0, 2)
    assert [(L(b.device_slots), L(b.component_slots), b.write_back) for b in e.backups] == [
        ([4, 5], {"swa": [4, 5], "mamba": [5]}, True)]
    t.commit_backup(e.backups[0].op_id, [200, 201], {"swa": [300, 301], "mamba": [400]})
    t.sanity_check()
    e = t.evict(2)
    t.sanity_check()
    assert (e.num_evicted, e.swa_num_evicted, L(e.device_frees), L(e.component_frees)) == (
        2, 2, [[4, 5]], {"swa": [[4, 5]], "mamba": [[5]]})
    assert comp(t, [1, 2, 3, 4, 5, 6], "swa") == (None, [300, 301])
    assert comp(t, [1, 2, 3, 4, 5, 6], "mamba") == (None, [400])
    # Re-inserting over the host-only node gives it the caller's FULL slots, and their SWA side
    # too (as the reference rebuilds an un-evicted node's SWA above the request's SWA floor,
    # here 0), though it is out of the new key's last window. The duplicates of [1..4] come
    # back in device_frees only (their SWA side goes with them).
    r = t.insert([1, 2, 3, 4, 5, 6, 7, 8], np.arange(40, 48), mamba_value=6)
    t.sanity_check()
    assert (r.prefix_len, r.cached_len, L(r.device_frees)) == (6, 8, [[40, 41, 42, 43]])
    assert L(r.component_frees) == {"swa": [], "mamba": []}
    assert r.swa_adopted == []
    assert comp(t, [1, 2, 3, 4, 5, 6], "swa") == ([44, 45], [300, 301])
    assert comp(t, [1, 2, 3, 4, 5, 6, 7, 8], "swa") == ([46, 47], None)
    assert comp(t, [1, 2, 3, 4, 5, 6, 7, 8], "mamba") == ([6], None)
    m = t.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert (L(m.device_indices), m.host_hit_length) == ([0, 1, 2, 3, 44, 45, 46, 47], 0)


def test_reinsert_recovers_in_window_swa_tombstones_with_exact_pool_accounting() -> None:
    """A real SWASlotMap applies the results: the SWA frees and adoptions name FULL slots, and
    afterwards the SWA-live nodes' FULL slots, and only they, have an SWA side."""
    t = swa_tree()
    smap = SWASlotMap(PageAllocator(256, 1), PageAllocator(64, 1))
    smap.full.alloc(100)  # FULL slots other requests hold: FULL and SWA numbers differ

    def check() -> None:
        t.sanity_check()
        smap.check()
        live = t.component_slots("swa")
        assert smap.swa.used_size == len(live) == int((smap.full_to_swa >= 0).sum())
        assert sorted(smap.translate(live).tolist()) == sorted(
            np.flatnonzero(smap.swa_to_full >= 0).tolist())
        assert smap.full.used_size == 100 + len(t.device_slots())

    a = smap.alloc(8)
    assert a is not None and (L(a), L(smap.translate(a))) == (list(range(100, 108)), list(range(8)))
    r = t.insert(list(range(8)), a)
    commit_all(t, r.backups)
    e = t.evict(0, swa_num_tokens=8)  # both nodes SWA tombstones
    assert (L(e.device_frees), L(e.component_frees)) == (
        [], {"swa": [[100, 101, 102, 103], [104, 105, 106, 107]]})
    smap.apply_tree_frees(e.device_frees, e.component_frees["swa"])
    e = t.evict(4)  # the leaf [4..7] is demoted to host only
    assert (L(e.device_frees), L(e.component_frees)) == ([[104, 105, 106, 107]], {"swa": []})
    smap.apply_tree_frees(e.device_frees, e.component_frees["swa"])
    check()
    # Window 4 over 10 tokens: SWA tombstones are recovered from position 6 on. [0..3] is
    # cached on device (a duplicate, out of the window): its FULL slots come back in
    # device_frees AND their SWA side in the SWA frees. The host-only [4..7] takes the caller's
    # FULL slots and, as the reference rebuilds an un-evicted node's SWA above the request's
    # SWA floor (0 here), their SWA side for the whole node (nothing to adopt: its own slots).
    b = smap.alloc(10)
    assert b is not None and L(b) == [104, 105, 106, 107, *range(108, 114)]
    r = t.insert(list(range(10)), b)
    assert [L(x.device_slots) for x in r.backups] == [[112, 113]]  # the new leaf
    for x in r.backups:
        t.abort_backup(x.op_id)
    assert (r.prefix_len, r.cached_len, L(r.device_frees)) == (8, 10, [[104, 105, 106, 107]])
    assert L(r.component_frees) == {"swa": [[104, 105, 106, 107]]}
    assert r.swa_adopted == []
    smap.apply_tree_frees(r.device_frees, r.component_frees["swa"], r.swa_adopted)
    check()
    assert [comp(t, k, "swa") for k in ([0, 1, 2, 3], list(range(8)))] == [
        (None, [600, 601, 602, 603]), ([108, 109, 110, 111], [604, 605, 606, 607])]
    # Over 6 tokens SWA is recovered from position 2: [0, 1] stay a tombstone (SWA side of the
    # caller's duplicates given up); [2, 3] adopt the SWA side of the caller's duplicate FULL
    # slots; [4, 5] (split off the SWA-live [4..7]) keep their own.
    c = smap.alloc(6)
    assert c is not None and L(c) == [104, 105, 106, 107, 114, 115]
    sides = smap.translate(c)
    r = t.insert(list(range(6)), c)
    assert (r.prefix_len, r.cached_len, L(r.device_frees), L(r.component_frees)) == (
        6, 6, [[104, 105, 106, 107, 114, 115]], {"swa": [[104, 105]]})
    assert [(L(n), L(caller)) for n, caller in r.swa_adopted] == [([102, 103], [106, 107])]
    smap.apply_tree_frees(r.device_frees, r.component_frees["swa"], r.swa_adopted)
    check()
    assert [comp(t, k, "swa") for k in ([0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5])] == [
        (None, [600, 601]), ([102, 103], [602, 603]), ([108, 109], [604, 605])]
    assert L(smap.translate([102, 103])) == L(sides[2:4])
    assert t.match_prefix(list(range(6))).device_prefix_len == 6


def test_split_during_a_backup_slices_the_component_copies() -> None:
    t = RadixTree(page_size=1, sliding_window=8, mamba=True, host_enabled=True,
                  write_policy="write_through")
    r = t.insert(list(range(8)), np.arange(100, 108), mamba_value=3)
    (b,) = r.backups
    assert L(b.component_slots) == {"swa": list(range(100, 108)), "mamba": [3]}
    t.match_prefix([0, 1, 2])  # splits the in-flight node
    t.sanity_check()
    ids = t.commit_backup(b.op_id, np.arange(500, 508),
                          {"swa": np.arange(600, 608), "mamba": [700]})
    t.sanity_check()
    assert len(ids) == 2
    assert comp(t, [0, 1, 2], "swa") == ([100, 101, 102], [600, 601, 602])
    assert comp(t, list(range(8)), "swa") == ([103, 104, 105, 106, 107], [603, 604, 605, 606, 607])
    for tokens in ([0, 1, 2], list(range(8))):  # the SWA entry is the FULL array itself
        n = node_at(t, tokens)
        assert t.component_slots_of(n.id, "swa") is n.value
    assert comp(t, [0, 1, 2], "mamba") == (None, None)
    assert comp(t, list(range(8)), "mamba") == ([3], [700])


def test_commit_checks_component_host_slots_and_changes_nothing_on_error() -> None:
    t = swa_tree()
    (b,) = t.insert([1, 2], [5, 6]).backups
    assert (L(b.device_slots), L(b.component_slots)) == ([5, 6], {"swa": [5, 6]})
    with pytest.raises(InvalidInputError, match=r"components \['swa'\], got \[\]"):
        t.commit_backup(b.op_id, [7, 8])
    with pytest.raises(InvalidInputError, match="needs 2 swa host slots, got 1"):
        t.commit_backup(b.op_id, [7, 8], {"swa": [9]})
    t.sanity_check()
    assert t.pending_ops == 1
    t.abort_backup(b.op_id)
    t.sanity_check()
    assert (t.pending_ops, t.host_size) == (0, 0)
    full = RadixTree(host_enabled=True, write_policy="write_through")
    (fb,) = full.insert([1], [1]).backups
    with pytest.raises(InvalidInputError, match="FULL-only"):
        full.commit_backup(fb.op_id, [3], {"swa": [4]})


def test_insert_stops_before_a_loading_node_and_returns_the_state() -> None:
    t = RadixTree(page_size=1, mamba=True, host_enabled=True, write_policy="write_through")
    r = t.insert([1, 2, 3, 4], [1, 2, 3, 4], mamba_value=7)
    t.commit_backup(r.backups[0].op_id, [11, 12, 13, 14], {"mamba": [17]})
    t.evict(4)
    node = node_at(t, [1, 2, 3, 4]).id
    tk = t.start_load_back(node, [21, 22, 23, 24], {"mamba": [27]})
    r = t.insert([1, 2, 3, 4, 5, 6], [31, 32, 33, 34, 35, 36], mamba_value=8)
    t.sanity_check()
    assert (r.prefix_len, r.cached_len, r.last_node, L(r.device_frees)) == (0, 0, 0, [])
    assert L(r.component_frees) == {"mamba": [[8]]}
    t.commit_load_back(tk.op_id)
    t.sanity_check()


def test_selective_eviction_deletes_unbacked_leaves_with_host_children() -> None:
    t = RadixTree(page_size=1, sliding_window=2, host_enabled=True)  # selective: threshold 2
    t.insert([1, 2], [11, 12])
    r = t.insert([1, 2], [11, 12])  # second hit: back up [1, 2]
    assert [(L(b.device_slots), L(b.component_slots)) for b in r.backups] == [
        ([11, 12], {"swa": [11, 12]})]
    commit_all(t, r.backups)
    t.insert([1, 2, 3, 4], [11, 12, 13, 14])
    r = t.insert([1, 2, 3, 4], [11, 12, 13, 14])
    assert [(L(b.device_slots), L(b.component_slots)) for b in r.backups] == [
        ([13, 14], {"swa": [13, 14]})]
    commit_all(t, r.backups, host=520, chost=620)
    t.insert([1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16])
    e = t.evict(2)  # the un-backed leaf [5, 6]: deleted, its FULL slots in both lists
    t.sanity_check()
    assert (L(e.device_frees), L(e.component_frees), L(e.component_host_frees)) == (
        [[15, 16]], {"swa": [[15, 16]]}, {"swa": []})
    assert (e.num_evicted, e.swa_num_evicted) == (2, 2)
    e = t.evict(2)  # [3, 4] is backed up: demoted
    t.sanity_check()
    assert (L(e.device_frees), L(e.component_frees)) == ([[13, 14]], {"swa": [[13, 14]]})
    # [1, 2] now is a device leaf above a host-only child; it is backed up too: demoted.
    e = t.evict(2)
    t.sanity_check()
    assert (L(e.device_frees), L(e.component_frees), t.node_count, t.host_size) == (
        [[11, 12]], {"swa": [[11, 12]]}, 2, 4)
    h = t.evict_host(4)
    t.sanity_check()
    assert (L(h.host_frees), L(h.component_host_frees)) == (
        [[520, 521], [500, 501]], {"swa": [[620, 621], [600, 601]]})
    assert t.node_count == 0


def test_drop_deletes_a_hybrid_leaf_with_its_host_subtree() -> None:
    t = RadixTree(page_size=1, sliding_window=2, host_enabled=True, write_policy="write_back")
    t.insert([1, 2, 3, 4], [11, 12, 13, 14])
    e = t.evict(2)
    assert [(L(b.device_slots), L(b.component_slots)) for b in e.backups] == [
        ([13, 14], {"swa": [13, 14]})]
    t.commit_backup(e.backups[0].op_id, [40, 41], {"swa": [50, 51]})
    e = t.evict(2)  # demotes [3, 4]; [1, 2] is an un-backed device leaf above it
    assert (L(e.device_frees), L(e.component_frees)) == ([[13, 14]], {"swa": [[13, 14]]})
    top = node_at(t, [1, 2]).id
    e = t.drop(top)
    t.sanity_check()
    assert (L(e.device_frees), L(e.host_frees), L(e.component_frees),
            L(e.component_host_frees), e.dropped_host_tokens) == (
        [[11, 12]], [[40, 41]], {"swa": [[11, 12]]}, {"swa": [[50, 51]]}, 2)
    assert t.node_count == 0


# ---------------------------------------------------------------- host inserts (prefetch)
def test_insert_host_records_fetched_pages_window_and_state() -> None:
    t = RadixTree(page_size=2, sliding_window=4, mamba=True, host_enabled=True)
    key = list(range(12))
    r = t.insert_host(key, 0, np.arange(500, 512), swa_host_slots=[-1] * 8 + [600, 601, 602, 603],
                      mamba_host_slot=9)
    t.sanity_check()
    assert (r.prefix_len, r.cached_len, L(r.device_frees), L(r.component_frees)) == (
        0, 12, [], {"swa": [], "mamba": []})
    assert comp(t, list(range(8)), "swa") == (None, None)
    assert comp(t, key, "swa") == (None, [600, 601, 602, 603])
    assert comp(t, key, "mamba") == (None, [9])
    assert r.last_node == node_at(t, key).id
    m = t.match_prefix(key)
    assert (m.device_prefix_len, m.best_node, m.host_hit_length) == (0, r.last_node, 12)
    assert t.load_back_sizes(r.last_node) == {"full": 12, "swa": 4, "mamba": 1}
    tk = t.start_load_back(r.last_node, np.arange(12), {"swa": [40, 41, 42, 43], "mamba": [2]})
    # Only the last window's SWA is loaded: its nodes' new FULL slots pair with the SWA slots.
    assert tk.swa_pairs is not None and L(list(tk.swa_pairs)) == [[8, 9, 10, 11], [40, 41, 42, 43]]
    t.commit_load_back(tk.op_id)
    t.sanity_check()
    assert t.match_prefix(key).device_prefix_len == 12
    assert comp(t, list(range(8)), "swa") == (None, None)
    assert comp(t, key, "swa") == ([8, 9, 10, 11], [600, 601, 602, 603])
    assert comp(t, key, "mamba") == ([2], [9])
    # The same pages again: every slot is a duplicate.
    again = t.insert_host(key, 0, np.arange(700, 712), swa_host_slots=[-1] * 8 + [1, 2, 3, 4],
                          mamba_host_slot=5)
    t.sanity_check()
    assert (L(again.device_frees), L(again.component_frees)) == (
        [list(range(700, 708)), list(range(708, 712))], {"swa": [[1, 2, 3, 4]], "mamba": [[5]]})


def test_insert_host_backs_up_device_nodes_and_extends_them() -> None:
    t = RadixTree(page_size=2, sliding_window=4, mamba=True, host_enabled=True)
    t.insert([0, 1, 2, 3], [10, 11, 12, 13], mamba_value=1)
    r = t.insert_host(list(range(8)), 0, np.arange(500, 508),
                      swa_host_slots=np.arange(600, 608), mamba_host_slot=9)
    t.sanity_check()
    assert (r.prefix_len, L(r.device_frees), L(r.component_frees)) == (
        4, [], {"swa": [], "mamba": []})
    assert comp(t, [0, 1, 2, 3], "swa") == ([10, 11, 12, 13], [600, 601, 602, 603])
    assert comp(t, [0, 1, 2, 3], "mamba") == ([1], None)
    assert comp(t, list(range(8)), "swa") == (None, [604, 605, 606, 607])
    assert comp(t, list(range(8)), "mamba") == (None, [9])
    assert t.host_size == 8
    with pytest.raises(InvalidInputError, match="page-aligned suffix"):
        t.insert_host(list(range(10)), 8, [1, 2], swa_host_slots=[3, -1])
    with pytest.raises(InvalidInputError, match="component host slots given"):
        RadixTree(host_enabled=True).insert_host([1], 0, [1], mamba_host_slot=2)
