"""Session references (behavior.md 1.9): referenced paths are evicted last, never protected."""

from __future__ import annotations

import random

import numpy as np
import pytest

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.tree import POLICIES, RadixTree, SessionRef


def _tree(policy: str = "lru", **kw: object) -> RadixTree:
    kw.setdefault("device_tokens", 64 * int(kw.get("page_size", 1)))  # type: ignore[call-overload]
    return RadixTree(enable_sessions=True, eviction_policy=policy, **kw)


def _victim_order(tree: RadixTree, first_slot: dict[int, str]) -> list[str]:
    order = []
    while True:
        res = tree.evict(1)
        if not res.num_evicted:
            return order
        order.extend(first_slot[int(f[0])] for f in res.device_frees)
        tree.sanity_check()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_referenced_leaf_goes_last_under_every_policy(alloc, policy: str) -> None:
    tree = _tree(policy)
    names = {}
    nodes = {}
    for name, tokens in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])):
        v = alloc.take(3)
        names[int(v[0])] = name
        nodes[name] = tree.insert(tokens, v).last_node
    ref = tree.add_session_ref(nodes["a"])
    tree.sanity_check()
    order = _victim_order(tree, names)
    assert order[-1] == "a"
    assert sorted(order) == ["a", "b", "c"]
    assert tree.session_refs == 1
    tree.release_session_ref(ref)  # its node is gone: the ref anchors at the root now
    assert tree.session_refs == 0
    tree.sanity_check()


def test_lru_order_with_and_without_a_reference(alloc) -> None:
    for referenced, expected in ((None, ["a", "b", "c"]), ("a", ["b", "c", "a"]),
                                 ("b", ["a", "c", "b"])):
        tree = _tree()
        names, nodes = {}, {}
        for name, tokens in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
            v = alloc.take(2)
            names[int(v[0])] = name
            nodes[name] = tree.insert(tokens, v).last_node
        if referenced:
            tree.add_session_ref(nodes[referenced])
        assert _victim_order(tree, names) == expected


def test_path_reference_keeps_ancestors_until_last(alloc) -> None:
    """[1,2,3,4] then [1,2,5,6] split [1,2]; a ref on [3,4] covers [1,2] too."""
    tree = _tree()
    v1 = alloc.take(4)
    leaf = tree.insert([1, 2, 3, 4], v1).last_node
    v2 = alloc.take(4)
    other = tree.insert([1, 2, 5, 6], v2).last_node
    ref = tree.add_session_ref(leaf)
    prefix = tree._node(leaf).parent
    assert prefix is not None and prefix.key == np.array([1, 2], "<u4").tobytes()
    assert (tree._node(leaf).sref, prefix.sref, tree._node(other).sref) == (1, 1, 0)
    names = {int(v1[0]): "1-2", int(v1[2]): "3-4", int(v2[2]): "5-6"}
    assert _victim_order(tree, names) == ["5-6", "3-4", "1-2"]
    tree.release_session_ref(ref)
    tree.sanity_check()


def test_reference_protects_nothing(alloc) -> None:
    tree = _tree()
    leaf = tree.insert([1, 2, 3], alloc.take(3)).last_node
    ref = tree.add_session_ref(leaf)
    assert tree.evictable_size == 3 and tree.protected_size == 0
    assert tree.evict(3).num_evicted == 3
    assert tree.node_count == 0
    assert tree.session_refs == 1
    tree.sanity_check()
    tree.release_session_ref(ref)
    assert tree.session_refs == 0


def test_deleted_anchor_moves_to_surviving_ancestor(alloc) -> None:
    tree = _tree()
    tree.insert([1, 2, 3, 4], alloc.take(4))
    leaf = tree.insert([1, 2, 5, 6], alloc.take(4)).last_node
    prefix = tree._node(leaf).parent
    assert prefix is not None
    ref = tree.add_session_ref(leaf)
    tree.drop(leaf)  # delete the referenced leaf only
    tree.sanity_check()
    assert prefix.sref == 1 and prefix.anchors == [ref.token]
    tree.release_session_ref(ref)
    assert prefix.sref == 0
    tree.sanity_check()


