"""CopyEngine on CPU pools: exact copies, layer order, ordering, cancellation, errors, close."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from asynccache.errors import ClosedError, ConfigError, InvalidInputError, OwnerError, TransferError
from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.handles import CopyResult
from asynccache.transfers.pools import DevicePool, HostPool, KVShape

MODES = ["direct", "staged"]
PAGE = 4


def _random_bits(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _pools(
    dtype: str = "fp16", layout: str = "layer_first", layers: int = 3, seed: int = 0
) -> tuple[DevicePool, HostPool]:
    shape = KVShape(layers, 2, 8, dtype)
    dev = DevicePool(shape, 24 * PAGE, PAGE, device="cpu")
    host = HostPool(shape, 40 * PAGE, PAGE, layout=layout)  # type: ignore[arg-type]
    _random_bits(dev.kv, seed)
    _random_bits(host.kv, seed + 1)
    return dev, host


def _slots(pages: np.ndarray) -> np.ndarray:
    return (pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1)


def _engine_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("asynccache-copy")]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
async def test_copies_are_bit_exact_for_random_page_sets(
    mode: str, layout: str, dtype: str
) -> None:
    await _check_random_page_sets(mode, layout, dtype)


@pytest.fixture
def shared_chunks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every direct copy is cut into several chunks shared with the helper thread, one layer
    per layer group; the worker waits before its first chunk until the helper copied one, so
    both threads really take part. Returns the names of the threads that copied chunks."""
    import asynccache.transfers.workers as workers
    from asynccache.transfers.plan import CopyPlan

    for name, value in (("PARALLEL_BYTES", 1), ("CHUNK_BYTES", 1), ("MAX_CHUNKS", 5),
                        ("LAYER_GROUP_BYTES", 1), ("MAX_LAYER_GROUPS", 64)):
        monkeypatch.setattr(workers, name, value)
    real = CopyPlan.copy_part
    helper_copied = threading.Event()
    names: list[str] = []

    def copy_part(self: CopyPlan, src: Any, dst: Any, layers: slice, lo: int, hi: int) -> None:
        me = threading.current_thread().name
        if not me.endswith("-helper") and not helper_copied.wait(timeout=10):
            raise RuntimeError("the helper never took a chunk")
        real(self, src, dst, layers, lo, hi)
        names.append(me)
        if me.endswith("-helper"):
            helper_copied.set()

    monkeypatch.setattr(CopyPlan, "copy_part", copy_part)
    return names


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
async def test_copies_shared_by_two_threads_are_bit_exact(
    mode: str, layout: str, dtype: str, shared_chunks: list[str]
) -> None:
    await _check_random_page_sets(mode, layout, dtype)
    # direct: the worker and its helper; staged: the issuer's gathers and the completer's
    # scatters, each shared with the helper
    threads = {"direct": {"worker", "helper"}, "staged": {"issuer", "completer", "helper"}}
    assert {n.rsplit("-", 1)[1] for n in shared_chunks} == threads[mode]


