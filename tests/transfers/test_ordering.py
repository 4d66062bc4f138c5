"""Ordering of the copy engine under late, out-of-order completions (issue 27).

``LateStreams`` gives the staged pipeline CUDA's semantics on the CPU: everything queued on a
stream (the engine's copy stream, the test's "compute" streams) runs later, on another
thread, in stream order, after random delays, so work on different streams finishes out of
order. An ordering bug that a fast GPU would hide -- a copy not waiting for the kernel that
writes its source, a host read before the event of the copy that writes it -- shows up here as
wrong bytes. Every check compares real pool bytes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from asynccache.errors import ClosedError, InvalidInputError, TransferError
from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.pools import DevicePool, HostPool, KVShape
from asynccache.transfers.streams import LateEvent, LateStreams

PAGE = 4
HANG_GUARD_S = 30.0  # only so that a hang fails the test instead of the suite


@pytest.fixture
def late() -> Iterator[LateStreams]:
    streams = LateStreams(delay_s=(0.0, 0.004), seed=1)
    yield streams
    streams.close()


def _pools(layers: int = 3, layout: str = "layer_first", seed: int = 0,
           ) -> tuple[DevicePool, HostPool]:
    shape = KVShape(layers, 2, 8, "fp32")
    dev = DevicePool(shape, 24 * PAGE, PAGE, device="cpu")
    host = HostPool(shape, 40 * PAGE, PAGE, layout=layout)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)
    for pool in (dev, host):
        raw = pool.kv.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return dev, host


def _slots(pages: Any) -> np.ndarray:
    p = np.asarray(pages, dtype=np.int64)
    return (p[:, None] * PAGE + np.arange(PAGE)).reshape(-1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _engines(late: LateStreams) -> list[dict[str, Any]]:
    """Direct (CPU worker), staged on the CPU's streams, staged on late streams."""
    return [{"mode": "direct"}, {"mode": "staged"}, {"streams": late}]


async def _guard(aw: Any) -> Any:
    return await asyncio.wait_for(asyncio.ensure_future(aw), HANG_GUARD_S)


# --------------------------------------------------------------------------- host-page hazard
def _kinds(late: LateStreams) -> dict[str, dict[str, Any]]:
    """Direct (CPU worker), staged on the CPU's streams, staged on late streams, and the
    staged ones with direct DMA between the host pool and the device buffers (``*-dma``: a
    page_first host pool, ``*-dma-layer_first``: a layer_first one; see ``_layout``) and
    with zero-copy kernels instead of the DMAs (``*-zc``)."""
    return {"direct": {"mode": "direct"}, "staged": {"mode": "staged"}, "late": {"streams": late},
            "staged-dma": {"mode": "staged", "direct_dma": True, "zero_copy": False},
            "late-dma": {"streams": late, "direct_dma": True, "zero_copy": False},
            "late-dma-layer_first": {"streams": late, "direct_dma": True, "zero_copy": False},
            "late-zc": {"streams": late, "zero_copy": True},
            "late-zc-layer_first": {"streams": late, "zero_copy": True}}


def _layout(kind: str) -> str:
    return "page_first" if kind.endswith(("dma", "zc")) else "layer_first"


@pytest.mark.parametrize("kind", ["direct", "staged", "late", "late-dma", "late-dma-layer_first",
                                  "late-zc", "late-zc-layer_first"])
async def test_h2d_after_a_running_d2h_of_the_same_host_pages_loads_the_new_bytes(
    kind: str, late: LateStreams
) -> None:
    dev, host = _pools(seed=3, layout=_layout(kind))
    kw = _kinds(late)
    want = dev.read_slots(_slots([0, 1, 2])).clone()
    async with CopyEngine(dev, host, **kw[kind]) as engine:  # type: ignore[arg-type]
        backup = engine.submit_d2h(_slots([0, 1, 2]), _slots([7, 8, 9]))
        # Not awaited: the load-back reads host pages the backup is still writing.
        load = engine.submit_h2d(_slots([9, 7, 8]), _slots([20, 18, 19]))
        await _guard(asyncio.gather(backup, load))
        assert engine.ordered_by_host_pages == 1
    assert _same(dev.read_slots(_slots([18, 19, 20])), want)


async def test_d2h_into_host_pages_a_pending_h2d_reads_keeps_the_h2d_bytes(
    late: LateStreams,
) -> None:
    dev, host = _pools(seed=4)
    old_host = host.read_slots(_slots([5, 6])).clone()
    async with CopyEngine(dev, host, streams=late) as engine:
        load = engine.submit_h2d_layerwise(_slots([5, 6]), _slots([10, 11]))
        backup = engine.submit_d2h(_slots([0, 1]), _slots([6, 5]))
        await _guard(asyncio.gather(load, backup))
        assert engine.ordered_by_host_pages == 1
    assert _same(dev.read_slots(_slots([10, 11])), old_host)
    assert _same(host.read_slots(_slots([6, 5])), dev.read_slots(_slots([0, 1])))


@pytest.mark.parametrize(("kind", "layout"), [
    (k, lay) for k in ("direct", "staged", "late", "staged-dma", "late-dma", "late-zc")
    for lay in ("layer_first", "page_first")])
