"""Exact cases where the tree must pick the reference's victims (behavior.md 1.3, 1.5, 1.17):
a split refreshes the suffix's access time, host duplicates are reclaimed only under write-back
(the host copy stays prefix-closed), and write-back counts no hits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from asynccache.tree import RadixTree

# Trees whose walks split: FULL-only device, FULL-only with a host tier, and hybrids with and
# without a host tier (a window far above the keys, so SWA never tombstones here).
TREES: dict[str, dict[str, Any]] = {
    "full": {},
    "full-host": {"host_enabled": True, "write_policy": "write_through_selective"},
    "swa": {"sliding_window": 4096},
    "swa-host": {"sliding_window": 4096, "host_enabled": True,
                 "write_policy": "write_through_selective"},
}
ACCESS_POLICIES = ("lru", "lfu", "priority", "lru_credit")


def _key(tokens: list[int], ps: int) -> list[int]:
    """Each token of ``tokens`` as one page (page size ``ps``)."""
    return [t for t in tokens for _ in range(ps)]


def _insert(tree: RadixTree, key: list[int], alloc) -> np.ndarray:
    slots = alloc.take(len(key))
    res = tree.insert(key, slots)
    for b in res.backups:  # host trees may back up hot nodes: drop those copies
        tree.abort_backup(b.op_id)
    assert res.device_frees == [] or res.prefix_len > 0
    tree.sanity_check()
    return slots


@pytest.mark.parametrize("ps", (1, 16))
@pytest.mark.parametrize("policy", ACCESS_POLICIES)
@pytest.mark.parametrize("kind", sorted(TREES))
def test_match_split_refreshes_the_suffix(kind: str, policy: str, ps: int, alloc) -> None:
    """insert [1,2,3,4]; insert [9]; match [1,2] (splits); evict one page: [9] goes, not
    [3,4], whose access time the split refreshed."""
    tree = RadixTree(page_size=ps, eviction_policy=policy, **TREES[kind])
    _insert(tree, _key([1, 2, 3, 4], ps), alloc)
    nine = _insert(tree, _key([9], ps), alloc)
    assert tree.match_prefix(_key([1, 2], ps)).device_prefix_len == 2 * ps
    tree.sanity_check()
    res = tree.evict(1)
    assert res.num_evicted == ps
    assert [f.tolist() for f in res.device_frees] == [nine.tolist()]
    tree.sanity_check()
    assert tree.match_prefix(_key([1, 2, 3, 4], ps)).device_prefix_len == 4 * ps


@pytest.mark.parametrize("ps", (1, 16))
@pytest.mark.parametrize("policy", ACCESS_POLICIES)
@pytest.mark.parametrize("kind", sorted(TREES))
def test_insert_split_refreshes_the_suffix(kind: str, policy: str, ps: int, alloc) -> None:
    """insert [1,2,3,4]; insert [9]; insert [1,2,7] (splits [1,2,3,4]); evict one page: [9]
    goes first, then [3,4] (refreshed by the split), then [7]."""
    tree = RadixTree(page_size=ps, eviction_policy=policy, **TREES[kind])
    first = _insert(tree, _key([1, 2, 3, 4], ps), alloc)
    nine = _insert(tree, _key([9], ps), alloc)
    seven = _insert(tree, _key([1, 2, 7], ps), alloc)
    victims = []
    for _ in range(3):
        res = tree.evict(1)
        tree.sanity_check()
        victims.append(np.concatenate(res.device_frees).tolist())
    if policy == "lfu":  # [1,2]'s second insert counted a hit on the prefix only
        assert victims[0] == nine.tolist()
    else:
        assert victims == [nine.tolist(), first[2 * ps :].tolist(), seven[2 * ps :].tolist()]


@pytest.mark.parametrize("ps", (1, 16))
def test_mru_split_keeps_the_suffix_newest(ps: int, alloc) -> None:
    """MRU evicts the newest leaf: after the match's split that is the refreshed suffix."""
    tree = RadixTree(page_size=ps, eviction_policy="mru")
    first = _insert(tree, _key([1, 2, 3, 4], ps), alloc)
    _insert(tree, _key([9], ps), alloc)
    tree.match_prefix(_key([1, 2], ps))
    res = tree.evict(1)
    assert np.concatenate(res.device_frees).tolist() == first[2 * ps :].tolist()
    tree.sanity_check()