async def _check_random_page_sets(mode: str, layout: str, dtype: str) -> None:
    dev, host = _pools(dtype, layout, seed=hash((mode, layout, dtype)) % 1000)
    rng = np.random.default_rng(42)
    async with CopyEngine(dev, host, mode=mode) as engine:  # type: ignore[arg-type]
        for k in (1, 7, 24):
            # device -> host: random source pages, random destination pages
            d_pages = rng.permutation(24)[:k]
            h_pages = rng.permutation(40)[:k]
            host_before = host.kv.clone()
            res = await engine.submit_d2h(_slots(d_pages), _slots(h_pages))
            assert (res.op, res.num_tokens, res.num_bytes) == (
                "d2h",
                k * PAGE,
                k * PAGE * dev.shape.bytes_per_token,
            )
            assert _same(host.read_slots(_slots(h_pages)), dev.read_slots(_slots(d_pages)))
            untouched = np.setdiff1d(np.arange(40), h_pages)
            assert _same(
                host.read_slots(_slots(untouched)), _slots_of(host_before, host, untouched)
            )
            # host -> device, whole batch and layer by layer
            for layerwise in (False, True):
                _random_bits(host.kv, int(rng.integers(1 << 30)))
                h_src = rng.permutation(40)[:k]
                d_dst = rng.permutation(24)[:k]
                dev_before = dev.kv.clone()
                if layerwise:
                    handle = engine.submit_h2d_layerwise(_slots(h_src), _slots(d_dst))
                    layer_results = [await handle.layer(i) for i in range(3)]
                    assert [r.layer for r in layer_results] == [0, 1, 2]
                    assert (
                        sum(r.num_bytes for r in layer_results)
                        == k * PAGE * dev.shape.bytes_per_token
                    )
                    res = await handle.done()
                else:
                    res = await engine.submit_h2d(_slots(h_src), _slots(d_dst))
                assert res.num_tokens == k * PAGE and res.layer is None
                assert _same(dev.read_slots(_slots(d_dst)), host.read_slots(_slots(h_src)))
                rest = np.setdiff1d(np.arange(24), d_dst)
                assert _same(dev.kv[:, :, _slots(rest)], dev_before[:, :, _slots(rest)])
        # allocator-shaped indices (ascending runs) take the contiguous path
        d = dev.allocator.alloc(12 * PAGE)
        h = host.allocator.alloc(12 * PAGE)
        assert d is not None and h is not None
        await engine.submit_d2h(d, h)
        assert _same(host.read_slots(h), dev.read_slots(d))
        d2 = dev.allocator.alloc(12 * PAGE)
        assert d2 is not None
        await engine.submit_h2d(torch.from_numpy(h), d2.tolist())
        assert _same(dev.read_slots(d2), dev.read_slots(d))
    assert _engine_threads() == []


def _slots_of(before: torch.Tensor, pool: HostPool, pages: np.ndarray) -> torch.Tensor:
    """What ``pool.read_slots(_slots(pages))`` returned for the pool state ``before``."""
    saved = pool.kv.clone()
    pool.kv.copy_(before)
    out = pool.read_slots(_slots(pages))
    pool.kv.copy_(saved)
    return out


@pytest.mark.parametrize("mode", MODES)
async def test_layerwise_load_delivers_every_layer_in_order(mode: str) -> None:
    await _check_layer_order(mode)


async def test_layerwise_load_in_order_with_shared_chunks(shared_chunks: list[str]) -> None:
    await _check_layer_order("direct")
    assert {n.rsplit("-", 1)[1] for n in shared_chunks} == {"worker", "helper"}


async def _check_layer_order(mode: str) -> None:
    layers = 6
    dev, host = _pools("bf16", "page_first", layers=layers, seed=3)
    h_src = _slots(np.array([31, 2, 17, 5, 6, 39, 0, 11]))
    d_dst = _slots(np.array([3, 4, 5, 20, 1, 9, 10, 23]))
    expected = host.read_slots(h_src)
    seen: list[int] = []
    async with CopyEngine(dev, host, mode=mode) as engine:  # type: ignore[arg-type]
        handle = engine.submit_h2d_layerwise(h_src, d_dst)
        assert handle.num_layers == layers and not handle.finished

        async def consume(i: int) -> None:
            res = await handle.layer(i)
            assert res.layer == i and handle.layer_finished(i)
            # layers complete in order: every earlier layer is in place too
            assert all(handle.layer_finished(j) for j in range(i))
            assert _same(dev.read_slots(d_dst)[:i], expected[:i])
            # this layer is in place when its await returns
            assert _same(dev.read_slots(d_dst)[i], expected[i])
            seen.append(i)

        await asyncio.gather(*(consume(i) for i in reversed(range(layers))))
        total = await handle
        # (the awaits may return in any order: a layer done before its consumer first awaited
        # returns at once)
        assert sorted(seen) == list(range(layers))
        assert (total.op, total.num_bytes) == (
            "h2d_layerwise",
            8 * PAGE * dev.shape.bytes_per_token,
        )
        assert _same(dev.read_slots(d_dst), expected)
        with pytest.raises(InvalidInputError, match="layer 6 out of range"):
            handle.layer(layers)