@pytest.mark.parametrize("slot_pages", [1.5, 4])
async def test_overlapping_copies_take_effect_in_submission_order(
    kind: str, layout: str, slot_pages: float, late: LateStreams
) -> None:
    """120 random copies over few pages, none awaited before the next is submitted: the
    pools must end as if each ran alone, in submission order (a sequential model). Copies
    retire in submission order per lane (staged: D->H and H->D have one each)."""
    dev, host = _pools(layout=layout, seed=5)
    model = {"dev": dev.page_view().clone(), "host": host.page_view().clone()}
    rng = np.random.default_rng(7)
    order: list[int] = []
    async with CopyEngine(dev, host, **_kinds(late)[kind],  # type: ignore[arg-type]
                          staging_bytes=int(2 * slot_pages * dev.page_bytes),
                          staging_slots=2) as engine:
        handles = []
        ops: list[int] = []
        for i in range(120):
            k = int(rng.integers(1, 6))
            dpages = rng.choice(8, size=k, replace=False)  # 8 device / 10 host pages: overlaps
            hpages = rng.choice(10, size=k, replace=False)
            op = int(rng.integers(3))
            ops.append(op)
            if op == 0:
                h: Any = engine.submit_d2h(_slots(dpages), _slots(hpages))
                model["host"][:, :, hpages] = model["dev"][:, :, dpages]
            elif op == 1:
                h = engine.submit_h2d(_slots(hpages), _slots(dpages))
                model["dev"][:, :, dpages] = model["host"][:, :, hpages]
            else:
                h = engine.submit_h2d_layerwise(_slots(hpages), _slots(dpages))
                model["dev"][:, :, dpages] = model["host"][:, :, hpages]
            h.add_done_callback(lambda _h, i=i: order.append(i))
            handles.append(h)
        await _guard(asyncio.gather(*handles))
        await asyncio.sleep(0)
        if engine.separate_lanes:
            for lane in ([0], [1, 2]):
                mine = [i for i in order if ops[i] in lane]
                assert mine == sorted(mine)
            assert sorted(order) == list(range(120))
            assert engine.ordered_by_device_pages > 0
        else:
            assert order == list(range(120))
        assert engine.ordered_by_host_pages > 0
    assert _same(dev.page_view(), model["dev"])
    assert _same(host.page_view(), model["host"])


# --------------------------------------------------------------------------- the fence contract
def _kernel_writes(late: LateStreams, stream: Any, dev: DevicePool, pages: list[int],
                   value: float, gate: threading.Event | None = None) -> None:
    """A late "kernel" on ``stream`` that fills device ``pages`` with ``value``."""
    slots = torch.from_numpy(_slots(pages))

    def kernel() -> None:
        if gate is not None:
            gate.wait(HANG_GUARD_S)
        dev.kv.index_fill_(2, slots, value)

    late.launch(stream, kernel)


@pytest.mark.parametrize("how", ["after_event", "after_stream", "after_list", "bound",
                                 "current"])
@pytest.mark.parametrize("mode", ["direct", "staged"])
async def test_d2h_waits_for_the_kernel_that_writes_its_source(
    how: str, mode: str, late: LateStreams
) -> None:
    dev, host = _pools(seed=6)
    side = late.new_stream("forward")
    other = late.new_stream("other")
    async with CopyEngine(dev, host, streams=late, mode=mode,  # type: ignore[arg-type]
                          compute_stream=side if how == "bound" else None) as engine:
        handles = []
        for rnd in range(4):
            # each round's kernel writes its own pages: the copies are still reading the
            # earlier rounds' ones (nothing orders a later kernel after a copy)
            pages = [3 * rnd, 3 * rnd + 1, 3 * rnd + 2]
            _kernel_writes(late, side, dev, pages, 10.0 + rnd)
            d, h = _slots(pages), _slots([p + 10 for p in pages])
            if how == "after_event":
                handles.append(engine.submit_d2h(d, h, after=side.record_event()))
            elif how == "after_stream":
                handles.append(engine.submit_d2h(d, h, after=side))
            elif how == "after_list":
                handles.append(engine.submit_d2h(d, h, after=[other, side.record_event()]))
            elif how == "bound":
                handles.append(engine.submit_d2h(d, h))
            else:  # the forward ran on the submitting thread's current stream
                with late.use(side):
                    handles.append(engine.submit_d2h(d, h))
        await _guard(asyncio.gather(*handles))
    for rnd in range(4):
        got = host.read_slots(_slots([3 * rnd + 10, 3 * rnd + 11, 3 * rnd + 12]))
        assert bool((got == 10.0 + rnd).all()), f"round {rnd} copied stale KV"


