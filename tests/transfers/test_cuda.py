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


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
async def test_cuda_copies_are_bit_exact(layout: str, dtype: str) -> None:
    shape = KVShape(4, 2, 64, dtype)
    dev = DevicePool(shape, 32 * PAGE, PAGE)
    host = HostPool(shape, 48 * PAGE, PAGE, layout=layout)  # type: ignore[arg-type]
    _fill(dev.kv, 1)
    _fill(host.kv, 2)
    rng = np.random.default_rng(0)
    async with CopyEngine(dev, host) as engine:
        assert engine.mode == "staged"
        for k in (1, 9, 32):
            d = _slots(rng.permutation(32)[:k])
            h = _slots(rng.permutation(48)[:k])
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


async def test_d2h_is_fenced_behind_the_compute_stream() -> None:
    shape = KVShape(2, 8, 128, "fp16")
    dev = DevicePool(shape, 64 * PAGE, PAGE)
    host = HostPool(shape, 64 * PAGE, PAGE)
    d = _slots(np.arange(64))
    async with CopyEngine(dev, host) as engine:
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute):
            torch.cuda._sleep(50_000_000)  # keep the compute stream busy
            dev.kv.fill_(3.0)  # the value a copy submitted afterwards must see
            handle = engine.submit_d2h(d, d)
        await handle
        assert bool((host.kv == 3.0).all())


async def test_many_concurrent_cuda_copies_retire_in_order() -> None:
    shape = KVShape(2, 2, 64, "fp16")
    dev = DevicePool(shape, 16 * PAGE, PAGE)
    host = HostPool(shape, 16 * PAGE, PAGE)
    order: list[int] = []
    async with CopyEngine(dev, host) as engine:
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
    assert order == list(range(64))
