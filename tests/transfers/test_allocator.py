"""PageAllocator: unit tests and a hypothesis state machine against a set-based model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asynccache.errors import ConfigError, DoubleFreeError, InvalidInputError, PoolExhaustedError
from asynccache.transfers.allocator import PageAllocator


def test_fresh_pool_hands_out_ascending_whole_pages() -> None:
    a = PageAllocator(64, 4)
    assert (a.total_size, a.available_size, a.used_size, a.page_size, a.num_pages) == (
        64,
        64,
        0,
        4,
        16,
    )
    x = a.alloc(8)
    assert x is not None and x.dtype == np.int64
    assert x.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    y = a.alloc(4)
    assert y is not None and y.tolist() == [8, 9, 10, 11]
    assert (a.available_size, a.used_size) == (52, 12)


def test_free_then_alloc_returns_the_same_run() -> None:
    a = PageAllocator(64, 4)
    x = a.alloc(16)
    assert x is not None
    a.free(x)
    again = a.alloc(16)
    assert again is not None and again.tolist() == x.tolist()


def test_alloc_zero_and_exhaustion() -> None:
    a = PageAllocator(8, 4)
    empty = a.alloc(0)
    assert empty is not None and empty.shape == (0,)
    assert a.alloc(12) is None
    assert a.available_size == 8
    with pytest.raises(PoolExhaustedError, match="3 pages"):
        a.alloc(12, raise_if_full=True)
    x = a.alloc(8)
    assert x is not None and a.available_size == 0
    assert a.alloc(4) is None


@pytest.mark.parametrize("bad", [3, 5, -4, 1.0, "4", True])
def test_alloc_rejects_non_page_multiples(bad: object) -> None:
    a = PageAllocator(64, 4)
    with pytest.raises(InvalidInputError):
        a.alloc(bad)  # type: ignore[arg-type]
    assert a.available_size == 64


@pytest.mark.parametrize(
    ("num_slots", "page_size", "needle"),
    [
        (0, 4, "num_slots"),
        (-8, 4, "num_slots"),
        (8, 0, "page_size"),
        (10, 4, "num_slots=10"),
        (8.0, 4, "num_slots"),
        (True, 1, "num_slots"),
    ],
)
def test_bad_config(num_slots: object, page_size: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        PageAllocator(num_slots, page_size)  # type: ignore[arg-type]


def test_double_free_names_the_slot_and_frees_nothing() -> None:
    a = PageAllocator(64, 4)
    x = a.alloc(12)
    assert x is not None
    a.free(x[4:8])  # page 1
    before = (a.available_size, a.used_size)
    with pytest.raises(DoubleFreeError, match=r"slot 4 \(page 1\)"):
        a.free(x)  # pages 0 and 2 are allocated, page 1 is not
    assert (a.available_size, a.used_size) == before
    assert a.is_allocated(x).tolist() == [True] * 4 + [False] * 4 + [True] * 4
    a.check_invariants()


def test_duplicate_page_in_one_free_is_a_double_free() -> None:
    a = PageAllocator(64, 4)
    x = a.alloc(8)
    assert x is not None
    with pytest.raises(DoubleFreeError, match=r"slot 4 \(page 1\) appears twice"):
        a.free(np.concatenate([x, x[4:8]]))
    assert a.used_size == 8
    a.check_invariants()


@pytest.mark.parametrize(
    ("slots", "needle"),
    [
        ([0, 1, 2], "not a multiple"),
        ([1, 2, 3, 4], "not made of whole pages"),
        ([0, 1, 3, 2], "not made of whole pages"),
        ([64, 65, 66, 67], "out of range"),
        ([-4, -3, -2, -1], "out of range"),
        ([0.0, 1.0, 2.0, 3.0], "integers"),
    ],
)
def test_free_rejects_malformed_input(slots: list[float], needle: str) -> None:
    a = PageAllocator(64, 4)
    a.alloc(64)
    with pytest.raises(InvalidInputError, match=needle):
        a.free(slots)
    assert a.used_size == 64


def test_free_accepts_torch_and_lists() -> None:
    a = PageAllocator(16, 4)
    x = a.alloc(16)
    assert x is not None
    a.free(torch.from_numpy(x[:4].copy()))
    a.free(x[4:8].tolist())
    a.free(x[8:16].astype(np.int32))
    assert a.available_size == 16
    a.check_invariants()


def test_pages_of_and_page_size_one() -> None:
    a = PageAllocator(8, 1)
    x = a.alloc(3)
    assert x is not None and x.tolist() == [0, 1, 2]
    a.free([1])
    assert a.alloc(1) is not None and a.pages_of([5, 2]).tolist() == [5, 2]
    b = PageAllocator(12, 3)
    assert b.pages_of(np.array([6, 7, 8, 0, 1, 2])).tolist() == [2, 0]


@pytest.mark.parametrize("bad", [-1, 4096, -(1 << 62)])
@pytest.mark.parametrize("n", [8, 2048])  # both sides of the page-size-1 range check's switch
def test_page_size_one_range_check_large_and_small(bad: int, n: int) -> None:
    a = PageAllocator(4096, 1)
    x = a.alloc(n)
    assert x is not None
    slots = x.copy()
    slots[n // 2] = bad
    with pytest.raises(InvalidInputError, match=f"slot {bad}, out of range"):
        a.free(slots)
    with pytest.raises(InvalidInputError, match="out of range"):
        a.free_pages(slots)
    assert a.used_size == n
    a.free(x)
    a.check_invariants()


def _big_request(page_size: int, pages: int) -> tuple[PageAllocator, np.ndarray]:
    """An allocator with ``pages`` pages allocated in a scattered order (several chunks of the
    large-request check), and their slots."""
    a = PageAllocator(page_size * pages * 2, page_size)
    x = a.alloc(page_size * pages * 2)
    assert x is not None
    keep = np.random.default_rng(0).permutation(pages * 2)[:pages]
    slots = x.reshape(-1, page_size)[keep].reshape(-1).copy()
    a.free(np.setdiff1d(x, slots))
    return a, slots


@pytest.mark.parametrize("page_size", [64, 48])  # a shift and a division
@pytest.mark.parametrize(
    ("where", "value", "needle"),
    [
        ("first", -1, "slot -1, out of range"),
        ("last", 1 << 40, "slot 1099511627776, out of range"),
        ("last", -(1 << 62), "out of range"),
        ("middle", "swap", "not made of whole pages"),
        ("page_start", "shift", "not made of whole pages"),
        ("tail_page", "repeat", "not made of whole pages"),
    ],
)
def test_large_request_check_names_the_bad_slot_and_frees_nothing(
    page_size: int, where: str, value: object, needle: str
) -> None:
    """Requests above the chunked-check threshold (several chunks) are checked slot by slot."""
    a, slots = _big_request(page_size, 1600)
    n = slots.shape[0]
    bad = slots.copy()
    at = {"first": 0, "last": n - 1, "middle": n // 2 + 3}.get(where, n // 2)
    if value == "swap":
        bad[at], bad[at + 1] = bad[at + 1], bad[at]
    elif value == "shift":  # a page starting one slot late: every slot in range
        start = (n // 2) // page_size * page_size
        bad[start : start + page_size] += 1
        if bad[start + page_size - 1] >= a.total_size:
            bad[start : start + page_size] -= 2
    elif value == "repeat":  # the last page's last slot repeats its first
        bad[n - 1] = bad[n - page_size]
    else:
        assert isinstance(value, int)
        bad[at] = value
    used = a.used_size
    with pytest.raises(InvalidInputError, match=needle):
        a.pages_of(bad)
    with pytest.raises(InvalidInputError, match=needle):
        a.free(bad)
    assert a.used_size == used
    assert a.pages_of(slots).tolist() == (slots[::page_size] // page_size).tolist()
    a.free(slots)
    assert a.used_size == 0
    a.check_invariants()


def test_large_request_check_allocates_nothing_of_the_request_size() -> None:
    """pages_of on 102,400 slots (page 64) allocates its page ids (1,600 x 8 bytes) and bounded
    scratch, no array of the request's size: fresh arrays of that size cost page faults
    (a gather plus two byte copies took 1.6 ms against 0.06 ms)."""
    import tracemalloc

    a, slots = _big_request(64, 1600)
    a.pages_of(slots)  # the scratch buffers are made once, on first use
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            pages = a.pages_of(slots)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert pages.shape[0] == 1600
    assert peak < 4 * slots.shape[0], f"pages_of peaked at {peak} bytes for {slots.shape[0]} slots"


def test_reset() -> None:
    a = PageAllocator(16, 4)
    a.alloc(12)
    a.reset()
    assert a.available_size == 16
    x = a.alloc(16)
    assert x is not None and x.tolist() == list(range(16))


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a model: a dict of live allocations and a set of free pages."""

    def __init__(self) -> None:
        super().__init__()
        self.page_size = 4
        self.alloc = PageAllocator(32 * self.page_size, self.page_size)
        self.live: list[np.ndarray] = []
        self.free_pages = set(range(32))

    @rule(pages=st.integers(0, 12))
    def allocate(self, pages: int) -> None:
        got = self.alloc.alloc(pages * self.page_size)
        if pages > len(self.free_pages):
            assert got is None
            return
        assert got is not None and got.shape == (pages * self.page_size,)
        got_pages = set((got[:: self.page_size] // self.page_size).tolist())
        assert len(got_pages) == pages
        assert got_pages <= self.free_pages  # never handed out twice
        assert got.tolist() == [p * 4 + o for p in (got[::4] // 4).tolist() for o in range(4)]
        self.free_pages -= got_pages
        self.live.append(got)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.live) - 1))
        x = self.live.pop(i)
        self.alloc.free(x)
        self.free_pages |= set((x[::4] // 4).tolist())

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def partial_release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.live) - 1))
        x = self.live[i]
        k = data.draw(st.integers(0, x.shape[0] // 4))
        self.alloc.free(x[: k * 4])
        self.free_pages |= set((x[: k * 4 : 4] // 4).tolist())
        self.live[i] = x[k * 4 :]

    @rule(page=st.integers(0, 31), extra=st.booleans())
    def double_free(self, page: int, extra: bool) -> None:
        if page not in self.free_pages:
            return
        before = (self.alloc.available_size, self.alloc.used_size)
        slots = list(range(page * 4, page * 4 + 4))
        if extra and self.live and self.live[0].shape[0]:
            slots = self.live[0][:4].tolist() + slots  # an allocated page first: still atomic
        with pytest.raises(DoubleFreeError, match=f"slot {page * 4} "):
            self.alloc.free(slots)
        assert (self.alloc.available_size, self.alloc.used_size) == before

    @invariant()
    def accounting_balances(self) -> None:
        assert self.alloc.available_size == len(self.free_pages) * 4
        assert self.alloc.used_size + self.alloc.available_size == self.alloc.total_size
        self.alloc.check_invariants()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
