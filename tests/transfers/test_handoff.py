"""CopyEngine hand-off: copies submitted in one loop iteration reach the worker in batches."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.pools import DevicePool, HostPool, KVShape

PAGE = 4


def _pools() -> tuple[DevicePool, HostPool]:
    shape = KVShape(2, 2, 8, "fp16")
    dev = DevicePool(shape, 16 * PAGE, PAGE, device="cpu")
    host = HostPool(shape, 16 * PAGE, PAGE)
    g = torch.Generator().manual_seed(3)
    raw = host.kv.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return dev, host


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))  # random bits hold NaNs


def _page(i: int) -> np.ndarray:
    return np.arange(i * PAGE, (i + 1) * PAGE)


def _count_handoffs(engine: CopyEngine) -> list[int]:
    """Sizes of the batches the engine hands to its worker, in order."""
    worker: Any = engine.worker
    sizes: list[int] = []
    inner = worker.submit_many

    def counting(jobs: list[Any]) -> None:
        sizes.append(len(jobs))
        inner(jobs)

    worker.submit_many = counting
    return sizes


@pytest.mark.parametrize("mode", ["direct", "staged"])
async def test_one_iterations_copies_take_two_handoffs_and_keep_their_order(mode: str) -> None:
    dev, host = _pools()
    async with CopyEngine(dev, host, mode=mode) as engine:  # type: ignore[arg-type]
        sizes = _count_handoffs(engine)
        handles = [engine.submit_h2d(_page(i), _page(i)) for i in range(6)]
        assert sizes == [1]  # the first copy is handed over at once, the rest wait
        results = [await h for h in handles]
        assert sizes == [1, 5]  # the rest of the iteration's copies: one batch
        # the next iteration starts a new batch
        more = [engine.submit_h2d(_page(i), _page(i + 8)) for i in range(3)]
        for h in more:
            await h
        assert sizes == [1, 5, 1, 2]
    assert [r.num_tokens for r in results] == [PAGE] * 6
    assert _same(dev.read_slots(np.arange(6 * PAGE)), host.read_slots(np.arange(6 * PAGE)))
    assert _same(dev.read_slots(np.arange(8 * PAGE, 11 * PAGE)), host.read_slots(np.arange(3 * PAGE)))


async def test_close_in_the_submitting_iteration_completes_every_copy() -> None:
    dev, host = _pools()
    engine = CopyEngine(dev, host)
    await engine.start()
    handles = [engine.submit_h2d(_page(i), _page(i)) for i in range(4)]
    await engine.aclose()  # the batch not handed over yet goes before the stop
    for h in handles:
        assert h.finished
        assert (await h).num_tokens == PAGE
    assert _same(dev.read_slots(np.arange(4 * PAGE)), host.read_slots(np.arange(4 * PAGE)))