# ---------------------------------------------------------------- host duplicates
def _backed_up_pair(tree: RadixTree, ps: int, alloc) -> None:
    """insert [1,2] then [1,2,3,4] (pages), committing every backup the inserts ask for."""
    for key in (_key([1, 2], ps), _key([1, 2, 3, 4], ps)):
        for b in tree.insert(key, alloc.take(len(key))).backups:
            tree.commit_backup(b.op_id, alloc.take(b.num_tokens))
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 2, 16))
@pytest.mark.parametrize(("policy", "host_hit"), [("write_through", 4), ("write_through_selective", 2)])
def test_write_through_keeps_host_duplicates(policy: str, host_hit: int, ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy=policy)
    _backed_up_pair(tree, ps, alloc)
    before = tree.host_size
    assert before == host_hit * ps
    assert tree.evict_host(2 * ps).num_evicted == 0
    assert tree.host_size == before
    tree.evict(100 * ps)
    tree.sanity_check()
    m = tree.match_prefix(_key([1, 2, 3, 4], ps))
    assert (m.device_prefix_len, m.host_hit_length) == (0, host_hit * ps)


@pytest.mark.parametrize("ps", (1, 16))
def test_explicit_duplicate_reclaim_keeps_prefix_closure(ps: int, alloc) -> None:
    """reclaim_duplicates=True under write-through takes only duplicates with no host-copied
    child: [3,4]'s copy goes before its older parent's."""
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through")
    _backed_up_pair(tree, ps, alloc)
    res = tree.evict_host(1, reclaim_duplicates=True)
    assert res.num_evicted == 2 * ps
    tree.sanity_check()
    tree.evict(100 * ps)  # [3,4] is not backed up any more: deleted; [1,2] demoted
    m = tree.match_prefix(_key([1, 2, 3, 4], ps))
    assert (m.device_prefix_len, m.host_hit_length) == (0, 2 * ps)
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 16))
def test_explicit_duplicate_reclaim_takes_the_parent_after_its_children(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through")
    _backed_up_pair(tree, ps, alloc)
    assert tree.evict_host(4 * ps, reclaim_duplicates=True).num_evicted == 4 * ps
    assert tree.host_size == 0
    tree.sanity_check()
    m = tree.match_prefix(_key([1, 2, 3, 4], ps))
    assert (m.device_prefix_len, m.host_hit_length) == (4 * ps, 0)


# ---------------------------------------------------------------- hit counting
@pytest.mark.parametrize("ps", (1, 2, 16))
def test_write_back_counts_no_hits(ps: int, alloc) -> None:
    """LFU under write-back: insert [1,2] twice, insert [3,4], evict: [1,2] is the oldest and
    (with no hits counted) the first victim."""
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_back",
                     eviction_policy="lfu")
    a = alloc.take(2 * ps)
    tree.insert(_key([1, 2], ps), a)
    tree.insert(_key([1, 2], ps), alloc.take(2 * ps))
    tree.insert(_key([3, 4], ps), alloc.take(2 * ps))
    res = tree.evict(2 * ps)
    assert [b.device_slots.tolist() for b in res.backups] == [a.tolist()]
    tree.sanity_check()


@pytest.mark.parametrize("policy", ("write_through", "write_through_selective"))
def test_write_through_counts_hits(policy: str, alloc) -> None:
    """The same case under write-through: [1,2] has two hits, so [3,4] goes first."""
    tree = RadixTree(page_size=1, host_enabled=True, write_policy=policy, eviction_policy="lfu")
    for key in ([1, 2], [1, 2], [3, 4]):
        for b in tree.insert(key, alloc.take(2)).backups:
            tree.abort_backup(b.op_id)
    res = tree.evict(2)
    assert [f.tolist() for f in res.device_frees] == [[1004, 1005]]


