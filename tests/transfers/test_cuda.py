"""CopyEngine on a CUDA device pool with a pinned host pool (skipped without CUDA)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.pools import DevicePool, HostPool, KVShape

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PAGE = 16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a.cpu()), _bits(b.cpu()))


def _slots(pages: np.ndarray) -> np.ndarray:
    return (pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1)


def _fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
    t.view(torch.uint8).view(-1).copy_(raw.to(t.device))


def test_pools_on_cuda_are_pinned_and_on_device() -> None:
    shape = KVShape(2, 2, 64, "bf16")
    dev = DevicePool(shape, 4 * PAGE, PAGE)
    host = HostPool(shape, 4 * PAGE, PAGE)
    assert dev.device.type == "cuda" and dev.kv.is_cuda
    assert host.pinned and host.kv.is_pinned()


@pytest.mark.parametrize(("layout", "direct_dma", "zero_copy"), [
    ("layer_first", None, None), ("page_first", None, None), ("layer_first", False, None),
    ("page_first", False, None), ("page_first", True, False), ("layer_first", True, False),
    ("page_first", True, True), ("layer_first", True, True)])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
async def test_cuda_copies_are_bit_exact(layout: str, direct_dma: bool | None,
                                         zero_copy: bool | None, dtype: str) -> None:
    shape = KVShape(4, 2, 64, dtype)
    dev = DevicePool(shape, 32 * PAGE, PAGE)
    host = HostPool(shape, 48 * PAGE, PAGE, layout=layout)  # type: ignore[arg-type]
    _fill(dev.kv, 1)
    _fill(host.kv, 2)
    rng = np.random.default_rng(0)
    # a small ring: whole-page pieces of a few pages, and layer-by-layer pieces
    async with CopyEngine(dev, host, direct_dma=direct_dma, zero_copy=zero_copy,
                          staging_bytes=8 * host.page_bytes, staging_slots=2) as engine:
        assert engine.mode == "staged"
        assert engine.worker.direct == bool(direct_dma)  # type: ignore[union-attr]
        if direct_dma:  # the DMAs are raw cudaMemcpy(2D)Async calls on the runtime torch loaded
            assert engine.worker.copier.raw  # type: ignore[union-attr]
        for ring in engine.worker.rings:  # type: ignore[union-attr]
            assert ring.made == ring.count  # made at start: no allocation on the copy path
        for k in (1, 9, 32):
            d = _slots(rng.permutation(32)[:k])
            h = _slots(rng.permutation(48)[:k])
            if k == 9:  # runs of consecutive host pages
                h = _slots(np.array([40, 41, 42, 3, 4, 5, 6, 0, 47]))
            await engine.submit_d2h(d, h)
            assert _same(host.read_slots(h), dev.read_slots(d))
            h2 = _slots(rng.permutation(48)[:k])
            d2 = _slots(rng.permutation(32)[:k])
            await engine.submit_h2d(h2, d2)
            assert _same(dev.read_slots(d2), host.read_slots(h2))
            h3 = _slots(rng.permutation(48)[:k])
            d3 = _slots(rng.permutation(32)[:k])
            handle = engine.submit_h2d_layerwise(h3, d3)
            expected = host.read_slots(h3)
            for i in range(4):
                res = await handle.layer(i)
                assert res.layer == i
                assert _same(dev.read_slots(d3)[i], expected[i])
            await handle
            assert _same(dev.read_slots(d3), expected)
    assert not [t for t in threading.enumerate() if t.name.startswith("asynccache-copy")]


@pytest.mark.parametrize(("layout", "direct_dma"), [
    ("layer_first", None), ("page_first", None), ("page_first", False), ("layer_first", True)])
async def test_d2h_is_fenced_behind_the_compute_stream(layout: str,
                                                       direct_dma: bool | None) -> None:
    shape = KVShape(2, 8, 128, "fp16")  # 128 KiB pages: page_first goes the direct way
    dev = DevicePool(shape, 64 * PAGE, PAGE)
    host = HostPool(shape, 64 * PAGE, PAGE, layout=layout)  # type: ignore[arg-type]
    d = _slots(np.arange(64))
    async with CopyEngine(dev, host, direct_dma=direct_dma) as engine:
        direct = direct_dma if direct_dma is not None else layout == "page_first"
        assert engine.worker.direct == direct  # type: ignore[union-attr]
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute):
            torch.cuda._sleep(50_000_000)  # keep the compute stream busy
            dev.kv.fill_(3.0)  # the value a copy submitted afterwards must see
            handle = engine.submit_d2h(d, d)
        await handle
        assert bool((host.kv == 3.0).all())


@pytest.mark.parametrize("separate_lanes", [True, False])
async def test_many_concurrent_cuda_copies_retire_in_order(separate_lanes: bool) -> None:
    """In submission order per lane: every copy with one lane, the D->H and the H->D copies
    each with two (a load does not wait behind a backup to retire)."""
    shape = KVShape(2, 2, 64, "fp16")
    dev = DevicePool(shape, 16 * PAGE, PAGE)
    host = HostPool(shape, 16 * PAGE, PAGE)
    order: list[int] = []
    async with CopyEngine(dev, host, separate_lanes=separate_lanes) as engine:
        handles = []
        for i in range(64):
            p = np.array([i % 16])
            h = (
                engine.submit_d2h(_slots(p), _slots(p))
                if i % 2
                else engine.submit_h2d(_slots(p), _slots(p))
            )
            h.add_done_callback(lambda _h, i=i: order.append(i))
            handles.append(h)
        await asyncio.gather(*handles)
        await asyncio.sleep(0)
    if separate_lanes:
        assert [i for i in order if i % 2] == list(range(1, 64, 2))
        assert [i for i in order if not i % 2] == list(range(0, 64, 2))
    else:
        assert order == list(range(64))


@pytest.mark.parametrize(("layout", "direct_dma", "zero_copy"), [
    ("layer_first", None, None), ("page_first", False, None), ("page_first", True, False),
    ("page_first", True, True), ("layer_first", True, True)])
async def test_overlapping_cuda_copies_take_effect_in_submission_order(
    layout: str, direct_dma: bool | None, zero_copy: bool | None
) -> None:
    """120 random copies over few pages, none awaited before the next is submitted: the
    pools end as a sequential model says (host-page hazards, one copy stream)."""
    shape = KVShape(3, 2, 64, "fp16")
    dev = DevicePool(shape, 8 * PAGE, PAGE)
    host = HostPool(shape, 10 * PAGE, PAGE, layout=layout)  # type: ignore[arg-type]
    _fill(dev.kv, 5)
    _fill(host.kv, 6)
    model = {"dev": dev.page_view().cpu().clone(), "host": host.page_view().clone()}
    rng = np.random.default_rng(7)
    async with CopyEngine(dev, host, direct_dma=direct_dma, zero_copy=zero_copy,
                          staging_bytes=6 * host.page_bytes, staging_slots=2) as engine:
        handles = []
        for _ in range(120):
            k = int(rng.integers(1, 6))
            dp = rng.choice(8, size=k, replace=False)
            hp = rng.choice(10, size=k, replace=False)
            op = int(rng.integers(3))
            if op == 0:
                handles.append(engine.submit_d2h(_slots(dp), _slots(hp)))
                model["host"][:, :, hp] = model["dev"][:, :, dp]
            else:
                copy = engine.submit_h2d if op == 1 else engine.submit_h2d_layerwise
                handles.append(copy(_slots(hp), _slots(dp)))
                model["dev"][:, :, dp] = model["host"][:, :, hp]
        await asyncio.gather(*handles)
    assert _same(dev.page_view(), model["dev"])
    assert _same(host.page_view(), model["host"])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_a_forward_stream_waits_for_each_layer_on_the_device(layout: str) -> None:
    """``wait_layer(i, stream)`` from the forward's thread, then a kernel on that stream reads
    layer i: it sees the loaded KV although the thread did not wait for the copy to finish."""
    import asynccache.transfers.workers as workers

    layers = 8
    shape = KVShape(layers, 8, 128, "fp16")  # 512 KiB pages: page_first goes by direct DMA
    dev = DevicePool(shape, 64 * PAGE, PAGE)
    host = HostPool(shape, 64 * PAGE, PAGE, layout=layout)  # type: ignore[arg-type]
    _fill(host.kv, 12)
    d, h = _slots(np.arange(32)), _slots(np.random.default_rng(3).permutation(64)[:32])
    expected = host.read_slots(h)
    old = workers.LAYER_GROUP_BYTES
    workers.LAYER_GROUP_BYTES = 1  # one piece per layer
    try:
        async with CopyEngine(dev, host) as engine:
            load = engine.submit_h2d_layerwise(h, d)
            idx = torch.from_numpy(d).cuda()
            side = torch.cuda.Stream()
            seen: list[torch.Tensor] = []

            def forward() -> None:
                torch.cuda.set_device(dev.device)
                with torch.cuda.stream(side):
                    for i in range(layers):
                        load.wait_layer(i, side, timeout=30)
                        seen.append(dev.kv[i].index_select(1, idx))  # (2, n, H, D)
                side.synchronize()

            await asyncio.to_thread(forward)
            await load
    finally:
        workers.LAYER_GROUP_BYTES = old
    for i in range(layers):
        assert _same(seen[i], expected[i]), f"layer {i}"


async def test_a_forward_stream_waits_for_each_model_layer_of_a_mapped_hybrid_load() -> None:
    """A FULL + SWA load with the model's layer map: ``wait_layer(i, side)`` for each model
    layer, then a kernel on ``side`` reads that layer's own FULL or SWA layer: it sees the
    loaded KV (the SWA pool loaded layer by layer by its own engine)."""
    from asynccache.transfers.handles import LayeredGroup, layer_map

    layers = ("swa", "full", "full", "swa", "full", "swa", "full", "full")
    full_shape, swa_shape = KVShape(5, 8, 128, "fp16"), KVShape(3, 8, 128, "fp16")
    fdev, fhost = DevicePool(full_shape, 64 * PAGE, PAGE), HostPool(full_shape, 64 * PAGE, PAGE)
    sdev, shost = DevicePool(swa_shape, 32 * PAGE, PAGE), HostPool(swa_shape, 32 * PAGE, PAGE)
    _fill(fhost.kv, 21)
    _fill(shost.kv, 22)
    rng = np.random.default_rng(5)
    fd, fh = _slots(np.arange(32)), _slots(rng.permutation(64)[:32])
    sd, sh = _slots(np.arange(8)), _slots(rng.permutation(32)[:8])
    want = {"full": fhost.read_slots(fh), "swa": shost.read_slots(sh)}
    async with CopyEngine(fdev, fhost) as full, CopyEngine(sdev, shost) as swa:
        group = LayeredGroup({"full": full.submit_h2d_layerwise(fh, fd),
                              "swa": swa.submit_h2d_layerwise(sh, sd)}, layers)
        idx = {"full": torch.from_numpy(fd).cuda(), "swa": torch.from_numpy(sd).cuda()}
        pools = {"full": fdev, "swa": sdev}
        side = torch.cuda.Stream()
        seen: dict[tuple[str, int], torch.Tensor] = {}

        def forward() -> None:
            torch.cuda.set_device(fdev.device)
            with torch.cuda.stream(side):
                for i, (kind, k) in enumerate(layer_map(layers)):
                    group.wait_layer(i, side, timeout=30)
                    seen[kind, k] = pools[kind].kv[k].index_select(1, idx[kind])
            side.synchronize()

        await asyncio.to_thread(forward)
        await group
    for (kind, k), got in seen.items():
        assert _same(got, want[kind][k]), f"{kind} layer {k}"
    assert len(seen) == len(layers)


# --------------------------------------------------------------------------- issue 27
def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_pinned_host_pool_locks_exactly_its_bytes() -> None:
    """torch's pinned allocator rounds up to a power of two (1.5 GiB -> 2 GiB); the pool
    allocates exactly and registers the memory."""
    shape = KVShape(4, 8, 128, "fp16")  # 16 KiB per token
    tokens = (3 << 29) // shape.bytes_per_token  # 1.5 GiB
    before = _rss_bytes()
    host = HostPool(shape, tokens, PAGE)
    grown = _rss_bytes() - before
    assert host.pinned and host.kv.is_pinned()
    assert host.nbytes == 3 << 29
    assert grown < 1.25 * host.nbytes, f"RSS grew {grown} for a {host.nbytes}-byte pool"
    dev = DevicePool(shape, 64 * PAGE, PAGE)
    _fill(dev.kv, 5)
    del host


async def test_after_event_on_a_side_stream_fences_the_backup() -> None:
    shape = KVShape(2, 8, 128, "fp16")
    dev = DevicePool(shape, 64 * PAGE, PAGE)
    host = HostPool(shape, 64 * PAGE, PAGE)
    d = _slots(np.arange(64))
    side = torch.cuda.Stream()
    async with CopyEngine(dev, host, debug_fences=True) as engine:
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            dev.kv.fill_(5.0)
        done = side.record_event()
        handle = engine.submit_d2h(d, d, after=done)  # submitted on the default stream
        await handle
        assert bool((host.kv == 5.0).all())
        with pytest.raises(Exception, match="no explicit dependency"):
            engine.submit_d2h(d, d)
        with pytest.raises(Exception, match="never recorded"):
            engine.submit_d2h(d, d, after=torch.cuda.Event())
        engine.bind_compute_stream(side)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            dev.kv.fill_(6.0)
            await engine.submit_d2h(d, d)
        assert bool((host.kv == 6.0).all())


async def test_h2d_waits_for_a_kernel_still_reading_its_slots() -> None:
    shape = KVShape(2, 8, 128, "fp16")
    dev = DevicePool(shape, 16 * PAGE, PAGE)
    host = HostPool(shape, 16 * PAGE, PAGE)
    dev.kv.fill_(1.0)
    host.kv.fill_(2.0)
    side = torch.cuda.Stream()
    out = torch.empty_like(dev.kv)
    async with CopyEngine(dev, host) as engine:
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            out.copy_(dev.kv)  # the "attention" still reads the old KV
        await engine.submit_h2d_layerwise(_slots(np.arange(16)), _slots(np.arange(16)),
                                          after=side)
    torch.cuda.synchronize()
    assert bool((out == 1.0).all()) and bool((dev.kv == 2.0).all())


@pytest.mark.parametrize(("layout", "direct_dma"), [
    ("layer_first", None), ("page_first", None), ("layer_first", True)])
async def test_a_large_copy_goes_through_the_fixed_ring(layout: str,
                                                        direct_dma: bool | None) -> None:
    shape = KVShape(8, 8, 128, "bf16")  # 32 KiB per token, 512 KiB pages
    dev = DevicePool(shape, 8192, PAGE)  # 256 MiB
    host = HostPool(shape, 8192, PAGE, layout=layout)  # type: ignore[arg-type]
    _fill(dev.kv, 7)
    d = _slots(np.random.default_rng(0).permutation(8192 // PAGE))
    async with CopyEngine(dev, host, staging_bytes=16 << 20, staging_slots=4,
                          direct_dma=direct_dma) as engine:
        # page_first pinned pools of large pages go straight to / from their pages
        direct = direct_dma if direct_dma is not None else layout == "page_first"
        assert engine.worker.direct == direct  # type: ignore[union-attr]
        peaks = []
        for copy in (engine.submit_d2h, engine.submit_h2d_layerwise):
            if copy == engine.submit_h2d_layerwise:
                dev.kv.zero_()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            await copy(d, d)
            # the device side of the ring plus index buffers, not a copy-sized staging
            peaks.append(torch.cuda.max_memory_allocated() - base)
            # (read_slots makes a copy-sized tensor of its own: after the peak was read)
            assert _same(host.read_slots(d), dev.read_slots(d))
        for ring in engine.worker.rings:  # type: ignore[union-attr]
            assert ring.made <= 4 and ring.allocated_bytes <= 16 << 20
        assert max(peaks) < 64 << 20, peaks


async def test_state_copier_on_cuda_is_fenced_and_bit_exact() -> None:
    from asynccache.transfers.hybrid_copies import StateCopier, host_state_pool, state_bytes
    from asynccache.transfers.hybrid_pools import MambaStatePool

    dev = MambaStatePool(8, (16, 64), dtype=torch.float32, device="cuda")
    host = host_state_pool(dev, 8)
    assert host.states.is_pinned()
    copier = StateCopier(dev, host)
    await copier.start()
    try:
        assert copier.engine.mode == "staged"
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            dev.states[2].fill_(3.5)
        await copier.submit_d2h([2], [6], after=side)
        assert bool((host.states[6] == 3.5).all())
        await copier.submit_h2d([6], [0])
        assert state_bytes(dev, np.array([0])) == state_bytes(host, np.array([6]))
    finally:
        await copier.aclose()


async def test_an_engine_on_the_last_visible_device() -> None:
    """cuda:N-1 (cuda:1 on a two-GPU machine) while cuda:0 stays current on the loop's thread:
    the copy threads set their device, the fences are recorded on the pool's device."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    shape = KVShape(2, 2, 64, "fp16")
    dev = DevicePool(shape, 16 * PAGE, PAGE, device=device)
    host = HostPool(shape, 16 * PAGE, PAGE)
    assert dev.kv.device == device
    _fill(dev.kv, 3)
    d = _slots(np.arange(16))
    async with CopyEngine(dev, host) as engine:
        await engine.submit_d2h(d, d)
        assert _same(host.read_slots(d), dev.read_slots(d))
        want = dev.read_slots(d).clone()
        dev.kv.zero_()
        load = engine.submit_h2d_layerwise(d, d)
        for i in range(2):
            await load.layer(i)
        await load
        assert _same(dev.read_slots(d), want)


