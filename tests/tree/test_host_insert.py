"""insert_host (host copies from storage prefetch) and drop (write-back host OOM)."""

from __future__ import annotations

import re

import pytest

from asynccache.errors import InvalidInputError
from asynccache.tree import BlockStored, Medium, RadixTree

PAGE_SIZES = (1, 4, 16)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_host_appends_host_only_nodes(ps: int, alloc) -> None:
    # (write-back: below a device node without a host copy; see the drop tests below)
    tree = RadixTree(page_size=ps, host_enabled=True, enable_kv_events=True,
                     write_policy="write_back")
    key = list(range(1, 4 * ps + 1))
    v = alloc.take(2 * ps)
    tree.insert(key[: 2 * ps], v)
    tree.take_events()
    h = alloc.take(2 * ps)
    res = tree.insert_host(key, 2 * ps, h)
    assert (res.prefix_len, res.cached_len, res.device_frees, res.backups) == (2 * ps, 4 * ps, [], [])
    assert (tree.device_size, tree.host_size, tree.node_count) == (2 * ps, 2 * ps, 2)
    m = tree.match_prefix(key)
    assert (m.device_prefix_len, m.host_hit_length, m.best_node, m.last_device_node) == (
        2 * ps, 2 * ps, res.last_node, 1,
    )
    assert m.device_indices.tolist() == v.tolist()
    (ev,) = tree.take_events()
    assert (ev.medium, ev.token_ids, len(ev.block_hashes)) == (
        Medium.CPU_PINNED, key[2 * ps :], 2,
    )
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash is not None
    # Loading it back works like any host-only node.
    d = alloc.take(2 * ps)
    ticket = tree.start_load_back(m.best_node, d)
    assert ticket.host_slots.tolist() == h.tolist()
    tree.commit_load_back(ticket.op_id)
    assert tree.match_prefix(key).device_prefix_len == 4 * ps
    tree.sanity_check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_host_backs_up_device_node_and_reports_duplicates(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, host_enabled=True)
    key = list(range(1, 2 * ps + 1))
    v = alloc.take(2 * ps)
    tree.insert(key, v)  # write_through_selective: not backed up yet
    assert tree.host_size == 0
    h = alloc.take(2 * ps)
    res = tree.insert_host(key, 0, h)
    assert (res.prefix_len, res.cached_len, res.device_frees, res.last_node) == (2 * ps, 2 * ps, [], 1)
    assert sorted(tree.host_slots().tolist()) == h.tolist()
    h2 = alloc.take(2 * ps)
    res = tree.insert_host(key, 0, h2)
    assert [f.tolist() for f in res.device_frees] == [h2.tolist()]  # host slots, duplicates
    # Backed up now: eviction demotes instead of deleting.
    assert [f.tolist() for f in tree.evict(1).device_frees] == [v.tolist()]
    m = tree.match_prefix(key)
    assert (m.device_prefix_len, m.host_hit_length) == (0, 2 * ps)
    tree.sanity_check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_host_under_write_back_gives_back_device_pages(ps: int, alloc) -> None:
    """Write-back: a device node without a host copy does not take the fetched slots (it is
    backed up when evicted); they come back with those of pages already on host."""
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_back")
    key = list(range(1, 3 * ps + 1))
    tree.insert(key[: 2 * ps], alloc.take(2 * ps))
    h = alloc.take(3 * ps)
    res = tree.insert_host(key, 0, h)
    assert [f.tolist() for f in res.device_frees] == [h[: 2 * ps].tolist()]
    assert (res.prefix_len, res.cached_len, tree.host_size) == (2 * ps, 3 * ps, ps)
    assert sorted(tree.host_slots().tolist()) == h[2 * ps :].tolist()
    assert tree.evict_host(ps).num_evicted == ps  # no duplicate: the host-only leaf goes
    assert len(tree.evict(2 * ps).backups) == 1  # the device node is backed up at eviction
    tree.sanity_check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_host_drops_a_refill_below_an_unbacked_anchor(ps: int, alloc) -> None:
    """Write-through policies: the rest of the span would hang below a node without a host
    copy: dropped, its slots come back, and the tree holds the key up to the anchor."""
    tree = RadixTree(page_size=ps, host_enabled=True)  # write_through_selective
    key = list(range(1, 3 * ps + 1))
    anchor = tree.insert(key[: 2 * ps], alloc.take(2 * ps)).last_node  # one hit: no backup
    h = alloc.take(ps)
    res = tree.insert_host(key, 2 * ps, h)
    assert [f.tolist() for f in res.device_frees] == [h.tolist()]
    assert (res.prefix_len, res.cached_len, res.last_node) == (2 * ps, 2 * ps, anchor)
    assert (tree.host_size, tree.node_count) == (0, 1)
    tree.sanity_check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_host_refills_nothing_below_an_unbacked_anchor(ps: int, alloc) -> None:
    """A device node the span walks below an un-backed anchor takes no host copy either (the
    reference's tree would refill it, then keep the rest below it; its scheduler never
    prefetches from an un-backed anchor): the host copies stay prefix-closed."""
    tree = RadixTree(page_size=ps, host_enabled=True)
    key = list(range(1, 4 * ps + 1))
    tree.insert(key[: 3 * ps], alloc.take(3 * ps))  # one hit: no backup
    assert tree.match_prefix(key[:ps]).best_node != 0  # (the anchor: split off at ps)
    h = alloc.take(3 * ps)
    res = tree.insert_host(key, ps, h)
    assert [f.tolist() for f in res.device_frees] == [h[: 2 * ps].tolist(), h[2 * ps :].tolist()]
    assert (res.prefix_len, res.cached_len, tree.host_size) == (3 * ps, 3 * ps, 0)
    tree.sanity_check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_host_keeps_a_refill_below_an_anchor_being_backed_up(ps: int, alloc) -> None:
    """Write-through: an anchor whose backup is in flight counts as backed up (the reference
    records the host copy when it issues the copy)."""
    tree = RadixTree(page_size=ps, host_enabled=True, write_policy="write_through")
    key = list(range(1, 3 * ps + 1))
    (backup,) = tree.insert(key[: 2 * ps], alloc.take(2 * ps)).backups
    h = alloc.take(ps)
    res = tree.insert_host(key, 2 * ps, h)
    assert (res.device_frees, res.cached_len, tree.host_size) == ([], 3 * ps, ps)
    tree.commit_backup(backup.op_id, alloc.take(2 * ps))
    assert tree.match_prefix(key).host_hit_length == ps
    tree.sanity_check()