@pytest.mark.parametrize("mode", [*MODES, "direct-shared"])
async def test_copies_complete_in_submission_order(
    mode: str, request: pytest.FixtureRequest
) -> None:
    if mode == "direct-shared":  # every copy cut into chunks that two threads share
        request.getfixturevalue("shared_chunks")
        mode = "direct"
    dev, host = _pools(seed=5)
    # the copies overlap, so the final bytes are right only if they ran in submission order
    model = {"dev": dev.page_view().clone(), "host": host.page_view().clone()}
    order: list[int] = []
    results: list[CopyResult] = []
    async with CopyEngine(dev, host, mode=mode, on_complete=results.append) as engine:  # type: ignore[arg-type]
        handles = []
        for i in range(40):
            pages = np.array([i % 24, (i + 7) % 24])
            hpages = np.array([i % 40, (i + 13) % 40])
            if i % 3 == 0:
                h: Any = engine.submit_d2h(_slots(pages), _slots(hpages))
                model["host"][:, :, hpages] = model["dev"][:, :, pages]
            elif i % 3 == 1:
                h = engine.submit_h2d(_slots(hpages), _slots(pages))
                model["dev"][:, :, pages] = model["host"][:, :, hpages]
            else:
                h = engine.submit_h2d_layerwise(_slots(hpages), _slots(pages))
                model["dev"][:, :, pages] = model["host"][:, :, hpages]
            h.add_done_callback(lambda _h, i=i: order.append(i))
            handles.append(h)
        assert engine.in_flight == 40
        await asyncio.gather(*handles)
        await asyncio.sleep(0)
        ops = [r.op for r in results]
        if engine.separate_lanes:  # in submission order per lane: D->H, and H->D
            for lane in ((0,), (1, 2)):
                mine = [i for i in order if i % 3 in lane]
                assert mine == sorted(mine)
            assert sorted(order) == list(range(40))
            assert [op for op in ops if op == "d2h"] == ["d2h"] * 14
            assert [op for op in ops if op != "d2h"] == [
                ("h2d", "h2d_layerwise")[i % 2] for i in range(26)]
        else:
            assert order == list(range(40))
            assert ops == [("d2h", "h2d", "h2d_layerwise")[i % 3] for i in range(40)]
        assert engine.in_flight == 0
        per_copy = 2 * PAGE * dev.shape.bytes_per_token
        assert (
            engine.stats["d2h"].ops,
            engine.stats["h2d"].ops,
            engine.stats["h2d_layerwise"].ops,
        ) == (14, 13, 13)
        assert engine.stats["d2h"].bytes == 14 * per_copy
        assert engine.stats["h2d_layerwise"].tokens == 13 * 2 * PAGE
        # Copies of the same pages take effect in submission order (host and device pages
        # are ordered across lanes).
        assert _same(dev.page_view(), model["dev"])
        assert _same(host.page_view(), model["host"])


@pytest.fixture
def gate(hold_copies: Callable[[], threading.Event]) -> threading.Event:
    """Holds the worker before it starts any copy until the test sets the returned event."""
    return hold_copies()


