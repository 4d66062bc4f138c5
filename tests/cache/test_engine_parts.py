"""The engine's parts on their own: the slot ledger's host count and accounting check, the
device slots (FULL-only and hybrid, real pools), the task owner, and the commit policy a cache
picks. Through real pools and a real cache; no stand-ins."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asynccache import CacheConfig
from asynccache.engine import Parts, TaskOwner
from asynccache.engine.ledger import SlotLedger
from asynccache.engine.slots import FullSlots, HybridDeviceSlots, agreed_state_names, device_slots
from asynccache.errors import InvalidInputError
from asynccache.transfers.allocator import PageAllocator

SMALL = {"page_size": 4, "num_layers": 2, "num_heads": 2, "head_dim": 8, "dtype": "float16"}


def test_ledger_counts_host_slots_and_names_the_side_that_drifted() -> None:
    ledger = SlotLedger(PageAllocator(64, 4), PageAllocator(64, 4))
    ledger.hand_out(np.arange(8, dtype=np.int64))
    ledger.host_taken(np.arange(16, 28, dtype=np.int64))
    assert ledger.host_returned(np.arange(20, 24, dtype=np.int64)).tolist() == [5]
    assert (ledger.held_tokens, ledger.host_tokens) == (8, 8)
    ledger.check_accounting(tree_device=16, device_used=24, tree_host=20, host_used=28)
    with pytest.raises(AssertionError, match="device accounting: allocator uses 23 slots, tree "
                                             "holds 16 and callers 8"):
        ledger.check_accounting(tree_device=16, device_used=23)
    with pytest.raises(AssertionError, match=r"host accounting: allocator uses 27 slots, tree "
                                             r"holds 20 and operations .* 8"):
        ledger.check_accounting(16, 24, tree_host=20, host_used=27)


def test_ledger_refuses_host_slots_no_operation_holds_before_changing_anything() -> None:
    ledger = SlotLedger(PageAllocator(64, 4), PageAllocator(64, 4))
    ledger.host_taken(np.arange(0, 8, dtype=np.int64))
    with pytest.raises(InvalidInputError, match=r"slot 8 \(position 8\) is not held by an "
                                                r"operation: it was never handed out by take_host"):
        ledger.host_returned(np.arange(0, 12, dtype=np.int64))
    with pytest.raises(InvalidInputError, match="slot 4 appears twice"):
        ledger.host_returned(np.array([4, 5, 6, 7, 4, 5, 6, 7]))
    assert ledger.host_tokens == 8  # nothing released
    assert ledger.host_returned(np.arange(0, 8, dtype=np.int64)).tolist() == [0, 1]
    assert ledger.host_tokens == 0
    with pytest.raises(InvalidInputError, match="no host pool"):
        SlotLedger(PageAllocator(64, 4)).host_taken(np.arange(4, dtype=np.int64))


def test_ledger_refuses_slots_it_never_handed_out_before_changing_anything() -> None:
    ledger = SlotLedger(PageAllocator(64, 4))
    ledger.hand_out(np.arange(4, 12, dtype=np.int64))
    with pytest.raises(InvalidInputError, match=r"slot 12 .* is not held by the caller"):
        ledger.release(np.arange(4, 16, dtype=np.int64))
    assert ledger.held_tokens == 8  # nothing released
    pages = ledger.release(np.arange(4, 12, dtype=np.int64))
    assert pages.tolist() == [1, 2] and ledger.held_tokens == 0


def test_full_slots_allocate_free_and_report_the_shortfall() -> None:
    parts = Parts.build(CacheConfig(**SMALL, device_tokens=32))
    slots = device_slots(parts.device_pool, parts.hybrid)
    assert isinstance(slots, FullSlots) and slots.evicts_async
    got = slots.alloc(24)
    assert got is not None and len(got) == 24
    assert slots.alloc(12) is None  # no eviction here
    assert slots.shortfall(12) == (4, 0)
    slots.free(got)
    assert parts.device_pool.allocator.used_size == 0
    assert slots.agreed_state(parts.tree) == []
    assert agreed_state_names(parts.config) == ("tree nodes", "device tokens", "host tokens")


def test_hybrid_slots_pair_only_the_last_swa_tokens() -> None:
    parts = Parts.build(CacheConfig(**SMALL, device_tokens=32, sliding_window=8, swa_tokens=16))
    slots = device_slots(parts.device_pool, parts.hybrid)
    assert isinstance(slots, HybridDeviceSlots) and not slots.evicts_async
    smap = parts.hybrid.swa_map
    got = slots.alloc(12, swa_tokens=4)  # FULL for 12, SWA pairs for the last 4
    assert got is not None
    pairs = smap.full_to_swa[got]
    assert (pairs[:8] < 0).all() and (pairs[8:] >= 0).all()
    assert smap.swa.used_size == 4
    assert slots.shortfall(24, swa_tokens=16) == (4, 4)  # 20 FULL and 12 SWA free
    both = slots.alloc(8)  # None: every token paired
    assert both is not None and (smap.full_to_swa[both] >= 0).all()
    slots.free(got)
    slots.free(both)
    assert parts.device_pool.allocator.used_size == 0 and smap.swa.used_size == 0
    assert agreed_state_names(parts.config)[3:] == (
        "swa device tokens", "swa device pool used", "swa host pool used")


async def test_task_owner_drain_survives_a_cancelled_drainer_and_a_failing_sibling() -> None:
    owner = TaskOwner()
    gate = asyncio.Event()
    done: list[str] = []

    async def write(name: str) -> None:
        await gate.wait()
        done.append(name)

    async def fail() -> None:
        raise OSError("the store is down")

    owner.spawn("writes", write("a"))
    owner.spawn("writes", fail())
    owner.spawn("writes", write("b"))
    drainer = asyncio.ensure_future(owner.drain("writes"))
    await asyncio.sleep(0)
    drainer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await drainer
    assert owner.count("writes") == 2  # the failure is gone (logged); the writes keep running
    gate.set()
    await owner.drain("writes")
    assert sorted(done) == ["a", "b"] and owner.count("writes") == 0


async def test_one_rank_commits_immediately(make_cache) -> None:
    cache = await make_cache()
    assert cache.agreement is None and await cache.sync() == 0


@pytest.mark.parametrize("layout", ["one_run", "two_runs", "scattered"])
async def test_write_kv_reads_back_bit_exact_however_the_pages_lie(make_cache, kit, layout):
    """write_kv copies runs of consecutive pages as slices and scatters fragmented ones
    (more than 64 runs); read_kv gives the same bits back either way, tail tokens included."""
    cache = await make_cache(device_tokens=1024, page_size=4)
    slots = await cache.alloc_device(1024)
    pages = slots.reshape(-1, 4)
    if layout == "two_runs":
        pages = np.concatenate([pages[128:192], pages[:64]])
    elif layout == "scattered":
        pages = pages[np.random.default_rng(0).permutation(len(pages))[:200]]
    use = pages.reshape(-1)[: len(pages) * 4 - 3]  # a partial last page too
    model = kit.KVModel.of(cache)
    tokens = list(range(1, len(use) + 1))
    cache.write_kv(use, model.expected(tokens))
    kit.assert_bits_equal(cache.read_kv(use), model.expected(tokens), layout)
    cache.free_device(slots)


def test_task_owner_group_names_are_never_shared() -> None:
    owner = TaskOwner()
    assert [owner.new_group("storage_writes"), owner.new_group("storage_writes"),
            owner.new_group("buffer_writes")] == ["storage_writes#1", "storage_writes#2",
                                                   "buffer_writes#3"]
