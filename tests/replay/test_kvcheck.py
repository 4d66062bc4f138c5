"""The replay's KV pattern and its in-place writer / verifier (asynccache/replay/kvpattern.py,
kvcheck.py): what is written is the pattern bit for bit, however the slots lie, and the
verifier names the first wrong token of a wrong, shifted, stale, other-prefix, torn or
lane-swapped page, exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asynccache.replay import kvcheck
from asynccache.replay.bound import PrefixHasher
from asynccache.replay.kvcheck import ReplayKV
from asynccache.replay.kvpattern import MASK, PrefixKV
from asynccache.transfers.pools import DevicePool, KVShape

PS = 4
SHAPE = KVShape(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float16)


def _toks(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n).astype(np.uint32)


def _pool(slots: int = 256, shape: KVShape = SHAPE) -> DevicePool:
    return DevicePool(shape, slots, PS, device="cpu")


def _slots(pages: list[int], tail: int = 0) -> np.ndarray:
    """Slots of ``pages`` (whole), then ``tail`` slots of the page after the last one."""
    out = [np.arange(p * PS, p * PS + PS) for p in pages]
    if tail:
        out.append(np.arange((pages[-1] + 1) * PS, (pages[-1] + 1) * PS + tail))
    return np.concatenate(out).astype(np.int64)


def _written(pool: DevicePool, kv: ReplayKV, toks: np.ndarray, slots: np.ndarray,
             start: int = 0, ns: str | None = None) -> np.ndarray:
    ids = kv.page_ids(toks, ns)
    kv.write(slots, ids, start)
    return ids


@pytest.mark.parametrize("pages, tail", [
    ([3, 4, 5, 6], 3),  # one run, a partial last page
    ([9, 10, 2, 3, 20], 0),  # three runs
    (list(range(40, 0, -2)), 1),  # 21 runs of one page
])
@pytest.mark.parametrize("fragmented", [False, True])
def test_write_is_the_pattern_bit_for_bit_and_verifies(pages, tail, fragmented, monkeypatch):
    if fragmented:  # force the scratch + scatter / gather path
        monkeypatch.setattr(kvcheck, "_MAX_RUNS", 0)
    pool = _pool()
    kv = ReplayKV(pool, SHAPE)
    slots = _slots(pages, tail)
    n = len(slots)
    toks = _toks(1, 8 + n)
    ids = _written(pool, kv, toks, slots, start=8)
    want = kv.pattern.expected(toks, None, 8, 8 + n)
    got = kv.access.read_kv(slots)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert kv.verify(slots, ids, 8) is None
    assert kv.verify(slots[:-tail or None], ids, 8) is None


def test_scratch_chunks_split_long_runs(monkeypatch):
    """A run longer than the scratch buffer is checked chunk by chunk, and a wrong token in
    a later chunk is named at its own index."""
    monkeypatch.setattr(kvcheck, "_SCRATCH_BYTES", SHAPE.bytes_per_token * PS * 2)
    pool = _pool()
    kv = ReplayKV(pool, SHAPE)
    assert kv.chunk == 2 * PS
    slots = _slots(list(range(1, 11)))
    toks = _toks(2, len(slots))
    ids = _written(pool, kv, toks, slots)
    assert kv.verify(slots, ids, 0) is None
    pool.kv[1, 0, int(slots[27]), 1, 2] += 1
    assert kv.verify(slots, ids, 0) == 27


def _corrupt_cases(pool: DevicePool, kv: ReplayKV):
    """(name, slots to check, ids, start, expected first bad index) after each corruption;
    every case starts from A's 6 pages written at pages 10..15."""
    a = _toks(3, 6 * PS)
    b = a.copy()
    b[0] += 1  # B: A with its first token changed: every later page is another prefix's
    slots = _slots(list(range(10, 16)))
    ids_a = kv.page_ids(a, None)
    ids_b = kv.page_ids(b, None)

    def fresh():
        pool.kv.zero_()
        kv.write(slots, ids_a, 0)

    yield "clean", fresh, slots, None
    # a wrong page: page 12 holds the KV of A's page 0
    yield "wrong page", lambda: (fresh(), kv.write(slots[2 * PS : 3 * PS], ids_a, 0)), slots, 2 * PS

    def shifted():  # page 13's KV is A's positions 13..16 shifted by one token
        fresh()
        kv.write(slots[3 * PS : 4 * PS], ids_a, 3 * PS + 1)
    yield "shifted", shifted, slots, 3 * PS

    def stale():  # page 14 still holds what another request wrote there before
        fresh()
        kv.write(slots[4 * PS : 5 * PS], kv.page_ids(_toks(9, 6 * PS), "other"), 4 * PS)
    yield "stale", stale, slots, 4 * PS

    def other_prefix():  # page 11 from B: same tokens at the same positions, another prefix
        fresh()
        kv.write(slots[PS : 2 * PS], ids_b, PS)
    yield "other prefix", other_prefix, slots, PS

    def torn():  # page 15: its first half written, the rest left from another prefix
        fresh()
        kv.write(slots[5 * PS : 6 * PS], ids_b, 5 * PS)
        kv.write(slots[5 * PS : 5 * PS + 2], ids_a, 5 * PS)
    yield "torn", torn, slots, 5 * PS + 2

    def kv_swapped():  # page 10's K and V exchanged
        fresh()
        s = slice(int(slots[0]), int(slots[0]) + PS)
        k = pool.kv[:, 0, s].clone()
        pool.kv[:, 0, s] = pool.kv[:, 1, s]
        pool.kv[:, 1, s] = k
    yield "K/V swapped", kv_swapped, slots, 0

    def one_bit():  # a single bit of the last element of the last page
        fresh()
        pool.kv.view(torch.int16)[-1, -1, int(slots[-1]), -1, -1] ^= 1
    yield "one bit", one_bit, slots, 6 * PS - 1