@pytest.mark.parametrize("zero_copy", [None, True, False])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_a_load_lands_while_a_backup_waits_for_its_fence(layout: str,
                                                               zero_copy: bool | None) -> None:
    """Separate lanes on the GPU: a backup fenced behind a long kernel on a side stream; a
    layer-wise load of other pages submitted after it lands first, bit-exact, and the
    backup then copies what the kernel wrote."""
    shape = KVShape(2, 8, 128, "fp16")  # 128 KiB pages: page_first goes by direct DMA
    dev = DevicePool(shape, 64 * PAGE, PAGE)
    host = HostPool(shape, 64 * PAGE, PAGE, layout=layout)  # type: ignore[arg-type]
    _fill(host.kv, 5)
    b, ld = _slots(np.arange(32)), _slots(np.arange(32, 64))
    side, idle = torch.cuda.Stream(), torch.cuda.Stream()
    async with CopyEngine(dev, host, zero_copy=zero_copy) as engine:
        assert engine.separate_lanes
        with torch.cuda.stream(side):
            torch.cuda._sleep(500_000_000)  # ~0.3 s on a 1.5-2 GHz GPU
            dev.kv[:, :, : 32 * PAGE].fill_(3.0)
        backup = engine.submit_d2h(b, b, after=side)
        load = engine.submit_h2d_layerwise(ld, ld, after=idle)
        await load
        assert not backup.finished
        assert _same(dev.read_slots(ld), host.read_slots(ld))
        await backup
    assert bool((host.read_slots(b) == 3.0).all())