@pytest.mark.parametrize("mode", ["direct", "staged"])
async def test_the_implicit_fence_covers_only_the_current_stream(
    mode: str, late: LateStreams
) -> None:
    """What the contract is for: a forward on a side stream, a copy submitted without after=
    (its fence is on the current stream) reads the KV before the kernel wrote it."""
    dev, host = _pools(seed=7)
    side = late.new_stream("side")
    gate = threading.Event()
    before = dev.read_slots(_slots([4])).clone()
    async with CopyEngine(dev, host, streams=late, mode=mode) as engine:  # type: ignore[arg-type]
        _kernel_writes(late, side, dev, [4], 99.0, gate=gate)
        await _guard(engine.submit_d2h(_slots([4]), _slots([0])))
        gate.set()
        fenced = engine.submit_d2h(_slots([4]), _slots([1]), after=side)
        await _guard(fenced)
    assert _same(host.read_slots(_slots([0])), before)  # stale: not covered
    assert bool((host.read_slots(_slots([1])) == 99.0).all())


@pytest.mark.parametrize("layerwise", [False, True])
async def test_h2d_waits_for_kernels_still_reading_its_destination(
    layerwise: bool, late: LateStreams
) -> None:
    dev, host = _pools(seed=8)
    side = late.new_stream("attention")
    seen: list[torch.Tensor] = []
    old = dev.read_slots(_slots([2, 3])).clone()
    slots = torch.from_numpy(_slots([2, 3]))
    late.launch(side, lambda: seen.append(dev.kv.index_select(2, slots).clone()))
    async with CopyEngine(dev, host, streams=late) as engine:
        submit = engine.submit_h2d_layerwise if layerwise else engine.submit_h2d
        await _guard(submit(_slots([30, 31]), _slots([2, 3]), after=side))
    assert len(seen) == 1 and _same(seen[0], old)
    assert _same(dev.read_slots(_slots([2, 3])), host.read_slots(_slots([30, 31])))


async def test_debug_fences_reject_submissions_without_an_explicit_dependency(
    late: LateStreams,
) -> None:
    dev, host = _pools()
    side = late.new_stream("forward")
    async with CopyEngine(dev, host, streams=late, debug_fences=True) as engine:
        with pytest.raises(InvalidInputError, match="no explicit dependency"):
            engine.submit_d2h(_slots([0]), _slots([0]))
        with pytest.raises(InvalidInputError, match="was never recorded"):
            engine.submit_h2d(_slots([0]), _slots([0]), after=LateEvent("fresh"))
        await _guard(engine.submit_d2h(_slots([0]), _slots([0]), after=side))
        engine.bind_compute_stream(side)
        with pytest.raises(InvalidInputError, match="not covered"):
            engine.submit_d2h(_slots([0]), _slots([1]))  # the current stream is the default
        with late.use(side):
            await _guard(engine.submit_d2h(_slots([0]), _slots([1])))
        assert engine.in_flight == 0 and engine.stats["h2d"].ops == 0


