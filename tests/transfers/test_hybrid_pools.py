"""The SWA slot map and the Mamba state pool, alone and driven by a hybrid RadixTree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asynccache.errors import DoubleFreeError, InvalidInputError
from asynccache.transfers.allocator import PageAllocator
from asynccache.transfers.hybrid_pools import MambaStatePool, SWASlotMap
from asynccache.tree import RadixTree


def make_map(full: int = 32, swa: int = 16, page: int = 2) -> SWASlotMap:
    return SWASlotMap(PageAllocator(full, page), PageAllocator(swa, page))


def test_slots_are_allocated_in_pairs_and_freed_per_side() -> None:
    m = make_map()
    full = m.alloc(6)
    assert full is not None and full.tolist() == [0, 1, 2, 3, 4, 5]
    assert m.translate(full).tolist() == [0, 1, 2, 3, 4, 5]
    m.free_swa(np.array([0, 1]))  # out of the window: the SWA side goes first
    assert (m.full.used_size, m.swa.used_size) == (6, 4)
    with pytest.raises(InvalidInputError, match="FULL slot 0 has no SWA slot"):
        m.translate(full)
    assert m.translate(full[2:]).tolist() == [2, 3, 4, 5]
    m.free_full(full)  # frees the FULL slots and the SWA sides still paired
    assert (m.full.used_size, m.swa.used_size) == (0, 0)
    m.check()
    with pytest.raises(DoubleFreeError):
        m.free_full(full[:2])
    assert (m.full.used_size, m.swa.used_size) == (0, 0)


def test_alloc_takes_nothing_when_the_swa_pool_is_short() -> None:
    m = make_map(full=32, swa=4)
    assert m.alloc(4) is not None
    assert m.alloc(2) is None
    assert (m.full.used_size, m.swa.used_size) == (4, 4)
    m.check()


def test_adopt_repairs_a_recovered_pair() -> None:
    m = make_map()
    old = m.alloc(2)
    new = m.alloc(2)
    assert old is not None and new is not None
    m.free_swa(m.translate(old))
    m.adopt(old, np.array([2, 3]))  # the tree kept `old` and took new's SWA slots
    assert m.translate(old).tolist() == [2, 3]
    with pytest.raises(InvalidInputError, match="no SWA slot"):
        m.translate(new)
    with pytest.raises(InvalidInputError, match="already has an SWA side"):
        m.adopt(old, np.array([2, 3]))
    m.check()


def test_apply_tree_frees_reads_the_swa_side_through_full_slots() -> None:
    m = make_map(full=16, swa=16, page=1)
    node, dup, tail, own = (m.alloc(2) for _ in range(4))
    assert node is not None and dup is not None and tail is not None and own is not None
    m.free_swa(m.translate(node))  # the tree's node is an SWA tombstone
    dup_swa = m.translate(dup).tolist()
    m.apply_tree_frees(
        device_frees=[dup],  # the caller's duplicates: their SWA side moves to `node` first
        swa_frees=[tail],  # a tail whose SWA side the tree gave up; its FULL slots stay
        swa_adopted=[(node, dup), (own, own)],  # (own, own): the node's own pairs, unchanged
    )
    assert m.translate(node).tolist() == dup_swa
    assert m.full_to_swa[tail].tolist() == [-1, -1]
    assert m.translate(own).tolist() == [6, 7]
    assert (m.full.used_size, m.swa.used_size) == (6, 4)
    m.check()


def test_a_hybrid_tree_and_the_slot_map_stay_in_balance() -> None:
    page, window = 2, 4
    m = make_map(full=64, swa=64, page=page)
    tree = RadixTree(page_size=page, sliding_window=window)
    adopted: list[int] = []

    def check() -> None:
        tree.sanity_check()
        m.check()
        assert m.full.used_size == tree.device_size
        assert m.swa.used_size == len(tree.component_slots("swa"))
        for n in tree.iter_nodes():
            # The tree names a node's SWA data by its FULL slots: paired iff SWA-live.
            swa = tree.component_slots_of(n.id, "swa")
            sides = m.full_to_swa[n.value]
            if swa is not None:
                assert swa is n.value and (sides >= 0).all()
            else:
                assert (sides == -1).all()

    def request(tokens: list[int], floor: int = 0) -> None:
        full = m.alloc(len(tokens))
        assert full is not None
        if floor:  # the request freed its out-of-window SWA slots during decode
            m.free_swa(m.translate(full[:floor]))
        res = tree.insert(tokens, full, component_evicted_seqlens={"swa": floor})
        m.apply_tree_frees(res.device_frees, res.component_frees["swa"], res.swa_adopted)
        adopted.extend(int(s) for _, a in res.swa_adopted for s in a)
        check()

    request(list(range(12)))
    request([*range(8), 50, 51, 52, 53], floor=6)
    pins = [tree.lock(tree.match_prefix(k).last_device_node)
            for k in ([*range(12)], [*range(8), 50, 51, 52, 53])]
    e = tree.evict(0, swa_num_tokens=10**6)  # only the shared, unpinned prefix can go
    m.apply_tree_frees(e.device_frees, e.component_frees["swa"])
    assert (e.num_evicted, e.swa_num_evicted) == (0, 8)
    for r in pins:
        tree.unlock(r)
    check()
    # Recovery: a request re-inserting an SWA-tombstoned prefix hands its SWA slots over.
    for tokens in ([*range(8)], [*range(12)], [*range(8), 50, 51, 52, 53]):
        request(tokens)
        assert tree.match_prefix(tokens).device_prefix_len == len(tokens)
    assert adopted  # some tombstone was recovered from a request's slots
    e = tree.evict(10**6, swa_num_tokens=10**6)
    m.apply_tree_frees(e.device_frees, e.component_frees["swa"])
    check()
    assert (m.full.used_size, m.swa.used_size, tree.node_count) == (0, 0, 0)


def test_mamba_copy_on_write_is_bit_exact_and_private() -> None:
    pool = MambaStatePool(4, (3, 5), dtype=torch.float32)
    tree = RadixTree(page_size=1, mamba=True)
    src = pool.alloc(1)
    assert src is not None
    pool.states[int(src[0])] = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    tree.insert([1, 2, 3], [0, 1, 2], mamba_value=src)
    m = tree.match_prefix([1, 2, 3, 4], cow_mamba=True)
    assert (m.device_prefix_len, m.mamba_cow_slot) == (3, int(src[0]))
    dst = pool.copy_on_write(m.mamba_cow_slot)
    assert dst is not None and dst != m.mamba_cow_slot
    assert torch.equal(pool.states[dst], pool.states[m.mamba_cow_slot])
    pool.states[dst] += 1  # the request decodes on its own copy
    assert not torch.equal(pool.states[dst], pool.states[m.mamba_cow_slot])
    assert pool.used_size == 2
    e = tree.evict(3)
    pool.free(np.concatenate(e.component_frees["mamba"]))
    pool.free([dst])
    assert pool.used_size == 0
    with pytest.raises(DoubleFreeError, match="not allocated"):
        pool.copy_on_write(dst)
    with pytest.raises(InvalidInputError, match="out of range"):
        pool.copy_on_write(9)
