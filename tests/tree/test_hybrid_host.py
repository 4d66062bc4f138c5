"""The host (L2) tier of hybrid trees: component host copies, demotion, load-back, host
eviction (behavior.md §1.2-1.7, §1.3 step 2: device-or-host vs device-only validators)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from asynccache.errors import InvalidInputError
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
    r = t.insert(list(range(8)), np.arange(8), swa_value=np.arange(100, 108))
    t.sanity_check()
    # Cap-split into [0..3] and [4..7]; write-through backs both up, root first, SWA included.
    assert [(b.device_slots.tolist(), L(b.component_slots)) for b in r.backups] == [
        ([0, 1, 2, 3], {"swa": [100, 101, 102, 103]}),
        ([4, 5, 6, 7], {"swa": [104, 105, 106, 107]}),
    ]
    commit_all(t, r.backups)
    assert t.host_size == 8
    assert L(t.component_host_slots("swa")) == list(range(600, 608))
    e = t.evict(8)
    t.sanity_check()
    assert (e.num_evicted, e.swa_num_evicted) == (8, 8)
    assert L(e.device_frees) == [[4, 5, 6, 7], [0, 1, 2, 3]]
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
    assert tk.swa_pairs is not None and L(list(tk.swa_pairs)) == [
        list(range(20, 28)), list(range(30, 38))]
    during = t.match_prefix(list(range(8)))
    assert (during.device_prefix_len, during.host_hit_length, during.pending_loads) == (
        0, 8, (tk.op_id,))
    t.commit_load_back(tk.op_id)
    t.sanity_check()
    m = t.match_prefix(list(range(8)))
    assert (L(m.device_indices), m.host_hit_length, m.last_device_node) == (
        list(range(20, 28)), 0, leaf)
    assert t.component_sizes("swa") == (8, 0)
    # Host copies stay as duplicates; reclaiming them frees the component copies too.
    h = t.evict_host(8)
    t.sanity_check()
    assert (h.num_evicted, L(h.host_frees), L(h.component_host_frees)) == (
        8, [[500, 501, 502, 503], [504, 505, 506, 507]],
        {"swa": [[600, 601, 602, 603], [604, 605, 606, 607]]})
    assert (t.host_size, len(t.component_host_slots("swa"))) == (0, 0)


def test_swa_only_on_host_is_loaded_without_full_kv() -> None:
    t = swa_tree()
    r = t.insert(list(range(8)), np.arange(8), swa_value=np.arange(100, 108))
    commit_all(t, r.backups)
    e = t.evict(0, swa_num_tokens=8)  # internal and backed-up leaf: tombstoned, not deleted
    t.sanity_check()
    assert (e.num_evicted, e.swa_num_evicted, t.node_count) == (0, 8, 2)
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
    assert tk.swa_pairs is not None and L(list(tk.swa_pairs)) == [
        list(range(8)), list(range(40, 48))]
    # Abort: FULL stays on device, the SWA slots are the caller's again.
    assert t.abort_load_back(tk.op_id) == []
    t.sanity_check()
    assert comp(t, list(range(8)), "swa") == (None, [604, 605, 606, 607])
    tk = t.start_load_back(leaf, [], {"swa": np.arange(40, 48)})
    t.commit_load_back(tk.op_id)
    t.sanity_check()
    m = t.match_prefix(list(range(8)))
    assert (m.device_prefix_len, m.host_hit_length) == (8, 0)
    assert comp(t, [0, 1, 2, 3], "swa") == ([40, 41, 42, 43], [600, 601, 602, 603])


def test_a_short_window_needs_only_the_tail_on_device() -> None:
    t = swa_tree()
    r = t.insert(list(range(8)), np.arange(8), swa_value=np.arange(100, 108))
    commit_all(t, r.backups)
    e = t.evict(0, swa_num_tokens=1)  # the LRU one: the internal node [0..3]
    t.sanity_check()
    assert L(e.component_frees) == {"swa": [[100, 101, 102, 103]]}
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
    t.insert([1, 2, 3, 4, 5, 6], np.arange(6), swa_value=np.arange(100, 106), mamba_value=5)
    e = t.evict(6)
    t.sanity_check()
    assert (e.num_evicted, e.pending_tokens) == (0, 2)
    assert [(L(b.device_slots), L(b.component_slots), b.write_back) for b in e.backups] == [
        ([4, 5], {"swa": [104, 105], "mamba": [5]}, True)]
    t.commit_backup(e.backups[0].op_id, [200, 201], {"swa": [300, 301], "mamba": [400]})
    t.sanity_check()
    e = t.evict(2)
    t.sanity_check()
    assert (e.num_evicted, L(e.device_frees), L(e.component_frees)) == (
        2, [[4, 5]], {"swa": [[104, 105]], "mamba": [[5]]})
    assert comp(t, [1, 2, 3, 4, 5, 6], "swa") == (None, [300, 301])
    assert comp(t, [1, 2, 3, 4, 5, 6], "mamba") == (None, [400])
    # Re-inserting over the host-only node gives it the caller's FULL slots; its SWA is out
    # of the new key's window, so the caller's SWA slots there are freed.
    r = t.insert([1, 2, 3, 4, 5, 6, 7, 8], np.arange(40, 48), swa_value=np.arange(140, 148),
                 mamba_value=6)
    t.sanity_check()
    assert (r.prefix_len, r.cached_len, L(r.device_frees)) == (6, 8, [[40, 41, 42, 43]])
    assert L(r.component_frees) == {"swa": [[140, 141, 142, 143], [144, 145]], "mamba": []}
    assert comp(t, [1, 2, 3, 4, 5, 6], "swa") == (None, [300, 301])
    m = t.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert (L(m.device_indices), m.host_hit_length) == ([0, 1, 2, 3, 44, 45, 46, 47], 0)


def test_split_during_a_backup_slices_the_component_copies() -> None:
    t = RadixTree(page_size=1, sliding_window=8, mamba=True, host_enabled=True,
                  write_policy="write_through")
    r = t.insert(list(range(8)), np.arange(8), swa_value=np.arange(100, 108), mamba_value=3)
    (b,) = r.backups
    t.match_prefix([0, 1, 2])  # splits the in-flight node
    t.sanity_check()
    ids = t.commit_backup(b.op_id, np.arange(500, 508),
                          {"swa": np.arange(600, 608), "mamba": [700]})
    t.sanity_check()
    assert len(ids) == 2
    assert comp(t, [0, 1, 2], "swa") == ([100, 101, 102], [600, 601, 602])
    assert comp(t, list(range(8)), "swa") == ([103, 104, 105, 106, 107], [603, 604, 605, 606, 607])
    assert comp(t, [0, 1, 2], "mamba") == (None, None)
    assert comp(t, list(range(8)), "mamba") == ([3], [700])


def test_commit_checks_component_host_slots_and_changes_nothing_on_error() -> None:
    t = swa_tree()
    (b,) = t.insert([1, 2], [1, 2], swa_value=[5, 6]).backups
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
    t.insert([1, 2], [1, 2], swa_value=[11, 12])
    r = t.insert([1, 2], [1, 2], swa_value=[11, 12])  # second hit: back up [1, 2]
    commit_all(t, r.backups)
    t.insert([1, 2, 3, 4], [1, 2, 3, 4], swa_value=[11, 12, 13, 14])
    r = t.insert([1, 2, 3, 4], [1, 2, 3, 4], swa_value=[11, 12, 13, 14])
    commit_all(t, r.backups, host=520, chost=620)
    t.insert([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], swa_value=[11, 12, 13, 14, 15, 16])
    e = t.evict(2)  # the un-backed leaf [5, 6]: deleted
    t.sanity_check()
    assert (L(e.device_frees), L(e.component_frees), L(e.component_host_frees)) == (
        [[5, 6]], {"swa": [[15, 16]]}, {"swa": []})
    e = t.evict(2)  # [3, 4] is backed up: demoted
    t.sanity_check()
    assert (L(e.device_frees), L(e.component_frees)) == ([[3, 4]], {"swa": [[13, 14]]})
    # [1, 2] now is a device leaf above a host-only child; it is backed up too: demoted.
    e = t.evict(2)
    t.sanity_check()
    assert (L(e.device_frees), t.node_count, t.host_size) == ([[1, 2]], 2, 4)
    h = t.evict_host(4)
    t.sanity_check()
    assert (L(h.host_frees), L(h.component_host_frees)) == (
        [[520, 521], [500, 501]], {"swa": [[620, 621], [600, 601]]})
    assert t.node_count == 0


def test_drop_deletes_a_hybrid_leaf_with_its_host_subtree() -> None:
    t = RadixTree(page_size=1, sliding_window=2, host_enabled=True, write_policy="write_back")
    t.insert([1, 2, 3, 4], [1, 2, 3, 4], swa_value=[11, 12, 13, 14])
    e = t.evict(2)
    t.commit_backup(e.backups[0].op_id, [40, 41], {"swa": [50, 51]})
    t.evict(2)  # demotes [3, 4]; [1, 2] is an un-backed device leaf above it
    top = node_at(t, [1, 2]).id
    e = t.drop(top)
    t.sanity_check()
    assert (L(e.device_frees), L(e.host_frees), L(e.component_frees),
            L(e.component_host_frees), e.dropped_host_tokens) == (
        [[1, 2]], [[40, 41]], {"swa": [[11, 12]]}, {"swa": [[50, 51]]}, 2)
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
    t.commit_load_back(tk.op_id)
    t.sanity_check()
    assert t.match_prefix(key).device_prefix_len == 12
    # The same pages again: every slot is a duplicate.
    again = t.insert_host(key, 0, np.arange(700, 712), swa_host_slots=[-1] * 8 + [1, 2, 3, 4],
                          mamba_host_slot=5)
    t.sanity_check()
    assert (L(again.device_frees), L(again.component_frees)) == (
        [list(range(700, 708)), list(range(708, 712))], {"swa": [[1, 2, 3, 4]], "mamba": [[5]]})


def test_insert_host_backs_up_device_nodes_and_extends_them() -> None:
    t = RadixTree(page_size=2, sliding_window=4, mamba=True, host_enabled=True)
    t.insert([0, 1, 2, 3], [0, 1, 2, 3], swa_value=[10, 11, 12, 13], mamba_value=1)
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
