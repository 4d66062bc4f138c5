"""Storage intents (buffer-only host mode): the tree names nodes reaching the write threshold
instead of backing them up, pins nothing for them, and resolves a (node, length) span across
splits (behavior.md 1.11, 1.17)."""

from __future__ import annotations

import numpy as np
import pytest

from asynccache.errors import ConfigError
from asynccache.tree import RadixTree


def _tree(policy: str, ps: int = 4) -> RadixTree:
    t = RadixTree(page_size=ps, write_policy=policy)
    t.set_storage_intents(True)
    return t


def test_write_through_names_a_new_leaf_at_its_first_insert() -> None:
    t = _tree("write_through")
    res = t.insert(list(range(1, 9)), np.arange(8))
    assert res.intents == [res.last_node] and res.backups == []
    assert t.pending_ops == 0 and t.held_locks == 0
    assert t.lock_ref(res.last_node) == (0, 0)  # nothing pinned: still evictable
    assert t.evictable_size == 8


def test_selective_names_a_node_at_its_second_hit_root_first() -> None:
    t = _tree("write_through_selective")
    a = list(range(1, 9))
    assert t.insert(a, np.arange(8)).intents == []
    b = [*a[:4], 50, 51, 52, 53]
    rb = t.insert(b, np.arange(8, 16), prev_prefix_len=0)  # splits a after one page
    prefix = t.match_prefix(a[:4]).last_device_node
    assert rb.intents == [prefix]  # the shared page was hit twice; b's own page once
    ra = t.insert(a, np.arange(8), prev_prefix_len=8)
    assert ra.intents == [prefix, ra.last_node]


def test_intents_off_by_default_and_refused_with_a_host_tier() -> None:
    t = RadixTree(page_size=4, write_policy="write_through")
    assert t.insert(list(range(8)), np.arange(8)).intents == []
    with pytest.raises(ConfigError, match="without a host tier"):
        RadixTree(page_size=4, host_enabled=True).set_storage_intents(True)


def test_tail_slots_follow_splits_and_end_at_eviction() -> None:
    t = _tree("write_through")
    a = list(range(1, 13))
    ra = t.insert(a, np.arange(100, 112))
    node = ra.last_node
    assert t.tail_slots(node, 12).tolist() == list(range(100, 112))
    t.insert([*a[:4], 70, 71, 72, 73], np.arange(200, 208))  # node keeps its id and its end
    assert t.match_prefix(a[:4]).last_device_node != node
    assert t.tail_slots(node, 12).tolist() == list(range(100, 112))
    assert t.tail_slots(node, 8).tolist() == list(range(104, 112))
    assert t.tail_slots(node, 16) is None  # longer than the path
    assert t.tail_slots(12345, 4) is None
    res = t.evict(10**6)
    assert res.num_evicted == 16
    assert t.tail_slots(node, 12) is None




def test_hybrid_insert_names_every_new_node_root_first() -> None:
    t = RadixTree(page_size=4, write_policy="write_through", sliding_window=8)
    t.set_storage_intents(True)
    toks = list(range(1, 25))
    res = t.insert(toks, np.arange(24))
    # The cap-split leaves a 16-token node and a leaf of one window (8 tokens).
    assert len(res.intents) == 2 and res.intents[-1] == res.last_node
    assert [len(t.node_key(n)) for n in res.intents] == [16, 24]
    assert t.held_locks == 0 and t.pending_ops == 0
    assert (res.component_frees, res.device_frees) == ({"swa": []}, [])
    t.sanity_check()
    # Below an SWA floor the tombstone part is a node of its own: three new nodes.
    other = list(range(100, 124))
    res = t.insert(other, np.arange(24, 48), component_evicted_seqlens={"swa": 8})
    assert [len(t.node_key(n)) for n in res.intents] == [8, 16, 24]
    # The tombstone from birth is named too; the SWA-live ones name their FULL slots.
    swa = [t.component_slots_of(n, "swa") for n in res.intents]
    assert swa[0] is None
    assert [s.tolist() for s in swa[1:]] == [list(range(32, 40)), list(range(40, 48))]
    assert res.component_frees == {"swa": []}  # the floor is page-aligned: nothing given up
    t.sanity_check()


def test_hybrid_selective_names_a_node_at_its_second_hit() -> None:
    t = RadixTree(page_size=4, write_policy="write_through_selective", sliding_window=8)
    t.set_storage_intents(True)
    toks = list(range(1, 25))
    first = t.insert(toks, np.arange(24))
    assert first.intents == []
    again = t.insert(toks, np.arange(24), prev_prefix_len=24)
    assert [len(t.node_key(n)) for n in again.intents] == [16, 24]
    assert again.intents[-1] == first.last_node
    assert (again.device_frees, again.component_frees) == ([], {"swa": []})
    t.sanity_check()