@pytest.mark.parametrize("ps", (1, 16))
@pytest.mark.parametrize("policy", ACCESS_POLICIES)
@pytest.mark.parametrize("window", (0, 4096))
def test_insert_refiles_host_duplicates_it_walks(window: int, policy: str, ps: int,
                                                 alloc) -> None:
    """Write-through, duplicates reclaimed on request (in policy order): [1] and [2] are backed
    up at their inserts; inserting [1] again stamps it (and counts a hit), so [2]'s host copy
    goes first. (Hybrid trees re-filed walked nodes only in the device-leaf queue, so [1] kept
    the queue position of its old stamp and went first.)"""
    kw: dict[str, Any] = {"sliding_window": window} if window else {}
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through",
                     eviction_policy=policy, **kw)
    hosts = []
    for key in ([1], [2]):
        (req,) = tree.insert(_key(key, ps), alloc.take(ps)).backups
        hosts.append(alloc.take(ps))
        parts = {n: alloc.take(len(v)) for n, v in (req.component_slots or {}).items()}
        tree.commit_backup(req.op_id, hosts[-1], parts or None)
    tree.insert(_key([1], ps), alloc.take(ps))
    res = tree.evict_host(1, reclaim_duplicates=True)
    assert [f.tolist() for f in res.host_frees] == [hosts[1].tolist()]
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 16))
@pytest.mark.parametrize("policy", ACCESS_POLICIES)
@pytest.mark.parametrize("window", (0, 4096))
def test_write_back_split_duplicate_prefix_goes_first(window: int, policy: str, ps: int,
                                                      alloc) -> None:
    """Write-back: [1,1] is backed up at eviction (a host duplicate until the next evict demotes
    it); insert [1] splits it. The reference reclaims duplicates in the order they became ones,
    sparing device leaves in a first pass (tests/tree/test_write_back_dup_order.py): the suffix
    keeps the place of [1,1] but is a device leaf, the prefix (listed last) has a device child,
    so the prefix's host copy goes first, whatever the policy's stamps say."""
    kw: dict[str, Any] = {"sliding_window": window} if window else {}
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_back",
                     eviction_policy=policy, **kw)
    tree.insert(_key([1, 1], ps), alloc.take(2 * ps))
    (req,) = tree.evict(1).backups
    host = alloc.take(2 * ps)
    parts = {n: alloc.take(len(v)) for n, v in (req.component_slots or {}).items()}
    tree.commit_backup(req.op_id, host, parts or None)
    tree.insert(_key([1], ps), alloc.take(ps))
    res = tree.evict_host(1)
    assert [f.tolist() for f in res.host_frees] == [host[:ps].tolist()]
    tree.sanity_check()
    res = tree.evict_host(1)
    assert [f.tolist() for f in res.host_frees] == [host[ps:].tolist()]
    tree.sanity_check()


@pytest.mark.parametrize("host", (False, True))
@pytest.mark.parametrize("ps", (1, 16))
def test_match_stamps_only_up_to_the_best_node(host: bool, ps: int, alloc) -> None:
    """behavior.md 1.3: a match refreshes the nodes from its best node (the deepest every
    component accepts) up to the root, not the matched tail past it. Mamba, LRU: insert [1,2]
    with a state, [1,2,3,4] without one, [9] with one; match [1,2,3,4] (best: [1,2]); the
    oldest leaf is then [3,4], not [9]."""
    kw: dict[str, Any] = {"host_enabled": True, "write_policy": "write_back"} if host else {}
    tree = RadixTree(page_size=ps, mamba=True, **kw)
    tree.insert(_key([1, 2], ps), alloc.take(2 * ps), mamba_value=1)
    tail = alloc.take(4 * ps)
    tree.insert(_key([1, 2, 3, 4], ps), tail)
    tree.insert(_key([9], ps), alloc.take(ps), mamba_value=2)
    m = tree.match_prefix(_key([1, 2, 3, 4], ps))
    assert m.device_prefix_len == 2 * ps
    res = tree.evict(2 * ps)
    if host:  # write-back: the victim is backed up first
        assert [b.device_slots.tolist() for b in res.backups] == [tail[2 * ps :].tolist()]
    else:
        assert [f.tolist() for f in res.device_frees] == [tail[2 * ps :].tolist()]
    tree.sanity_check()