@pytest.mark.parametrize(
    ("start", "slots", "message"),
    [
        (1, 2, "host span [1, 3) must be whole pages"),
        (0, 3, "host span [0, 3) must be whole pages"),
        (4, 4, "host span [4, 8) must be whole pages within the key of 6 tokens"),
        (-2, 2, "start must be >= 0, got -2"),
    ],
)
def test_insert_host_bad_span(start: int, slots: int, message: str, alloc, snapshot) -> None:
    tree = RadixTree(page_size=2, host_enabled=True)
    tree.insert([1, 2, 3, 4], alloc.take(4))
    before = snapshot(tree)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        tree.insert_host([1, 2, 3, 4, 5, 6], start, alloc.take(slots))
    assert snapshot(tree) == before
    tree.sanity_check()


def test_insert_host_gap_error_leaves_tree_unchanged(alloc, snapshot) -> None:
    tree = RadixTree(page_size=2, host_enabled=True)
    tree.insert([1, 2, 3, 4], alloc.take(4))
    before = snapshot(tree)
    with pytest.raises(InvalidInputError, match="would leave a gap"):
        tree.insert_host([1, 2, 9, 9, 5, 6], 4, alloc.take(2))
    assert snapshot(tree) == before


def test_drop_deletes_unlocked_leaf_without_backup(alloc) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_back")
    v = alloc.take(3)
    tree.insert([1, 2, 3], v)
    tree.insert([1, 2, 4], alloc.take(3))
    receipt = tree.lock(tree.match_prefix([1, 2, 4]).last_device_node)
    locked_leaf = receipt.node_id
    res = tree.drop(locked_leaf)
    assert (res.num_evicted, res.device_frees) == (0, [])
    prefix = tree.match_prefix([1, 2]).last_device_node
    assert tree.drop(prefix).num_evicted == 0  # it has device children
    leaf = tree.match_prefix([1, 2, 3]).last_device_node
    res = tree.drop(leaf)
    assert res.num_evicted == 1
    assert [f.tolist() for f in res.device_frees] == [v[2:].tolist()]
    assert (tree.node_count, tree.device_size, tree.pending_ops) == (2, 3, 0)
    tree.sanity_check()


@pytest.mark.parametrize(
    ("policy", "want"),
    [("write_back", (True, True, True)), ("write_through", (True, True, True)),
     ("write_through_selective", (True, False, True))],
)
def test_keeps_host_inserts_below(policy: str, want: tuple[bool, ...], alloc) -> None:
    """Below the root, an un-backed device node (write-through: its backup is in flight at
    once), the same node being backed up."""
    tree = RadixTree(page_size=1, host_enabled=True, write_policy=policy)
    res = tree.insert([1, 2], alloc.take(2))
    node = res.last_node
    got = [tree.keeps_host_inserts_below(tree.root_id), tree.keeps_host_inserts_below(node)]
    if policy == "write_through_selective":
        res = tree.insert([1, 2], alloc.take(2))  # its second hit
    elif policy == "write_back":
        res = tree.evict(2)  # (backed up on the way out)
    assert [b.node_id for b in res.backups] == [node]
    got.append(tree.keeps_host_inserts_below(node))
    assert tuple(got) == want