async def test_after_must_be_an_event_or_a_stream(late: LateStreams,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    dev, host = _pools()
    async with CopyEngine(dev, host) as engine:
        with pytest.raises(InvalidInputError, match="after= must be a host event or stream"):
            engine.submit_d2h(_slots([0]), _slots([0]), after="stream0")
        assert engine.in_flight == 0
        # the CPU engine (direct worker) honours a late event by waiting for it
        side = late.new_stream("side")
        _kernel_writes(late, side, dev, [5], 42.0)
        await _guard(engine.submit_d2h(_slots([5]), _slots([9]), after=side.record_event()))
        assert bool((host.read_slots(_slots([9])) == 42.0).all())
    monkeypatch.setenv("ASYNCCACHE_DEBUG_FENCES", "1")
    assert CopyEngine(dev, host, streams=late).debug_fences
    with pytest.raises(Exception, match="compute_stream must be a late stream"):
        CopyEngine(dev, host, streams=late, compute_stream=object())


# --------------------------------------------------------------------------- layer readiness
@pytest.mark.parametrize(("layout", "direct_dma"), [
    ("layer_first", False), ("page_first", False), ("page_first", True)])
async def test_each_layer_is_in_place_when_its_await_returns(
    layout: str, direct_dma: bool, late: LateStreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asynccache.transfers.workers as workers

    monkeypatch.setattr(workers, "LAYER_GROUP_BYTES", 1)  # one piece per layer
    layers = 6
    dev, host = _pools(layers=layers, layout=layout, seed=9)
    h_src = _slots([31, 2, 17, 5, 6, 39])
    d_dst = _slots([3, 4, 5, 20, 1, 9])
    expected = host.read_slots(h_src).clone()
    async with CopyEngine(dev, host, streams=late, staging_bytes=2 * dev.page_bytes // layers,
                          staging_slots=2, direct_dma=direct_dma) as engine:
        load = engine.submit_h2d_layerwise(h_src, d_dst)
        for i in range(layers):
            res = await _guard(load.layer(i))
            assert res.layer == i
            got = dev.read_slots(d_dst)
            assert _same(got[: i + 1], expected[: i + 1]), f"layer {i} not in place"
        await _guard(load)
    assert _same(dev.read_slots(d_dst), expected)


# --------------------------------------------------------------------------- shutdown, death
@pytest.mark.parametrize("kind", ["direct", "late"])
async def test_aclose_with_late_copies_in_flight_waits_for_all_of_them(
    kind: str, late: LateStreams
) -> None:
    dev, host = _pools(seed=10)
    kw = {"direct": {"mode": "direct"}, "late": {"streams": late}}[kind]
    engine = CopyEngine(dev, host, name="asynccache-copy-late", **kw)  # type: ignore[arg-type]
    await engine.start()
    handles = [engine.submit_d2h(_slots([i % 24]), _slots([i % 40])) for i in range(30)]
    handles.append(engine.submit_h2d_layerwise(_slots([39]), _slots([23])))
    await _guard(engine.aclose())
    assert all(h.finished for h in handles)
    assert [h.result().num_tokens for h in handles] == [PAGE] * 31
    assert not any(t.is_alive() for t in engine.threads)
    assert _same(host.read_slots(_slots([5])), dev.read_slots(_slots([5])))
    with pytest.raises(ClosedError):
        engine.submit_d2h(_slots([0]), _slots([0]))


@pytest.mark.parametrize("kind", ["direct", "staged", "late"])
async def test_a_dead_copy_thread_fails_the_awaiting_coroutines(
    kind: str, late: LateStreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug that kills a copy thread (here: its own failure handling raises) must fail every
    copy in flight and every later submission, not leave coroutines waiting forever."""
    from asynccache.transfers.workers import WorkerBase

    def broken(self: WorkerBase, job: Any, exc: BaseException) -> None:
        raise RuntimeError("bug in the failure path")

    monkeypatch.setattr(WorkerBase, "fail", broken)
    dev, host = _pools(seed=11)
    kw = {"direct": {"mode": "direct"}, "staged": {"mode": "staged"}, "late": {"streams": late}}
    engine = CopyEngine(dev, host, name="asynccache-copy-dying", **kw[kind])  # type: ignore[arg-type]
    await engine.start()
    bad = engine.submit_d2h(_slots([0, 1]), _slots([5, 5]))  # a destination page twice
    queued = [engine.submit_h2d_layerwise(_slots([i]), _slots([i])) for i in range(3)]

    async def consumer(h: Any) -> str:
        try:
            await h.layer(1)
        except TransferError as exc:
            return str(exc)
        return "completed"

    outcomes = await _guard(asyncio.gather(consumer(queued[0]), consumer(queued[2]),
                                           return_exceptions=True))
    with pytest.raises(TransferError, match="died"):
        await _guard(bad)
    died = [o for o in outcomes if isinstance(o, str) and "died" in o]
    # a copy may have completed before the thread died; every other one failed
    assert len(died) + sum(o == "completed" for o in outcomes) == 2
    assert engine.dead is not None and "bug in the failure path" in str(engine.dead)
    with pytest.raises(TransferError, match="is dead"):
        engine.submit_d2h(_slots([0]), _slots([0]))
    assert engine.in_flight == 0
    await _guard(engine.aclose())
    assert engine.closed and not any(t.is_alive() for t in engine.threads)


# --------------------------------------------------------------------------- the staging ring
@pytest.mark.parametrize(("layout", "direct_dma"), [
    ("layer_first", False), ("page_first", False), ("page_first", True)])
@pytest.mark.parametrize("late_streams", [False, True])
async def test_large_copies_go_through_a_small_fixed_ring(
    layout: str, direct_dma: bool, late_streams: bool, late: LateStreams
) -> None:
    dev, host = _pools(layers=4, layout=layout, seed=12)
    kw: dict[str, Any] = {"streams": late} if late_streams else {"mode": "staged"}
    kw["direct_dma"] = direct_dma
    layer_page = dev.page_bytes // 4
    rng = np.random.default_rng(3)
    async with CopyEngine(dev, host, staging_bytes=6 * layer_page, staging_slots=2,
                          **kw) as engine:
        for _ in range(3):
            d = _slots(rng.permutation(24))
            h = _slots(rng.permutation(40)[:24])
            await _guard(engine.submit_d2h(d, h))
            assert _same(host.read_slots(h), dev.read_slots(d))
            h2 = _slots(rng.permutation(40)[:24])
            d2 = _slots(rng.permutation(24))
            await _guard(engine.submit_h2d(h2, d2))
            assert _same(dev.read_slots(d2), host.read_slots(h2))
            h3 = _slots(rng.permutation(40)[:24])
            d3 = _slots(rng.permutation(24))
            load = engine.submit_h2d_layerwise(h3, d3)
            for i in range(4):
                await _guard(load.layer(i))
                assert _same(dev.read_slots(d3)[i], host.read_slots(h3)[i])
            await _guard(load)
        # 24 pages x 4 layers = 96 layer-pages through slots of 3 layer-pages, two of them
        # in each lane's ring (D->H and H->D)
        rings = engine.worker.rings  # type: ignore[union-attr]
        assert len(rings) == 2
        for ring in rings:
            assert ring.slot_bytes == 3 * layer_page
            assert ring.made == 2 and ring.allocated_bytes == 6 * layer_page
            assert ring.in_use == 0


# --------------------------------------------------------------------------- direct DMA
def test_runs_cut_at_every_break_in_consecutive_ids() -> None:
    from asynccache.transfers.plan import runs

    assert runs(np.array([], dtype=np.int64)) == []
    assert runs(np.array([7])) == [(0, 7, 1)]
    pages = np.array([3, 4, 5, 9, 10, 2, 1, 2])
    assert runs(pages) == [(0, 3, 3), (3, 9, 2), (5, 2, 1), (6, 1, 2)]
    assert runs(pages, most=3) is None  # 4 runs, more than 3
    assert runs(pages, most=4) == runs(pages)


def test_segments_are_the_byte_ranges_of_runs_and_layer_groups() -> None:
    from asynccache.transfers.dma import layer_first_segments, page_first_segments

    pages = np.array([5, 6, 7, 2, 9, 10])
    # page_first, 4 layers of 10 bytes a page: page p at 40 p; a run of whole pages is one
    # row (host offset, slot offset, width, rows, host pitch, slot pitch)
    assert page_first_segments(pages, (0, 4), 4, 10) == [
        (200, 0, 120, 1, 120, 120), (80, 120, 40, 1, 40, 40), (360, 160, 80, 1, 80, 80)]
    # layers 1..3: 20 bytes at 40 p + 10 a page, a run one 2D copy of a row per page
    assert page_first_segments(pages, (1, 3), 4, 10) == [
        (210, 0, 20, 3, 40, 20), (90, 60, 20, 1, 40, 20), (370, 80, 20, 2, 40, 20)]
    assert page_first_segments(np.array([], dtype=np.int64), (0, 4), 4, 10) == []
    # layer_first (L, 2, 12 pages, 10 bytes): (layer l, K/V k, page p) at ((2 l + k) 12 + p) 10;
    # the slot holds (layers, 2, n, 10): a run is one 2D copy of a row per (layer, K/V)
    assert layer_first_segments(pages[:4], (1, 3), 2, 10, 12) == [
        (290, 0, 30, 4, 120, 40), (260, 30, 10, 4, 120, 40)]
    assert layer_first_segments(pages, (0, 4), 2, 10, 12) == [
        (50, 0, 30, 8, 120, 60), (20, 30, 10, 8, 120, 60), (90, 40, 20, 8, 120, 60)]


def test_segment_copier_moves_exactly_the_segments_on_the_cpu() -> None:
    from asynccache.transfers.dma import SegmentCopier

    host = torch.arange(64, dtype=torch.uint8)
    dev = torch.zeros(16, dtype=torch.uint8)
    copier = SegmentCopier(host, cuda=False)
    assert not copier.raw
    copier.copy([(10, 0, 4, 1, 4, 4), (40, 4, 8, 1, 8, 8)], dev, False, None)
    assert dev.tolist() == [10, 11, 12, 13, *range(40, 48), 0, 0, 0, 0]
    copier.copy([(0, 4, 2, 1, 2, 2)], dev, True, None)
    assert host[:4].tolist() == [40, 41, 2, 3]
    # 2D: 3 rows of 2 bytes, host rows 10 apart, slot rows 4 apart, both ways
    dev.zero_()
    copier.copy([(20, 1, 2, 3, 10, 4)], dev, False, None)
    assert dev.tolist() == [0, 20, 21, 0, 0, 30, 31, 0, 0, 40, 41, 0, 0, 0, 0, 0]
    copier.copy([(50, 5, 2, 2, 7, 4)], dev, True, None)
    assert host[50:60].tolist() == [30, 31, 52, 53, 54, 55, 56, 40, 41, 59]
    with pytest.raises(ValueError, match="contiguous uint8"):
        SegmentCopier(torch.zeros(4, dtype=torch.int32), cuda=False)


def test_direct_dma_is_chosen_for_pinned_page_first_pools_of_large_pages() -> None:
    from asynccache.transfers.staged import DIRECT_MIN_BYTES, wants_direct_dma

    def pool(layout: str = "page_first", pinned: bool = True,
             page_bytes: int = DIRECT_MIN_BYTES) -> Any:
        return SimpleNamespace(layout=layout, pinned=pinned, page_bytes=page_bytes)

    assert wants_direct_dma(None, pool(), cuda=True)
    assert not wants_direct_dma(None, pool(), cuda=False)
    assert not wants_direct_dma(None, pool(layout="layer_first"), cuda=True)
    assert not wants_direct_dma(None, pool(pinned=False), cuda=True)
    assert not wants_direct_dma(None, pool(page_bytes=DIRECT_MIN_BYTES - 1), cuda=True)
    assert not wants_direct_dma(False, pool(), cuda=True)
    assert wants_direct_dma(True, pool(pinned=False), cuda=False)
    assert wants_direct_dma(True, pool(layout="layer_first"), cuda=True)  # forced only


def test_a_filled_ring_hands_out_its_slots_without_allocating() -> None:
    """StagingRing.fill (what a CUDA worker does at start): every slot made at once, and
    acquire / release reuse them."""
    from asynccache.transfers.staged import StagingRing
    from asynccache.transfers.streams import HostStreams

    worker = SimpleNamespace(cv=threading.Condition(), dead=None)
    ring = StagingRing(worker, HostStreams(), 3, 1024, 8, torch.device("cpu"))  # type: ignore[arg-type]
    ring.fill()
    assert ring.made == 3 and len(ring._free) == 3 and ring.allocated_bytes == 3 * 1024
    made = ring._new
    ring._new = None  # type: ignore[assignment,method-assign]  # no more slots may be made
    slots = [ring.acquire() for _ in range(3)]
    assert len({id(s) for s in slots}) == 3 and ring.in_use == 3
    for s in slots:
        ring.release(s)
    assert ring.in_use == 0 and ring.acquire() in slots
    ring.fill()  # full already: nothing more
    assert ring.made == 3 and made is not None


@pytest.mark.parametrize(("layout", "direct_dma"), [
    ("layer_first", False), ("page_first", True), ("layer_first", True)])
async def test_warm_up_runs_the_copy_kernels_and_leaves_the_pools_alone(
    layout: str, direct_dma: bool
) -> None:
    """What a CUDA worker runs at start (torch loads kernels lazily, and loading one may wait
    for the device): every layer range and piece size it tries, without a byte of either
    pool changed and with its slot back in the ring."""
    dev, host = _pools(layers=4, layout=layout, seed=41)
    before = dev.page_view().clone(), host.page_view().clone()
    async with CopyEngine(dev, host, mode="staged", direct_dma=direct_dma,
                          staging_bytes=8 * dev.page_bytes, staging_slots=2) as engine:
        worker = engine.worker
        worker.warm_up()  # type: ignore[union-attr]
        assert worker.lanes[0].ring.in_use == 0  # type: ignore[union-attr]
        assert _same(dev.page_view(), before[0]) and _same(host.page_view(), before[1])
        d, h = _slots([3, 9, 1]), _slots([20, 4, 33])
        await _guard(engine.submit_d2h(d, h))  # and the engine works as before
        assert _same(host.read_slots(h), dev.read_slots(d))


def test_zero_copy_is_preferred_for_pieces_of_short_runs() -> None:
    from asynccache.transfers.dma import ZERO_COPY_BELOW, prefers_zero_copy, run_count

    assert run_count(np.array([], dtype=np.int64)) == 0
    assert run_count(np.array([4])) == 1
    assert run_count(np.array([4, 5, 6, 9, 10, 3, 2])) == 4
    big = ZERO_COPY_BELOW
    assert not prefers_zero_copy(0, 0)
    assert not prefers_zero_copy(1, 10)  # one run: one DMA
    assert prefers_zero_copy(2, 20)
    assert not prefers_zero_copy(2, 2 * big)
    assert prefers_zero_copy(3, 3 * big - 1)


@pytest.mark.parametrize(("zero_copy", "contiguous", "dmas"), [
    (None, True, True), (None, False, False), (False, False, True), (True, True, False)])
async def test_zero_copy_replaces_the_dmas_of_the_pieces_it_takes(
    zero_copy: bool | None, contiguous: bool, dmas: bool, late: LateStreams,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Left to choose, the engine moves a piece of scattered host pages by one kernel and a
    run of consecutive pages by one DMA; forced, it does what it is told. Bit-exact both."""
    from asynccache.transfers.dma import SegmentCopier

    issued: list[int] = []
    real = SegmentCopier.copy

    def counting(self: Any, segs: Any, *args: Any) -> None:
        issued.append(len(segs))
        real(self, segs, *args)

    monkeypatch.setattr(SegmentCopier, "copy", counting)
    dev, host = _pools(layout="page_first", seed=23)
    h = _slots(np.arange(10, 16) if contiguous else np.array([30, 2, 17, 5, 9, 38]))
    d = _slots(np.array([3, 0, 7, 1, 12, 5]))
    async with CopyEngine(dev, host, streams=late, direct_dma=True,
                          zero_copy=zero_copy) as engine:
        await _guard(engine.submit_d2h(d, h))
        assert _same(host.read_slots(h), dev.read_slots(d))
        d2 = _slots(np.array([20, 21, 4, 9, 11, 2]))
        await _guard(engine.submit_h2d(h, d2))
        assert _same(dev.read_slots(d2), host.read_slots(h))
    assert bool(issued) == dmas, issued


def test_bad_zero_copy_settings_are_config_errors() -> None:
    from asynccache.errors import ConfigError

    dev, host = _pools(layout="page_first")
    with pytest.raises(ConfigError, match="zero_copy must be None, True or False, got 1"):
        CopyEngine(dev, host, mode="staged", zero_copy=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot be combined with direct_dma=False"):
        CopyEngine(dev, host, mode="staged", zero_copy=True, direct_dma=False)


def test_bad_direct_dma_settings_are_config_errors() -> None:
    from asynccache.errors import ConfigError

    dev, host = _pools(layout="page_first")
    with pytest.raises(ConfigError, match="direct_dma must be None, True or False, got 'yes'"):
        CopyEngine(dev, host, mode="staged", direct_dma="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="applies to mode='staged'"):
        CopyEngine(dev, host, mode="direct", direct_dma=True)
    assert CopyEngine(dev, host, mode="direct", direct_dma=False).mode == "direct"


@pytest.mark.parametrize("zero_copy", [False, True, None])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_direct_dma_moves_whole_runs_and_layer_groups_bit_exact(
    layout: str, zero_copy: bool | None, late: LateStreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of consecutive host pages in both directions, whole copies and a layer-wise load
    (one piece per layer), on late streams: every byte where the gather / scatter puts it --
    by DMA segments, by zero-copy kernels, and as chosen per piece."""
    import asynccache.transfers.workers as workers

    monkeypatch.setattr(workers, "LAYER_GROUP_BYTES", 1)  # one piece per layer
    dev, host = _pools(layers=4, layout=layout, seed=21)
    d = _slots([3, 4, 5, 0, 9, 10, 11, 12, 1])
    h = _slots([20, 21, 22, 23, 5, 6, 39, 0, 1])
    async with CopyEngine(dev, host, streams=late, direct_dma=True, zero_copy=zero_copy,
                          staging_bytes=2 * dev.page_bytes, staging_slots=2) as engine:
        assert engine.worker.direct  # type: ignore[union-attr]
        await _guard(engine.submit_d2h(d, h))
        assert _same(host.read_slots(h), dev.read_slots(d))
        d2 = _slots([14, 15, 16, 17, 18, 19, 2, 7, 8])
        await _guard(engine.submit_h2d(h, d2))
        assert _same(dev.read_slots(d2), host.read_slots(h))
        h3 = _slots([30, 31, 32, 7, 8, 2])
        d3 = _slots([20, 21, 22, 23, 6, 13])
        load = engine.submit_h2d_layerwise(h3, d3)
        for i in range(4):
            await _guard(load.layer(i))
            assert _same(dev.read_slots(d3)[i], host.read_slots(h3)[i])
        await _guard(load)
        for ring in engine.worker.rings:  # type: ignore[union-attr]
            assert ring.allocated_bytes > 0
            assert ring._free[0].host.numel() == 0


# --------------------------------------------------------------------------- device-side layers
@pytest.mark.parametrize("kind", ["direct", "late", "late-dma", "late-dma-layer_first",
                                  "late-zc", "late-zc-layer_first"])
async def test_a_forward_waiting_on_the_device_sees_each_layer_in_place(
    kind: str, late: LateStreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wait_layer(i, stream)`` from the forward's thread, then a "kernel" queued on that
    stream reads layer i: it must see the loaded bytes, every layer, although the thread only
    waited until the layer's copy was queued (late streams: it runs later, out of order)."""
    import asynccache.transfers.workers as workers

    monkeypatch.setattr(workers, "LAYER_GROUP_BYTES", 1)  # one piece per layer
    layers = 6
    dev, host = _pools(layers=layers, seed=31,
                       layout=_layout(kind))
    h_src, d_dst = _slots([31, 2, 17, 5, 6, 39]), _slots([3, 4, 5, 20, 1, 9])
    expected = host.read_slots(h_src).clone()
    forward = late.new_stream("forward")
    seen: list[Any] = [None] * layers
    async with CopyEngine(dev, host, **_kinds(late)[kind],  # type: ignore[arg-type]
                          staging_bytes=2 * dev.page_bytes // layers, staging_slots=2) as engine:
        load = engine.submit_h2d_layerwise(h_src, d_dst)

        def run_forward() -> None:
            for i in range(layers):
                load.wait_layer(i, forward, timeout=HANG_GUARD_S)

                def attention(i: int = i) -> None:
                    seen[i] = dev.read_slots(d_dst)[i].clone()

                late.launch(forward, attention)
            forward.synchronize()

        await asyncio.to_thread(run_forward)
        await _guard(load)
    for i in range(layers):
        assert _same(seen[i], expected[i]), f"layer {i} read before it was in place"


async def test_wait_layer_on_the_loop_thread_hands_over_the_held_back_copy(
    late: LateStreams,
) -> None:
    dev, host = _pools(seed=32)
    async with CopyEngine(dev, host, streams=late) as engine:
        first = engine.submit_h2d_layerwise(_slots([1, 2]), _slots([3, 4]))
        # held back until this loop iteration ends, which a blocked loop thread never reaches
        second = engine.submit_h2d_layerwise(_slots([5, 6]), _slots([7, 8]))
        second.wait_layer(2, late.new_stream("forward"), timeout=HANG_GUARD_S)
        await _guard(asyncio.gather(first, second))
        assert _same(dev.read_slots(_slots([7, 8])), host.read_slots(_slots([5, 6])))


async def test_wait_layer_times_out_fails_and_checks_its_layer(
    late: LateStreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asynccache.transfers.workers import WorkerBase

    dev, host = _pools(seed=33)
    side = late.new_stream("side")
    gate = threading.Event()
    _kernel_writes(late, side, dev, [9], 1.0, gate)
    async with CopyEngine(dev, host, streams=late, mode="direct") as engine:
        # the direct worker blocks on the fence until the gated kernel ran
        load = engine.submit_h2d_layerwise(_slots([0]), _slots([0]), after=side.record_event())
        with pytest.raises(TimeoutError, match="layer 0 of the load was not queued within"):
            await asyncio.to_thread(load.wait_layer, 0, None, timeout=0.2)
        with pytest.raises(InvalidInputError, match="layer 3 out of range"):
            load.wait_layer(3)
        gate.set()
        await _guard(load)
        load.wait_layer(2)  # in place: returns at once (CPU pools: nothing to wait for)
        assert not hasattr(engine.submit_d2h(_slots([0]), _slots([0])), "wait_layer")

    def broken(self: WorkerBase, job: Any, exc: BaseException) -> None:
        raise RuntimeError("bug in the failure path")

    monkeypatch.setattr(WorkerBase, "fail", broken)
    engine = CopyEngine(dev, host, mode="direct")
    await engine.start()
    bad = engine.submit_d2h(_slots([0, 1]), _slots([5, 5]))  # kills the one copy thread
    load = engine.submit_h2d_layerwise(_slots([1]), _slots([1]))
    with pytest.raises(TransferError, match=r"layer 1 of the load failed.*died"):
        await asyncio.to_thread(load.wait_layer, 1, None, timeout=HANG_GUARD_S)
    with pytest.raises(TransferError):
        await _guard(bad)
    await _guard(engine.aclose())


# --------------------------------------------------------------------------- separate lanes
@pytest.mark.parametrize("kind", ["staged", "late", "late-dma", "late-dma-layer_first",
                                  "late-zc"])
async def test_a_load_does_not_queue_behind_a_held_back_backup(
    kind: str, late: LateStreams
) -> None:
    """A backup waits for a forward kernel that has not run (its fence); a load-back of
    other pages submitted after it must land meanwhile: D->H and H->D have separate lanes
    (threads, staging rings and copy streams), so a load never waits behind backups."""
    dev, host = _pools(seed=41, layout=_layout(kind))
    side = late.new_stream("forward")
    gate = threading.Event()
    _kernel_writes(late, side, dev, [0, 1], 7.0, gate)
    async with CopyEngine(dev, host, **_kinds(late)[kind]) as engine:  # type: ignore[arg-type]
        backup = engine.submit_d2h(_slots([0, 1]), _slots([0, 1]), after=side)
        load = engine.submit_h2d_layerwise(_slots([30, 31]), _slots([10, 11]),
                                           after=late.new_stream("idle"))
        try:
            await asyncio.wait_for(asyncio.ensure_future(load), 10.0)
            assert not backup.finished
        finally:
            gate.set()
        await _guard(backup)
    assert _same(dev.read_slots(_slots([10, 11])), host.read_slots(_slots([30, 31])))
    assert bool((host.read_slots(_slots([0, 1])) == 7.0).all())


@pytest.mark.parametrize("kind", ["late", "late-dma", "late-dma-layer_first", "late-zc",
                                  "late-zc-layer_first"])
async def test_copies_of_the_same_device_pages_in_the_two_lanes_keep_submission_order(
    kind: str, late: LateStreams
) -> None:
    """A backup reads device pages that a later load overwrites (the pages were freed and
    reused), and a later backup reads pages an earlier load writes: the lanes must order
    them by device page, or the backups copy the wrong KV."""
    dev, host = _pools(seed=42, layout=_layout(kind))
    old = dev.read_slots(_slots([4, 5])).clone()
    loaded = host.read_slots(_slots([20, 21])).clone()
    async with CopyEngine(dev, host, **_kinds(late)[kind]) as engine:  # type: ignore[arg-type]
        first = engine.submit_d2h(_slots([4, 5]), _slots([0, 1]))
        load = engine.submit_h2d(_slots([20, 21]), _slots([4, 5]))
        second = engine.submit_d2h(_slots([5, 4]), _slots([2, 3]))
        await _guard(asyncio.gather(first, load, second))
        assert engine.ordered_by_device_pages == 2
    assert _same(host.read_slots(_slots([0, 1])), old)
    assert _same(host.read_slots(_slots([3, 2])), loaded)


@pytest.mark.parametrize("kind", ["late", "late-dma"])
async def test_layer_events_are_reused_across_loads(
    kind: str, late: LateStreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The events of a load's layers go back to a pool once the load landed: later loads
    allocate none, and waiting on a landed layer still returns (nothing left to wait for)."""
    import asynccache.transfers.workers as workers

    monkeypatch.setattr(workers, "LAYER_GROUP_BYTES", 1)  # one piece, one event per layer
    made: list[Any] = []
    real_event = late.event

    def counting() -> Any:
        made.append(real_event())
        return made[-1]

    monkeypatch.setattr(late, "event", counting)
    dev, host = _pools(layers=4, seed=51, layout=_layout(kind))
    forward = late.new_stream("forward")
    async with CopyEngine(dev, host, **_kinds(late)[kind]) as engine:  # type: ignore[arg-type]
        # staging slots (an event each) are made as copies need them, as many as the issuer
        # gets ahead of the completer: make them all now, so that only layer events count
        for ring in engine.worker.rings:  # type: ignore[union-attr]
            ring.fill()
        counts = []
        for i in range(5):
            load = engine.submit_h2d_layerwise(_slots([i, i + 5]), _slots([2 * i, 2 * i + 1]))
            await _guard(load)
            counts.append(len(made))
            await asyncio.to_thread(load.wait_layer, 3, forward, timeout=HANG_GUARD_S)
            assert _same(dev.read_slots(_slots([2 * i, 2 * i + 1])),
                         host.read_slots(_slots([i, i + 5])))
        assert counts[1:] == [counts[0]] * 4, counts
