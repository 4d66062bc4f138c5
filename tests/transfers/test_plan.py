"""Copy plans: runs are cut correctly and executing a plan is an exact page copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.errors import InvalidInputError
from asynccache.transfers.plan import make_plan


def _pages(xs: list[int]) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def _segs(plan: object) -> list[tuple[int, int, int]]:
    return [(g.dst_start, g.src_start, g.length) for g in plan.segments]  # type: ignore[attr-defined]


def test_segments_need_consecutive_pages_on_both_sides() -> None:
    plan = make_plan(_pages([10, 11, 12, 3, 7, 8]), _pages([0, 1, 2, 5, 9, 6]))
    # sorted by destination: 0,1,2 <- 10,11,12 ; 5 <- 3 ; 6 <- 8 ; 9 <- 7
    assert _segs(plan) == [(0, 10, 3), (5, 3, 1), (6, 8, 1), (9, 7, 1)]
    assert plan.starts == (0, 3, 4, 5)
    assert plan.num_pages == 6


def test_a_destination_run_with_broken_sources_is_cut_into_source_runs() -> None:
    # destinations 20..27 are one run; sources 5,6,7 | 1,2 | 9 | 10,11 are three-and-a-bit runs
    plan = make_plan(_pages([5, 6, 7, 1, 2, 9, 10, 11]), _pages(list(range(20, 28))))
    assert _segs(plan) == [(20, 5, 3), (23, 1, 2), (25, 9, 3)]
    assert plan.starts == (0, 3, 5)


def test_coalescing_edge_cases() -> None:
    # descending sources into ascending destinations: nothing coalesces
    assert _segs(make_plan(_pages([3, 2, 1]), _pages([0, 1, 2]))) == [(0, 3, 1), (1, 2, 1),
                                                                       (2, 1, 1)]
    # unsorted input that is one run once sorted by destination
    assert _segs(make_plan(_pages([7, 5, 6]), _pages([2, 0, 1]))) == [(0, 5, 3)]
    # consecutive sources but a gap in the destinations
    assert _segs(make_plan(_pages([0, 1, 2, 3]), _pages([0, 1, 3, 4]))) == [(0, 0, 2), (3, 2, 2)]
    # the same page on both sides (an in-place copy) and a run ending at the last pair
    assert _segs(make_plan(_pages([4, 0, 1]), _pages([4, 8, 9]))) == [(4, 4, 1), (8, 0, 2)]


def test_empty_single_and_errors() -> None:
    assert make_plan(_pages([]), _pages([])).segments == ()
    assert _segs(make_plan(_pages([4]), _pages([9]))) == [(9, 4, 1)]
    with pytest.raises(InvalidInputError, match="destination page 2 appears twice"):
        make_plan(_pages([0, 1, 3]), _pages([2, 5, 2]))
    with pytest.raises(InvalidInputError, match="source has 2 pages but destination has 1"):
        make_plan(_pages([0, 1]), _pages([2]))


@pytest.mark.parametrize(("src", "dst", "error"), [
    ([], [], None), ([4], [9], None), ([3, 1, 2], [9, 4, 5], None),
    ([0, 1, 3], [2, 5, 2], "destination page 2 appears twice"),
    ([0, 1], [2], "source has 2 pages but destination has 1")])
def test_check_pairs_checks_what_make_plan_checks(src: list[int], dst: list[int],
                                                  error: str | None) -> None:
    from asynccache.transfers.plan import check_pairs

    if error is None:
        check_pairs(_pages(src), _pages(dst))
        make_plan(_pages(src), _pages(dst))
        return
    for fn in (check_pairs, make_plan):
        with pytest.raises(InvalidInputError, match=error):
            fn(_pages(src), _pages(dst))


def test_copy_part_copies_exactly_its_positions_and_layers() -> None:
    # (L=3, 2, P=10, R=4 bytes) views; pairs sorted by destination: 0<-5 1<-6 2<-7 | 6<-1 | 8<-2
    src = np.arange(3 * 2 * 10 * 4, dtype=np.uint8).reshape(3, 2, 10, 4)
    plan = make_plan(_pages([1, 5, 6, 7, 2]), _pages([6, 0, 1, 2, 8]))
    dst = np.zeros_like(src)
    plan.copy_part(src, dst, slice(1, 3), 2, 4)  # positions 2, 3: pairs 2<-7 and 6<-1
    expected = np.zeros_like(src)
    expected[1:3, :, 2] = src[1:3, :, 7]
    expected[1:3, :, 6] = src[1:3, :, 1]
    assert np.array_equal(dst, expected)
    for lo, hi in ((0, 1), (1, 2), (4, 5)):
        plan.copy_part(src, dst, slice(0, 3), lo, hi)
    plan.copy_part(src, dst, slice(0, 1), 2, 4)
    full = np.zeros_like(src)
    for s_, d_ in ((1, 6), (5, 0), (6, 1), (7, 2), (2, 8)):
        full[:, :, d_] = src[:, :, s_]
    assert np.array_equal(dst, full)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n_src=st.integers(1, 24), n_dst=st.integers(1, 24))
def test_execute_is_an_exact_page_copy(data: st.DataObject, n_src: int, n_dst: int) -> None:
    k = data.draw(st.integers(0, min(n_src, n_dst)))
    src_pages = _pages(data.draw(st.permutations(range(n_src)))[:k])
    dst_pages = _pages(data.draw(st.permutations(range(n_dst)))[:k])
    dim = data.draw(st.sampled_from([1, 2]))
    shape = [3, 2, 5] if dim == 2 else [2, 5]
    src = torch.arange(float(np.prod(shape[:dim]) * n_src * 5)).reshape(*shape[:dim], n_src, 5)
    dst = torch.full((*shape[:dim], n_dst, 5), -1.0)
    expected = dst.clone()
    for s, d in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
        expected.select(dim, d).copy_(src.select(dim, s))
    make_plan(src_pages, dst_pages).execute(src, dst, dim)
    assert torch.equal(dst, expected)
