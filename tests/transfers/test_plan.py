"""Copy plans: runs are cut correctly and executing a plan is an exact page copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache.errors import InvalidInputError
from transfers.plan import make_plan


def _pages(xs: list[int]) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_runs_split_on_destination_and_mark_contiguous_sources() -> None:
    plan = make_plan(_pages([10, 11, 12, 3, 7, 8]), _pages([0, 1, 2, 5, 9, 6]))
    runs = [(r.dst_start, r.length, r.src_start, r.sources) for r in plan.runs]
    # sorted by destination: 0,1,2 <- 10,11,12 ; 5,6 <- 3,8 ; 9 <- 7
    assert runs == [(0, 3, 10, None), (5, 2, 3, (3, 8)), (9, 1, 7, None)]
    assert plan.num_pages == 6


def test_empty_single_and_errors() -> None:
    assert make_plan(_pages([]), _pages([])).runs == ()
    (run,) = make_plan(_pages([4]), _pages([9])).runs
    assert (run.dst_start, run.length, run.src_start, run.sources) == (9, 1, 4, None)
    with pytest.raises(InvalidInputError, match="destination page 2 appears twice"):
        make_plan(_pages([0, 1, 3]), _pages([2, 5, 2]))
    with pytest.raises(InvalidInputError, match="source has 2 pages but destination has 1"):
        make_plan(_pages([0, 1]), _pages([2]))


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