@pytest.mark.parametrize("fragmented", [False, True])
def test_the_verifier_names_the_first_wrong_token(fragmented, monkeypatch):
    if fragmented:
        monkeypatch.setattr(kvcheck, "_MAX_RUNS", 0)
    pool = _pool()
    kv = ReplayKV(pool, SHAPE)
    ids_a = kv.page_ids(_toks(3, 6 * PS), None)
    seen = []
    for name, corrupt, slots, bad in _corrupt_cases(pool, kv):
        corrupt()
        assert kv.verify(slots, ids_a, 0) == bad, name
        seen.append(name)
    assert len(seen) == 8


def test_the_token_only_pattern_would_accept_the_other_prefix_page():
    """Why the pattern is per prefix: B differs from A in its first token only, so A's and
    B's pages 1.. hold the same tokens at the same positions; their KV differs in every
    token, as a real model's would."""
    pattern = PrefixKV(SHAPE, PS)
    a = _toks(3, 3 * PS)
    b = a.copy()
    b[0] += 1
    ka, kb = pattern.expected(a, None, PS, 3 * PS), pattern.expected(b, None, PS, 3 * PS)
    diff = (ka.view(torch.int16) != kb.view(torch.int16)).any(dim=4).any(dim=3).any(dim=1)
    assert diff.any(dim=0).all()