def test_split_copies_the_count_to_the_prefix(alloc) -> None:
    tree = _tree()
    leaf = tree.insert([1, 2, 3, 4], alloc.take(4)).last_node
    refs = [tree.add_session_ref(leaf), tree.add_session_ref(leaf)]
    tree.insert([1, 2, 9, 9], alloc.take(4))  # splits [1,2] off the referenced node
    prefix = tree._node(leaf).parent
    assert prefix is not None and prefix.ntok == 2
    assert (prefix.sref, tree._node(leaf).sref) == (2, 2)
    tree.sanity_check()
    for r in refs:
        tree.release_session_ref(r)
    assert (prefix.sref, tree._node(leaf).sref) == (0, 0)
    tree.sanity_check()


def test_host_leaves_of_sessions_go_last(alloc) -> None:
    tree = _tree(host_enabled=True, write_policy="write_through")
    leaves = {}
    hosts = {}
    for name, tokens in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
        res = tree.insert(tokens, alloc.take(2))
        leaves[name] = res.last_node
        for b in res.backups:
            h = alloc.take(b.num_tokens)
            hosts[int(h[0])] = name
            tree.commit_backup(b.op_id, h)
    tree.add_session_ref(leaves["a"])
    assert tree.evict(6).num_evicted == 6  # all demoted to host
    order = []
    while True:
        res = tree.evict_host(1)
        if not res.num_evicted:
            break
        order.extend(hosts[int(f[0])] for f in res.host_frees)
        tree.sanity_check()
    assert order == ["b", "c", "a"]


def test_reset_keeps_refs_releasable(alloc) -> None:
    tree = _tree()
    ref = tree.add_session_ref(tree.insert([1, 2], alloc.take(2)).last_node)
    tree.reset()
    tree.sanity_check()
    tree.release_session_ref(ref)
    assert tree.session_refs == 0


def test_errors(alloc) -> None:
    plain = RadixTree()
    leaf = plain.insert([1, 2], alloc.take(2)).last_node
    with pytest.raises(ConfigError, match="enable_sessions"):
        plain.add_session_ref(leaf)
    tree = _tree()
    with pytest.raises(Exception, match="12345"):
        tree.add_session_ref(12345)
    ref = tree.add_session_ref(tree.insert([1, 2], alloc.take(2)).last_node)
    tree.release_session_ref(ref)
    with pytest.raises(InvalidInputError, match="released twice"):
        tree.release_session_ref(ref)
    with pytest.raises(InvalidInputError, match="SessionRef"):
        tree.release_session_ref("nope")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="enable_sessions"):
        RadixTree(enable_sessions=1)  # type: ignore[arg-type]
    assert isinstance(ref, SessionRef)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_invariants(alloc, seed: int) -> None:
    rng = random.Random(seed)
    tree = _tree(rng.choice(sorted(POLICIES)), page_size=rng.choice([1, 2]),
                 host_enabled=True, write_policy="write_through")
    refs: list[SessionRef] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.45:
            ps = tree.page_size
            toks = [rng.randrange(4) for _ in range(rng.randrange(1, 5) * ps)]
            m = tree.match_prefix(toks)
            if m.pending_loads:
                continue
            res = tree.insert(toks, alloc.take(len(toks)))
            for b in res.backups:
                if rng.random() < 0.7:
                    tree.commit_backup(b.op_id, alloc.take(b.num_tokens))
                else:
                    tree.abort_backup(b.op_id)
            if rng.random() < 0.5:
                refs.append(tree.add_session_ref(res.last_node))
        elif op < 0.6 and refs:
            tree.release_session_ref(refs.pop(rng.randrange(len(refs))))
        elif op < 0.8:
            tree.evict(rng.randrange(1, 6))
        else:
            tree.evict_host(rng.randrange(1, 6))
        tree.sanity_check()
    for r in refs:
        tree.release_session_ref(r)
    tree.sanity_check()
    assert all(n.sref == 0 for n in tree.iter_nodes())
