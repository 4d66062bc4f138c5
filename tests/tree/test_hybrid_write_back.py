"""Write-back victims of hybrid trees (FULL + SWA, FULL + Mamba, both) in the reference's order.

SGLang 0.5.23 drives a hybrid tree's FULL eviction as a FULL-only one (behavior.md 1.5): a heap
of device leaves (a node is one when no child holds FULL KV on device, whatever its SWA or
Mamba data), each un-backed victim backed up with its component data and demoted before the
next pop, so its parent, now a leaf, competes with the other leaves. Each scenario runs on
SGLang's own tree core (``tests/tree/sglang_hybrid_write_back.py``; skipped where it does not
import) and on ours, with the same expected victims.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.tree.sglang_hybrid_write_back import (
    SGLANG_PROBLEM,
    OursHybridWriteBack,
    SGLangHybridWriteBack,
)

CONFIGS = {
    "swa4": {"window": 4},
    "swa1": {"window": 1},  # (cap-split: a leaf holds one window, [1, 2] is [1] -> [2])
    "mamba": {"mamba": True},
    "swa2+mamba": {"window": 2, "mamba": True},
}


def _trees(cfg: dict[str, Any]) -> list[Any]:
    trees: list[Any] = [OursHybridWriteBack(**cfg)]
    if SGLANG_PROBLEM is None:
        trees.append(SGLangHybridWriteBack(**cfg))
    return trees


def _no_host_copy(t: Any, tokens: tuple[int, ...]) -> None:
    """Ours: the node of ``tokens`` was never backed up."""
    if isinstance(t, OursHybridWriteBack):
        node = next(n for n in t.tree.iter_nodes() if tuple(t.tree.node_key(n.id).tokens) == tokens)
        assert node.host_value is None


def _insert(t: Any, tokens: list[int], mamba: bool) -> None:
    t.next_state = getattr(t, "next_state", 0) + 1
    t.insert(tokens, 100 + t.next_state if mamba else None)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chain_goes_before_a_newer_leaf(name: str) -> None:
    # [1,2] -> [3] -> [4] and a newer [9]: 4 tokens take [4], then its parent [3], then [1,2];
    # [9] stays on device (one victim per leaf took [4] and [9], backing [9] up for nothing).
    cfg = CONFIGS[name]
    for t in _trees(cfg):
        for key in ([1, 2], [1, 2, 3], [1, 2, 3, 4], [9]):
            _insert(t, key, cfg.get("mamba", False))
        t.removed()
        assert t.evict(4) == 4, type(t).__name__
        gone = t.removed()
        assert sorted(gone) == [("gpu", (1,)), ("gpu", (1, 2)), ("gpu", (1, 2, 3)),
                                ("gpu", (1, 2, 3, 4))], type(t).__name__
        assert t.match([9])[:2] == (1, 0)
        assert t.match([1, 2, 3, 4])[:2] == (0, 4)
        _no_host_copy(t, (9,))  # (ours: no copy of [9] was asked for)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fork_parent_waits_for_both_children(name: str) -> None:
    # [1,2] -> {[3], [4]} and a newer [9], LRU [3] < [4] < [9]: the parent of [3] competes only
    # once [4] is taken too, so 4 tokens take [3], [4], then [1,2] (not [9]).
    cfg = CONFIGS[name]
    for t in _trees(cfg):
        for key in ([1, 2], [1, 2, 3], [1, 2, 4], [9]):
            _insert(t, key, cfg.get("mamba", False))
        t.removed()
        assert t.evict(4) == 4, type(t).__name__
        assert sorted(p for _, p in t.removed()) == [(1,), (1, 2), (1, 2, 3), (1, 2, 4)]
        assert t.match([9])[:2] == (1, 0)
        _no_host_copy(t, (9,))  # (ours: no copy of [9] was asked for)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_locked_sibling_keeps_the_parent(name: str) -> None:
    # [1,2] -> {[3], [4]} with [1,2,4] locked: [3] goes, its parent is pinned, so [9] is next.
    cfg = CONFIGS[name]
    for t in _trees(cfg):
        for key in ([1, 2], [1, 2, 3], [1, 2, 4], [9]):
            _insert(t, key, cfg.get("mamba", False))
        assert t.lock([1, 2, 4])
        t.removed()
        assert t.evict(2) == 2, type(t).__name__
        assert sorted(p for _, p in t.removed()) == [(1, 2, 3), (9,)]
        t.unlock()


def test_ours_asks_for_the_chain_in_one_call() -> None:
    # The copies run after the call: [4] is backed up, then [3] and [1,2] as parents whose
    # children all wait (after_children), and nothing is demoted before the copies land.
    t = OursHybridWriteBack(window=4, mamba=True)
    for i, key in enumerate(([1, 2], [1, 2, 3], [1, 2, 3, 4], [9])):
        t.insert(key, 100 + i)
    tree = t.tree
    res = tree.evict(4)
    assert [(tuple(tree.node_key(r.node_id).tokens), r.after_children) for r in res.backups] == [
        ((1, 2, 3, 4), False), ((1, 2, 3), True), ((1, 2), True)]
    assert [sorted(r.component_slots) for r in res.backups] == [["mamba", "swa"]] * 3
    assert (res.pending_tokens, res.num_evicted) == (4, 0)
    tree.sanity_check()
    for r in res.backups:
        t._commit(r)
        tree.sanity_check()
    res = tree.evict(4)
    assert (res.num_evicted, res.backups, res.swa_num_evicted, res.mamba_num_evicted) == (
        4, [], 4, 3)
    tree.sanity_check()


def test_an_insert_over_a_host_only_node_restores_all_its_swa() -> None:
    # Window 1: [5] written back and demoted, then [5, 6] inserted: [5] is on device again.
    for t in reversed(_trees({"window": 1})):  # (SGLang's first, where it imports)
        t.insert([5])
        assert t.evict(1) == 1
        t.insert([5, 6])
        assert t.match([5])[:2] == (1, 0), type(t).__name__  # (was (0, 1) here: a tombstone)
        assert t.lock([5]), type(t).__name__
        t.unlock()


def test_a_match_that_splits_below_its_best_node_stamps_the_prefix_then() -> None:
    # Mamba, MRU: [20,0,0,0,0,0] then [0]; a match of [20] splits the first (its best node is
    # the root: [20] has no state) and stamps the new prefix [20] there, then the suffix. Six
    # tokens take the suffix, then [20] (newer than [0]), not [0] (a soak finding).
    for t in _trees({"mamba": True, "policy": "mru"}):
        _insert(t, [20, 0, 0, 0, 0, 0], True)
        _insert(t, [0], True)
        t.removed()
        assert t.match([20])[:2] == (0, 0)
        assert t.evict(6) == 6, type(t).__name__
        assert sorted(p for _, p in t.removed()) == [
            (20,), (20, 0), (20, 0, 0), (20, 0, 0, 0), (20, 0, 0, 0, 0), (20, 0, 0, 0, 0, 0)
        ], type(t).__name__


def test_a_match_split_prefix_is_newer_than_a_leaf_older_than_the_split() -> None:
    # Mamba, LRU: [20,0,0], then [50] (locked); a match of [20] splits the first. Two tokens
    # take the suffix [0,0]; with [50] unlocked, one more takes [50], older than the split
    # that stamped [20] (the prefix does not keep [20,0,0]'s insert stamp).
    for t in _trees({"mamba": True}):
        _insert(t, [20, 0, 0], True)
        _insert(t, [50], True)
        assert t.lock([50])
        assert t.match([20])[:2] == (0, 0)
        t.removed()
        assert t.evict(2) == 2, type(t).__name__
        assert sorted(p for _, p in t.removed()) == [(20, 0), (20, 0, 0)], type(t).__name__
        t.unlock()
        assert t.evict(1) == 1, type(t).__name__
        assert [p for _, p in t.removed()] == [(50,)], type(t).__name__