@pytest.mark.parametrize(("layout", "zero_copy"), [
    ("layer_first", None), ("page_first", None), ("page_first", True), ("page_first", False)])
async def test_copies_after_start_allocate_no_device_memory(layout: str,
                                                            zero_copy: bool | None) -> None:
    """A device allocation (cudaMalloc) issued while a kernel runs keeps later commands of
    other streams from running beside it (CUDA's implicit synchronization): copies must
    allocate nothing once the engine started, or a load could wait for the model's forward.
    Counts the caching allocator's segments (each one a cudaMalloc) around copies of several
    sizes in both directions, after the first one of each kind (the warm-up is the start)."""
    shape = KVShape(4, 8, 128, "fp16")  # 128 KiB pages
    dev = DevicePool(shape, 64 * PAGE, PAGE)
    host = HostPool(shape, 96 * PAGE, PAGE, layout=layout)  # type: ignore[arg-type]
    _fill(host.kv, 9)
    rng = np.random.default_rng(4)
    async with CopyEngine(dev, host, zero_copy=zero_copy) as engine:
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats().get("segment.all.allocated", 0)
        for n in (1, 3, 17, 40, 64):
            d = _slots(rng.permutation(64)[:n])
            h = _slots(rng.permutation(96)[:n])
            await engine.submit_h2d_layerwise(h, d)
            await engine.submit_d2h(d, h)
            await engine.submit_h2d(h, d)
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    assert after == before, f"the copy path made {after - before} new device segments"


def test_device_alias_reads_and_writes_the_pinned_bytes() -> None:
    from asynccache.transfers.dma import device_alias
    from asynccache.transfers.pools import register_host_memory

    host = torch.arange(4096, dtype=torch.int64).view(64, 64)
    register_host_memory(host)
    alias = device_alias(host)
    assert alias.is_cuda and alias.data_ptr() == host.data_ptr()
    pages = torch.tensor([5, 63, 0, 17], device="cuda")
    got = torch.index_select(alias, 0, pages)
    assert torch.equal(got.cpu(), host[pages.cpu()])
    alias.index_copy_(0, pages, torch.full((4, 64), -1, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()
    assert bool((host[pages.cpu()] == -1).all()) and int(host[1, 0]) == 64
    with pytest.raises(Exception, match="not registered"):
        device_alias(torch.zeros(16))  # plain (pageable) memory
