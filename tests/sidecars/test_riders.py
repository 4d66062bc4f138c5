"""Riders at the copy-engine level (no cache): a sidecar pool's engine copies the same slots as
every submission to its source, in one handle, with both workers (direct, and the staged
pipeline that CUDA uses, here on CPU); a closed rider refuses a submission before anything is
queued; bad riders are a ConfigError."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from asynccache.errors import ClosedError, ConfigError, TransferError
from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.handles import GroupHandle, LayerwiseGroup
from asynccache.transfers.pools import DevicePool, HostPool, KVShape
from asynccache.transfers.sidecars import DeviceSidecarPool, HostSidecarPool, SidecarShape

PS = 4


def _pools(layers: int = 3):
    shape = KVShape(2, 2, 8, torch.float16)
    dev, host = DevicePool(shape, 64, PS, device="cpu"), HostPool(shape, 128, PS, pin_memory=False)
    sc = SidecarShape(layers, (2, 3), torch.float32)
    return dev, host, DeviceSidecarPool(sc, 64, PS), HostSidecarPool(sc, 128, PS)


@pytest.mark.parametrize("mode", ["direct", "staged"])
async def test_rider_copies_the_same_slots_both_ways(mode):
    dev, host, sdev, shost = _pools()
    g = torch.Generator().manual_seed(0)
    dev.kv.copy_(torch.randn(dev.kv.shape, generator=g).half())
    sdev.data.copy_(torch.randn(sdev.data.shape, generator=g))
    src = np.arange(8, 24, dtype=np.int64)  # 4 pages
    mid = np.arange(100, 116, dtype=np.int64)
    back = np.arange(40, 56, dtype=np.int64)
    want_kv, want_sc = dev.read_slots(src).clone(), sdev.read_slots(src).clone()
    async with CopyEngine(dev, host, mode=mode) as kv, \
            CopyEngine(sdev, shost, mode=mode, name="asynccache-copy-rider") as rider:  # type: ignore[arg-type]
        kv.add_rider(rider)
        h = kv.submit_d2h(src, mid)
        assert isinstance(h, GroupHandle) and len(h.parts) == 2
        res = await h
        assert res.num_bytes == 16 * (dev.shape.bytes_per_token + sdev.shape.bytes_per_token)
        assert torch.equal(shost.read_slots(mid), want_sc)
        lw = kv.submit_h2d_layerwise(mid, back)
        assert isinstance(lw, LayerwiseGroup) and lw.num_layers == 2
        await lw.layer(1)
        await lw.parts[1].layer(2)  # the rider's own layers (3 of them)
        await lw
        assert torch.equal(dev.read_slots(back), want_kv)
        assert torch.equal(sdev.read_slots(back), want_sc)
        await kv.submit_h2d(mid, src)
        assert rider.stats["d2h"].tokens == 16 and rider.stats["h2d_layerwise"].tokens == 16
        assert rider.stats["h2d"].tokens == 16


async def test_a_closed_rider_refuses_before_anything_is_queued():
    dev, host, sdev, shost = _pools()
    async with CopyEngine(dev, host) as kv:
        rider = CopyEngine(sdev, shost)  # type: ignore[arg-type]
        kv.add_rider(rider)  # never started
        with pytest.raises(ClosedError, match="is new"):
            kv.submit_d2h(np.arange(4), np.arange(4))
        assert kv.in_flight == 0 and kv.stats["d2h"].ops == 0


async def test_bad_riders_are_config_errors():
    dev, host, sdev, shost = _pools()
    kv = CopyEngine(dev, host)
    with pytest.raises(ConfigError, match="another CopyEngine"):
        kv.add_rider(kv)
    small = CopyEngine(DeviceSidecarPool(sdev.shape, 32, PS), shost)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="32 device slots < 64"):
        kv.add_rider(small)
    other_ps = CopyEngine(DeviceSidecarPool(sdev.shape, 64, 2),  # type: ignore[arg-type]
                          HostSidecarPool(sdev.shape, 128, 2))
    with pytest.raises(ConfigError, match="page_size 2 != 4"):
        kv.add_rider(other_ps)
    rider = CopyEngine(sdev, shost)  # type: ignore[arg-type]
    kv.add_rider(rider)
    with pytest.raises(ConfigError, match="another CopyEngine"):
        kv.add_rider(rider)
    assert kv.riders == (rider,)


async def test_a_direct_rider_copies_on_the_source_worker_thread_bit_exact(monkeypatch):
    """CPU pools: a rider's copies run on its source's worker thread, right after the source's
    copy (the rider's own threads take none), still bit-exact for fragmented and consecutive
    pages, whole and layer by layer, with the rider's own stats and layers."""
    from asynccache.transfers.workers import DirectWorker

    ran_on: list[tuple[str, str]] = []
    real = DirectWorker._copy

    def spy(self, job):
        ran_on.append((self.name, threading.current_thread().name))
        real(self, job)

    monkeypatch.setattr(DirectWorker, "_copy", spy)
    dev, host, sdev, shost = _pools()
    g = torch.Generator().manual_seed(5)
    dev.kv.copy_(torch.randn(dev.kv.shape, generator=g).half())
    sdev.data.copy_(torch.randn(sdev.data.shape, generator=g))
    pages = np.array([9, 2, 3, 4, 14, 0])  # fragmented, with a consecutive run
    src = (pages[:, None] * PS + np.arange(PS)).reshape(-1)
    mid = np.arange(40, 40 + src.shape[0], dtype=np.int64)  # consecutive
    back_pages = np.array([15, 13, 12, 11, 7, 5])  # device pages, another pattern
    back = (back_pages[:, None] * PS + np.arange(PS)).reshape(-1)
    want_kv, want_sc = dev.read_slots(src).clone(), sdev.read_slots(src).clone()
    async with CopyEngine(dev, host, name="src-copy") as kv, \
            CopyEngine(sdev, shost, name="rider-copy") as rider:  # type: ignore[arg-type]
        kv.add_rider(rider)
        await kv.submit_d2h(src, mid)
        assert torch.equal(host.read_slots(mid), want_kv)
        assert torch.equal(shost.read_slots(mid), want_sc)
        lw = kv.submit_h2d_layerwise(mid, back)
        for i in range(3):  # the rider's layers, each awaited on its own
            assert (await lw.parts[1].layer(i)).layer == i
        await lw
        assert torch.equal(dev.read_slots(back), want_kv)
        assert torch.equal(sdev.read_slots(back), want_sc)
        assert rider.stats["d2h"].ops == 1 and rider.stats["h2d_layerwise"].ops == 1
        assert rider.in_flight == 0 and kv.in_flight == 0
    assert [w for w, _ in ran_on] == ["src-copy", "rider-copy"] * 2
    assert {t for _, t in ran_on} == {"src-copy-worker"}


async def test_a_dead_source_worker_fails_the_copies_riding_it():
    """A source worker thread that dies fails the riders' copies that were to run on it too:
    no awaiter of a rider's handle waits forever, and the rider closes cleanly."""
    dev, host, sdev, shost = _pools()
    kv = CopyEngine(dev, host, name="dying-src")
    rider = CopyEngine(sdev, shost, name="rider")  # type: ignore[arg-type]
    await kv.start()
    await rider.start()
    kv.add_rider(rider)
    assert kv.worker is not None

    def broken(job, exc):
        raise RuntimeError("bug in the failure path")

    kv.worker.fail = broken  # type: ignore[method-assign]
    bad = kv.submit_d2h(np.arange(8), np.array([20, 21, 22, 23, 20, 21, 22, 23]))  # page twice
    later = kv.submit_h2d_layerwise(np.arange(8), np.arange(16, 24))
    assert isinstance(bad, GroupHandle) and isinstance(later, LayerwiseGroup)
    for h in (bad.parts[1], later.parts[1], later.parts[1].layer(0)):
        with pytest.raises(TransferError, match="died"):
            await asyncio.wait_for(h, 10)
    assert rider.in_flight == 0 and rider.dead is None
    await kv.aclose()
    await rider.aclose()
    assert rider.closed