@pytest.mark.parametrize("mode", MODES)
async def test_cancelled_awaiter_does_not_cancel_the_copy(mode: str, gate: threading.Event) -> None:
    dev, host = _pools("fp32", seed=9)
    d = _slots(np.arange(24))
    h = _slots(np.arange(10, 34))
    expected = dev.read_slots(d)  # the layer-wise load below overwrites device pages 16..23
    async with CopyEngine(dev, host, mode=mode) as engine:  # type: ignore[arg-type]
        handle = engine.submit_d2h(d, h)
        layered = engine.submit_h2d_layerwise(_slots(np.arange(0, 8)), _slots(np.arange(16, 24)))
        t1 = asyncio.create_task(_await(handle))
        t2 = asyncio.create_task(_await(layered.layer(1)))
        for _ in range(3):
            await asyncio.sleep(0)  # both awaiters are now suspended on in-flight copies
        assert not handle.finished and not layered.layer_finished(1)
        t1.cancel()
        t2.cancel()
        for t in (t1, t2):
            with pytest.raises(asyncio.CancelledError):
                await t
        assert not handle.finished
        gate.set()
        # the owner still gets the results, and the data is all there
        res = await handle
        assert res.num_tokens == 24 * PAGE
        assert _same(host.read_slots(h), expected)
        assert (await layered.layer(1)).layer == 1
        await layered
        assert engine.stats["d2h"].failed == 0 and engine.stats["d2h"].ops == 1


async def _await(aw: Any) -> Any:
    return await aw


def test_cancellation_under_anyio() -> None:
    async def main() -> tuple[int, bool]:
        dev, host = _pools(seed=11)
        async with CopyEngine(dev, host) as engine:
            handle = engine.submit_d2h(_slots(np.arange(12)), _slots(np.arange(12)))
            with anyio.move_on_after(0) as scope:
                await handle
            res = await handle
            return res.num_tokens, scope.cancelled_caught and _same(
                host.read_slots(_slots(np.arange(12))), dev.read_slots(_slots(np.arange(12)))
            )

    assert anyio.run(main, backend="asyncio") == (12 * PAGE, True)
    assert _engine_threads() == []


