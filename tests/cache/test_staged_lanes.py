"""The cache's random workloads with every copy engine on the staged pipeline (the CUDA path:
separate D->H / H->D lanes, fences, staging rings), run on the CPU under ``LateStreams``, where
every copy completes late and the two lanes finish out of order with each other. Whatever the
cache serves must still be bit for bit the KV of its tokens, with the invariants after every
step: the cache may not rely on copies of different directions completing in submission
order. (On CPU pools the cache's engines are otherwise direct, one lane.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.staged import StagedWorker
from asynccache.transfers.streams import LateStreams
from tests.cache import test_hybrid_host_random, test_lifecycle_random


@pytest.fixture(params=["staging", "dma", "zero_copy"])
def late_engines(request: pytest.FixtureRequest,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CopyEngine]]:
    """Every CopyEngine made during the test runs staged on one set of late streams: through
    the staging path, or on the direct path by DMA segments only or with every piece
    zero-copy (the index kernels between the host pool's own bytes and the slots)."""
    streams = LateStreams(delay_s=(0.0, 0.002), seed=5)
    made: list[CopyEngine] = []
    real = CopyEngine.__init__

    def init(self: CopyEngine, device_pool: Any, host_pool: Any, **kw: Any) -> None:
        if kw.get("streams") is None:
            kw["streams"] = streams
            if request.param != "staging":  # the direct path, by DMA or zero-copy kernels
                kw["zero_copy"] = request.param == "zero_copy"
                kw["direct_dma"] = True
        real(self, device_pool, host_pool, **kw)
        made.append(self)

    direct_pieces: list[int] = []
    real_issue = StagedWorker._issue_direct

    def issue_direct(self: StagedWorker, *args: Any) -> None:
        direct_pieces.append(1)
        real_issue(self, *args)

    monkeypatch.setattr(CopyEngine, "__init__", init)
    monkeypatch.setattr(StagedWorker, "_issue_direct", issue_direct)
    yield made
    streams.close()
    assert bool(direct_pieces) == (request.param != "staging")


@pytest.mark.parametrize("seed", range(2))
async def test_random_lifecycles_on_late_staged_lanes(
    make_cache: Any, kit: Any, seed: int, late_engines: list[CopyEngine]
) -> None:
    await test_lifecycle_random.test_random_lifecycles(make_cache, kit, seed)
    assert late_engines and all(e.mode == "staged" and e.separate_lanes for e in late_engines)
    assert sum(e.stats["d2h"].ops for e in late_engines) > 0
    assert sum(e.stats["h2d_layerwise"].ops for e in late_engines) > 0


@pytest.mark.parametrize("combo", ["full+swa+mamba"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
async def test_random_hybrid_host_workload_on_late_staged_lanes(
    make_cache: Any, combo: str, policy: str, late_engines: list[CopyEngine]
) -> None:
    await test_hybrid_host_random.test_random_hybrid_host_workload(make_cache, combo, policy)
    assert len(late_engines) >= 3  # the KV, SWA and state engines
    assert all(e.mode == "staged" for e in late_engines)