def test_the_pattern_is_a_function_of_prefix_and_position():
    pattern = PrefixKV(SHAPE, PS)
    a = _toks(4, 5 * PS + 2)
    # positions of whole pages do not depend on what follows them
    assert torch.equal(pattern.expected(a, None, 0, 3 * PS),
                       pattern.expected(a[: 3 * PS], None, 0, 3 * PS))
    longer = np.concatenate([a[: 3 * PS], _toks(5, 7)])
    assert torch.equal(pattern.expected(a, None, PS, 3 * PS),
                       pattern.expected(longer, None, PS, 3 * PS))
    # a namespace is part of the prefix
    assert not torch.equal(pattern.expected(a, "x", 0, PS), pattern.expected(a, None, 0, PS))
    # a partial last page is not the whole page that starts with the same tokens
    whole = pattern.expected(a[: 3 * PS], None, 2 * PS, 3 * PS)
    part = pattern.expected(a[: 2 * PS + 2], None, 2 * PS, 2 * PS + 2)
    assert not torch.equal(part.view(torch.int16), whole[:, :, :2].view(torch.int16))
    # and the bounds' hashes are the page ids' whole pages
    ids = pattern.page_ids(a, None)
    assert len(ids) == 6
    assert np.array_equal(ids[:5], PrefixHasher(PS).hashes(a, None))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_values_are_finite_and_lanes_distinct(dtype):
    shape = KVShape(num_layers=3, num_heads=4, head_dim=8, dtype=dtype)
    pattern = PrefixKV(shape, PS)
    kv = pattern.expected(_toks(6, 64), "ns", 0, 64)
    assert kv.dtype == dtype and torch.isfinite(kv).all() and (kv >= 0).all()
    ints = kv.view(pattern.int_dtype)
    assert ((ints & ~MASK[kv.element_size()]) == 0).all()
    lanes = pattern.lanes.flatten().tolist()
    assert len(set(lanes)) == len(lanes)  # a swapped layer, K/V or head always differs


def test_cuda_style_views_of_odd_rows_compare_too():
    """Token rows whose bytes are not a multiple of 8 (heads x head_dim x 2 = 6 bytes) are
    compared in narrower words: still exact."""
    shape = KVShape(num_layers=1, num_heads=1, head_dim=3, dtype=torch.float16)
    pool = _pool(shape=shape)
    kv = ReplayKV(pool, shape)
    slots = _slots([5, 6, 7], 1)
    toks = _toks(7, len(slots))
    ids = _written(pool, kv, toks, slots)
    assert kv.verify(slots, ids, 0) is None
    pool.kv.view(torch.int16)[0, 1, int(slots[9]), 0, 2] ^= 4
    assert kv.verify(slots, ids, 0) == 9


def test_slot_runs_and_spans_refuse_slots_outside_the_pool():
    from asynccache.errors import InvalidInputError

    kv = ReplayKV(_pool(), SHAPE)
    assert kv.access.slot_runs(np.array([4, 5, 6, 9, 10, 3])) == [(0, 4, 3), (3, 9, 2), (5, 3, 1)]
    assert kv.access.slot_runs(np.array([], dtype=np.int64)) == []
    with pytest.raises(InvalidInputError, match=r"slot 256, out of the device pool's \[0, 256\)"):
        kv.access.slot_runs(np.array([1, 256]))
    with pytest.raises(InvalidInputError, match=r"span of slots \[250, 260\) is out of"):
        kv.access.span(250, 10)
    view = kv.access.span(8, 4)
    view.fill_(1.0)  # a live view: the pool changes
    assert (kv.access.device_pool.kv[:, :, 8:12] == 1.0).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fragmented", [False, True])
def test_write_and_verify_on_a_cuda_pool(fragmented, monkeypatch):
    if fragmented:
        monkeypatch.setattr(kvcheck, "_MAX_RUNS", 0)
    pool = DevicePool(SHAPE, 256, PS, device="cuda")
    kv = ReplayKV(pool, SHAPE)
    slots = _slots([9, 10, 2, 3, 20], 2)
    toks = _toks(8, len(slots))
    ids = _written(pool, kv, toks, slots)
    want = kv.pattern.expected(toks, None, 0, len(slots))
    assert torch.equal(kv.access.read_kv(slots).view(torch.int16), want.cpu().view(torch.int16))
    assert kv.verify(slots, ids, 0) is None
    pool.kv.view(torch.int16)[1, 1, int(slots[13]), 0, 0] ^= 2
    assert kv.verify(slots, ids, 0) == 13