async def test_bad_input_raises_at_submit_and_queues_nothing() -> None:
    dev, host = _pools()
    async with CopyEngine(dev, host) as engine:
        with pytest.raises(InvalidInputError, match="device_idx has 8 slots but host_idx has 4"):
            engine.submit_d2h(_slots(np.array([0, 1])), _slots(np.array([0])))
        with pytest.raises(InvalidInputError, match="host_idx is not made of whole pages"):
            engine.submit_h2d([1, 2, 3, 4], [0, 1, 2, 3])
        with pytest.raises(InvalidInputError, match="device_idx holds slot 96, out of range"):
            engine.submit_h2d_layerwise([0, 1, 2, 3], [96, 97, 98, 99])
        with pytest.raises(InvalidInputError, match="integers"):
            engine.submit_d2h(np.array([0.0, 1.0, 2.0, 3.0]), [0, 1, 2, 3])
        assert engine.in_flight == 0
        res = await engine.submit_d2h([], [])
        assert (res.num_tokens, res.num_bytes) == (0, 0)
        layered = engine.submit_h2d_layerwise([], [])
        assert [(await layered.layer(i)).num_bytes for i in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("mode", MODES)
async def test_a_failing_copy_fails_its_handle_and_the_engine_carries_on(mode: str) -> None:
    dev, host = _pools(seed=13)
    async with CopyEngine(dev, host, mode=mode) as engine:  # type: ignore[arg-type]
        # destination page 5 twice: caught by the worker's plan, not at submit
        bad = engine.submit_d2h(_slots(np.array([0, 1])), _slots(np.array([5, 5])))
        bad_layered = engine.submit_h2d_layerwise(
            _slots(np.array([0, 1])), _slots(np.array([2, 2]))
        )
        good = engine.submit_d2h(_slots(np.array([3])), _slots(np.array([7])))
        with pytest.raises(TransferError, match="destination page 5 appears twice") as info:
            await bad
        assert isinstance(info.value.__cause__, InvalidInputError)
        for i in range(3):
            with pytest.raises(TransferError, match="h2d_layerwise copy of 8 tokens failed"):
                await bad_layered.layer(i)
        with pytest.raises(TransferError):
            await bad_layered
        assert (await good).num_tokens == PAGE
        assert _same(host.read_slots(_slots(np.array([7]))), dev.read_slots(_slots(np.array([3]))))
        assert engine.stats["d2h"].failed == 1 and engine.stats["d2h"].ops == 1
        assert engine.stats["h2d_layerwise"].failed == 1


@pytest.mark.parametrize("mode", MODES)
async def test_layerwise_failure_midway_fails_the_remaining_layers(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev, host = _pools(layers=4, seed=17)
    import asynccache.transfers.workers as workers

    monkeypatch.setattr(workers, "LAYER_GROUP_BYTES", 1)  # one layer per group
    bad = 2  # the first layer whose copy fails
    if mode == "staged":  # the staged pipeline issues pieces of 1, 2, 1 layers
        from asynccache.transfers.staged import StagedWorker

        real = StagedWorker._issue_h2d
        bad = 1

        def flaky(self: StagedWorker, lane: Any, job: Any, slot: Any, piece: Any) -> None:
            if piece[0] == 1:
                raise RuntimeError("layer 1 exploded")
            real(self, lane, job, slot, piece)

        monkeypatch.setattr(StagedWorker, "_issue_h2d", flaky)
    else:  # the direct worker copies chunks of layer groups
        from asynccache.transfers.plan import CopyPlan

        monkeypatch.setattr(workers, "MAX_LAYER_GROUPS", 64)
        real_part = CopyPlan.copy_part

        def flaky_part(self: CopyPlan, src: Any, dst: Any, layers: slice, lo: int, hi: int) -> None:
            if layers.start == 2:
                raise RuntimeError("layer 2 exploded")
            real_part(self, src, dst, layers, lo, hi)

        monkeypatch.setattr(CopyPlan, "copy_part", flaky_part)
    h_src, d_dst = _slots(np.array([4, 9])), _slots(np.array([0, 1]))
    async with CopyEngine(dev, host, mode=mode) as engine:  # type: ignore[arg-type]
        handle = engine.submit_h2d_layerwise(h_src, d_dst)
        assert [(await handle.layer(i)).layer for i in range(bad)] == list(range(bad))
        for i in range(bad, 4):
            with pytest.raises(TransferError, match=f"layer {bad} exploded"):
                await handle.layer(i)
        with pytest.raises(TransferError, match=f"layer {bad} exploded"):
            await handle
        assert _same(dev.read_slots(d_dst)[:bad], host.read_slots(h_src)[:bad])


@pytest.mark.parametrize("mode", MODES)
async def test_aclose_waits_for_in_flight_copies_and_stops_threads(mode: str) -> None:
    await _check_aclose(mode)


async def test_aclose_with_copies_shared_by_two_threads(shared_chunks: list[str]) -> None:
    await _check_aclose("direct")
    assert {n.rsplit("-", 1)[1] for n in shared_chunks} == {"worker", "helper"}


async def _check_aclose(mode: str) -> None:
    dev, host = _pools(seed=19)
    engine = CopyEngine(dev, host, mode=mode, name="asynccache-copy-close")  # type: ignore[arg-type]
    with pytest.raises(ClosedError, match="call start"):
        engine.submit_d2h([0, 1, 2, 3], [0, 1, 2, 3])
    await engine.start()
    assert sorted(t.name for t in engine.threads) == sorted(_engine_threads())
    assert all(t.is_alive() for t in engine.threads)
    handles = [engine.submit_d2h(_slots(np.array([i])), _slots(np.array([i]))) for i in range(24)]
    handles.append(engine.submit_h2d_layerwise(_slots(np.array([30])), _slots(np.array([0]))))
    await engine.aclose()
    assert all(h.finished for h in handles)
    assert [h.result().num_tokens for h in handles] == [PAGE] * 25
    assert engine.closed and not engine.running
    assert not any(t.is_alive() for t in engine.threads)
    assert _engine_threads() == []
    with pytest.raises(ClosedError, match="closed"):
        engine.submit_h2d([0, 1, 2, 3], [0, 1, 2, 3])
    with pytest.raises(ClosedError):
        await engine.start()
    await engine.aclose()  # idempotent


_EXIT_UNCLOSED = """
import asyncio, sys
import numpy as np, torch
from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.pools import DevicePool, HostPool, KVShape

shape = KVShape(8, 8, 128, torch.float16)  # 32 MiB pools
dev, host = DevicePool(shape, 1024, 16, device="cpu"), HostPool(shape, 1024, 16)

async def main():
    engine = CopyEngine(dev, host, mode=sys.argv[1])
    await engine.start()
    for _ in range(200):  # about 6 GiB to copy: seconds of work queued
        engine.submit_d2h(np.arange(1024), np.arange(1024))
    await asyncio.sleep(0.05)

asyncio.run(main())  # ends without aclose(), as when an exception leaves main
print("exiting", flush=True)
"""


@pytest.mark.parametrize("mode", MODES)
def test_the_interpreter_exits_cleanly_with_copies_running_in_an_unclosed_engine(
    mode: str,
) -> None:
    """A thread still inside a torch copy when the interpreter finalizes aborted the process
    (exit 134, "terminate called without an active exception"): at exit, the threads of
    engines nobody closed drop their queued copies and are joined first."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_UNCLOSED, mode], capture_output=True,
                          text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "exiting\n"), proc.stderr
    assert "terminate called" not in proc.stderr


async def test_concurrent_aclose_calls_share_the_drain() -> None:
    dev, host = _pools()
    engine = CopyEngine(dev, host)
    await engine.start()
    handle = engine.submit_d2h(_slots(np.arange(24)), _slots(np.arange(24)))
    await asyncio.gather(engine.aclose(), engine.aclose())
    assert handle.finished and engine.closed and _engine_threads() == []
    never_started = CopyEngine(dev, host)
    await never_started.aclose()
    assert never_started.closed


async def test_submit_from_another_thread_is_an_owner_error() -> None:
    dev, host = _pools()
    errors: list[BaseException] = []
    async with CopyEngine(dev, host) as engine:

        def other() -> None:
            try:
                engine.submit_d2h([0, 1, 2, 3], [0, 1, 2, 3])
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(errors) == 1 and isinstance(errors[0], OwnerError)


def test_engine_config_errors() -> None:
    dev, host = _pools()
    other = HostPool(KVShape(3, 2, 8, "fp32"), 16, PAGE)
    with pytest.raises(ConfigError, match="pool shapes differ"):
        CopyEngine(dev, other)
    with pytest.raises(ConfigError, match="page sizes differ"):
        CopyEngine(dev, HostPool(dev.shape, 16, 8))
    with pytest.raises(ConfigError, match="unknown mode 'fast'"):
        CopyEngine(dev, host, mode="fast")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="device_pool"):
        CopyEngine(host, host)  # type: ignore[arg-type]
    assert CopyEngine(dev, host).mode == ("staged" if torch.cuda.is_available() else "direct")


async def test_page_size_one_copies_what_was_submitted(gate: threading.Event) -> None:
    shape = KVShape(2, 1, 4, "fp32")
    dev = DevicePool(shape, 16, 1, device="cpu")
    host = HostPool(shape, 16, 1)
    _random_bits(dev.kv, 23)
    src = np.array([3, 9, 4], dtype=np.int64)
    dst = np.array([0, 1, 2], dtype=np.int64)
    expected = dev.read_slots([3, 9, 4])
    async with CopyEngine(dev, host) as engine:
        handle = engine.submit_d2h(src, dst)
        src[:] = [5, 6, 7]  # the caller reuses its arrays before the copy ran
        dst[:] = [10, 11, 12]
        gate.set()
        await handle
    assert _same(host.read_slots([0, 1, 2]), expected)
    assert int(host.read_slots([10, 11, 12]).abs().sum()) == 0
