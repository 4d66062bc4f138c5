"""Host copies of hybrid components: SWA KV through a second copy engine, Mamba states
through the state copier, and grouped handles. Every round trip is bit-exact."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
import torch

from asynccache.errors import InvalidInputError
from asynccache.transfers import CopyEngine, DevicePool, HostPool, KVShape, MambaStatePool
from asynccache.transfers.hybrid_copies import (
    GroupHandle,
    StateCopier,
    host_state_pool,
    state_bytes,
)


def _fill(pool: MambaStatePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.states.copy_(torch.randn(pool.states.shape, generator=g).to(pool.states.dtype))


async def test_mamba_states_round_trip_bit_exact() -> None:
    dev = MambaStatePool(6, (3, 5), dtype=torch.bfloat16, device="cpu")
    _fill(dev, 1)
    host = host_state_pool(dev, 4)
    assert (tuple(host.states.shape), host.states.dtype) == ((4, 3, 5), torch.bfloat16)
    copier = StateCopier(dev, host)
    await copier.start()
    try:
        want = state_bytes(dev, np.array([4, 1]))
        h = copier.submit_d2h([4, 1], [2, 0])
        res = await h
        assert (res.op, res.num_tokens, res.num_bytes) == ("d2h", 2, 2 * 15 * 2)
        assert state_bytes(host, np.array([2, 0])) == want
        dev.states.zero_()
        await copier.submit_h2d([2, 0], [5, 3])
        assert state_bytes(dev, np.array([5, 3])) == want
        assert state_bytes(dev, np.array([0, 1, 2, 4])) == bytes(4 * 15 * 2)
        with pytest.raises(InvalidInputError, match="out of range"):
            copier.submit_h2d([4], [0])
        with pytest.raises(InvalidInputError, match="1 source states but 2"):
            copier.submit_d2h([0], [0, 1])
    finally:
        await copier.aclose()
    assert copier.in_flight == 0


async def test_a_cancelled_awaiter_does_not_stop_a_state_copy() -> None:
    dev = MambaStatePool(2, (64, 64), device="cpu")
    _fill(dev, 2)
    host = host_state_pool(dev, 2)
    copier = StateCopier(dev, host)
    await copier.start()
    h = copier.submit_d2h([0, 1], [1, 0])
    waiter = asyncio.ensure_future(h.done())  # type: ignore[arg-type]
    await asyncio.sleep(0)
    waiter.cancel()
    await copier.aclose()  # waits for the copy in flight
    assert h.finished
    assert state_bytes(host, np.array([1, 0])) == state_bytes(dev, np.array([0, 1]))


async def test_group_handle_joins_full_swa_and_state_copies_bit_exact() -> None:
    ps = 2
    full_shape = KVShape(3, 2, 4, torch.float16)
    swa_shape = KVShape(1, 2, 4, torch.float16)
    fdev = DevicePool(full_shape, 8, ps, device="cpu")
    fhost = HostPool(full_shape, 8, ps)
    sdev = DevicePool(swa_shape, 8, ps, device="cpu")
    shost = HostPool(swa_shape, 8, ps)
    mdev = MambaStatePool(2, (4,), device="cpu")
    _fill(mdev, 3)
    mhost = host_state_pool(mdev, 2)
    for pool, seed in ((fdev, 4), (sdev, 5)):
        g = torch.Generator().manual_seed(seed)
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=g).to(pool.kv.dtype))
    async with CopyEngine(fdev, fhost) as full, CopyEngine(sdev, shost) as swa:
        states = StateCopier(mdev, mhost)
        await states.start()
        f_src, f_dst = np.array([2, 3, 6, 7]), np.array([0, 1, 4, 5])
        s_src, s_dst = np.array([4, 5]), np.array([6, 7])
        group = GroupHandle([full.submit_d2h(f_src, f_dst), swa.submit_d2h(s_src, s_dst),
                             states.submit_d2h([1], [0])])
        res = await group
        assert (res.op, res.num_tokens, group.num_tokens) == ("d2h", 4, 4)
        assert group.num_bytes == (4 * full_shape.bytes_per_token + 2 * swa_shape.bytes_per_token
                                   + 4 * 4)
        assert torch.equal(fhost.read_slots(f_dst), fdev.read_slots(f_src))
        assert torch.equal(shost.read_slots(s_dst), sdev.read_slots(s_src))
        assert state_bytes(mhost, np.array([0])) == state_bytes(mdev, np.array([1]))
        # And back, into zeroed device pools.
        want_f, want_s = fdev.read_slots(f_src).clone(), sdev.read_slots(s_src).clone()
        want_m = state_bytes(mdev, np.array([1]))
        fdev.kv.zero_()
        sdev.kv.zero_()
        mdev.states.zero_()
        await GroupHandle([full.submit_h2d(f_dst, f_src), swa.submit_h2d(s_dst, s_src),
                           states.submit_h2d([0], [1])])
        assert torch.equal(fdev.read_slots(f_src), want_f)
        assert torch.equal(sdev.read_slots(s_src), want_s)
        assert state_bytes(mdev, np.array([1])) == want_m
        await states.aclose()
        with pytest.raises(Exception, match="not running"):
            states.submit_d2h([0], [0])


# --------------------------------------------------------------------------- ordering (issue 27)
@pytest.fixture
def late() -> Any:
    from asynccache.transfers.streams import LateStreams

    streams = LateStreams(delay_s=(0.0, 0.004), seed=2)
    yield streams
    streams.close()


async def _guarded(aw: Any) -> Any:
    return await asyncio.wait_for(asyncio.ensure_future(aw), 30.0)


@pytest.mark.parametrize("kind", ["direct", "staged", "late"])
async def test_state_copies_wait_for_the_kernel_that_writes_them(kind: str, late: Any) -> None:
    """A state backup submitted with after= reads the state the (late) kernel wrote; a load
    of host states a pending backup writes loads the new bytes (host-slot ordering)."""
    dev = MambaStatePool(8, (3, 5), dtype=torch.float32, device="cpu")
    _fill(dev, 7)
    host = host_state_pool(dev, 8)
    kw = {"direct": {"mode": "direct"}, "staged": {"mode": "staged"}, "late": {"streams": late}}
    copier = StateCopier(dev, host, **kw[kind])  # type: ignore[arg-type]
    await copier.start()
    try:
        side = late.new_stream("mamba")
        for rnd in range(3):
            late.launch(side, lambda rnd=rnd: dev.states[rnd].fill_(100.0 + rnd))
        backup = copier.submit_d2h([0, 1, 2], [5, 6, 7], after=side)
        load = copier.submit_h2d([7, 5], [3, 4])  # host states 5 and 7 are being written
        await _guarded(asyncio.gather(backup, load))
        assert bool((host.states[5] == 100.0).all()) and bool((host.states[7] == 102.0).all())
        assert bool((dev.states[3] == 102.0).all()) and bool((dev.states[4] == 100.0).all())
        assert copier.in_flight == 0
    finally:
        await copier.aclose()
    assert not [t for t in threading.enumerate() if t.name.startswith("asynccache-states")]


# --------------------------------------------------------------------------- hybrid layers
async def test_a_hybrid_load_layer_waits_for_its_kv_layer_and_the_whole_copies() -> None:
    """LayeredGroup: layer i = the KV load's layer i plus every copy loaded whole (SWA KV,
    Mamba states), not the KV's later layers; the first error among those fails it."""
    from asynccache.errors import TransferError
    from asynccache.transfers.handles import CopyHandle, LayeredGroup, LayerwiseHandle

    loop = asyncio.get_running_loop()
    idx = np.arange(2)
    layer_futs = [loop.create_future() for _ in range(3)]
    kv = LayerwiseHandle(loop.create_future(), layer_futs, idx, idx, 96)
    swa = CopyHandle("h2d", loop.create_future(), idx, idx, 32)
    group = LayeredGroup({"full": kv, "swa": swa})
    assert group.num_layers == 3 and group.num_bytes == 128
    first = asyncio.ensure_future(_awaited(group.layer(0)))
    layer_futs[0].set_result("kv layer 0")
    await asyncio.sleep(0)
    assert not first.done()  # the SWA copy is not in place yet
    swa._fut.set_result("swa")
    assert await _guarded(first) == "kv layer 0"
    assert not group.layer(1).finished and not group.finished  # later KV layers: not waited
    layer_futs[1].set_exception(TransferError("layer 1 lost"))
    with pytest.raises(TransferError, match="layer 1 lost"):
        await _guarded(_awaited(group.layer(1)))
    with pytest.raises(InvalidInputError, match="needs a layer-wise 'full' part"):
        LayeredGroup({"swa": swa})
    with pytest.raises(InvalidInputError, match="named by component"):
        LayeredGroup([kv, swa])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match=r"unknown components \['draft'\]"):
        LayeredGroup({"full": kv, "draft": swa})


async def test_a_mapped_hybrid_layer_waits_only_for_what_that_layer_reads() -> None:
    """With the model's layer map, model layer i waits for its own layer of its component's
    load (the k-th "full" layer: the KV load's layer k; likewise "swa"), a "mamba" layer for
    the whole state copy, and a layer of a component this load does not copy for nothing."""
    from asynccache.errors import TransferError
    from asynccache.transfers.handles import CopyHandle, LayeredGroup, LayerwiseHandle

    loop = asyncio.get_running_loop()
    idx = np.arange(2)
    kv_l = [loop.create_future() for _ in range(2)]
    swa_l = [loop.create_future() for _ in range(2)]
    kv = LayerwiseHandle(loop.create_future(), kv_l, idx, idx, 64)
    swa = LayerwiseHandle(loop.create_future(), swa_l, idx, idx, 32)
    states = CopyHandle("h2d", loop.create_future(), idx, idx, 8)
    layers = ("swa", "full", "mamba", "swa", "full")
    group = LayeredGroup({"full": kv, "swa": swa, "mamba": states}, layers)
    assert group.num_layers == 5 and group.num_bytes == 104
    assert group.part("swa") is swa and group.part("draft") is None
    waits = {i: asyncio.ensure_future(_awaited(group.layer(i))) for i in range(5)}
    swa_l[0].set_result("swa 0")
    await _spin()
    assert [i for i in range(5) if waits[i].done()] == [0]  # not FULL, not the states
    assert await waits[0] == "swa 0"
    kv_l[0].set_result("full 0")
    await _spin()
    assert [i for i in range(5) if waits[i].done()] == [0, 1]
    states._fut.set_result("states")
    await _spin()
    assert [i for i in range(5) if waits[i].done()] == [0, 1, 2]
    swa_l[1].set_exception(TransferError("swa layer 1 lost"))
    with pytest.raises(TransferError, match="swa layer 1 lost"):
        await _guarded(waits[3])
    assert not waits[4].done()
    kv_l[1].set_result("full 1")
    assert await waits[4] == "full 1"
    # A load without SWA (its SWA was on device already): SWA layers wait for nothing.
    only_kv = LayeredGroup({"full": LayerwiseHandle(loop.create_future(),
                                                    [loop.create_future() for _ in range(2)],
                                                    idx, idx, 64)}, layers)
    assert only_kv.layer(0).finished and only_kv.layer(3).finished
    assert not only_kv.layer(1).finished
    only_kv.wait_layer(0)  # nothing to wait for: returns at once
    with pytest.raises(InvalidInputError, match=r"layer 5 out of range \[0, 5\)"):
        group.layer(5)
    with pytest.raises(InvalidInputError, match="the 'swa' load has 2 layers, the layer map 1"):
        LayeredGroup({"full": kv, "swa": swa}, ("full", "swa", "full"))
    with pytest.raises(InvalidInputError, match="layer 1 is 'attn'"):
        LayeredGroup({"full": kv}, ("full", "attn"))


async def _awaited(aw: Any) -> Any:
    return await aw


async def _spin() -> None:
    """Let done-callbacks and the awaiting tasks run (a few loop iterations)."""
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize("mapped", [False, True], ids=["whole_swa", "layer_map"])
async def test_a_forward_waiting_on_the_device_sees_a_hybrid_layer_in_place(
    late: Any, mapped: bool
) -> None:
    """wait_layer(i, stream) of a hybrid load from the forward's thread: a kernel queued on
    that stream after it reads what layer i needs as loaded (late streams: the copies run
    later, out of order). Without a layer map: the KV's layer i and the whole SWA copy; with
    one: the model layer's own FULL or SWA layer, the SWA loaded layer by layer."""
    from asynccache.transfers.handles import LayeredGroup, layer_map

    ps = 2
    layers = ("swa", "full", "full", "swa", "full", "full") if mapped else None
    full_shape = KVShape(4, 2, 4, torch.float32)
    swa_shape = KVShape(2 if mapped else 1, 2, 4, torch.float32)
    fdev, fhost = DevicePool(full_shape, 8, ps, device="cpu"), HostPool(full_shape, 8, ps)
    sdev, shost = DevicePool(swa_shape, 8, ps, device="cpu"), HostPool(swa_shape, 8, ps)
    for pool, seed in ((fhost, 8), (shost, 9)):
        g = torch.Generator().manual_seed(seed)
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=g))
    f_src, f_dst = np.array([4, 5, 0, 1]), np.array([2, 3, 6, 7])
    s_src, s_dst = np.array([6, 7]), np.array([0, 1])
    want = {"full": fhost.read_slots(f_src).clone(), "swa": shost.read_slots(s_src).clone()}
    forward = late.new_stream("forward")
    seen: dict[Any, Any] = {}
    plan = layer_map(layers) if layers else [("full", i) for i in range(4)]
    async with CopyEngine(fdev, fhost, streams=late) as full, \
            CopyEngine(sdev, shost, streams=late) as swa:
        swa_copy = (swa.submit_h2d_layerwise(s_src, s_dst) if mapped
                    else swa.submit_h2d(s_src, s_dst))
        group = LayeredGroup({"full": full.submit_h2d_layerwise(f_src, f_dst),
                              "swa": swa_copy}, layers)

        def run_forward() -> None:
            for i, (kind, k) in enumerate(plan):
                group.wait_layer(i, forward, timeout=30.0)

                def attention(i: int = i, kind: str = kind, k: int = k) -> None:
                    dev, dst = (fdev, f_dst) if kind == "full" else (sdev, s_dst)
                    seen[kind, k] = dev.read_slots(dst)[k].clone()
                    if not mapped:  # the SWA copy is whole: every layer sees all of it
                        seen["swa_all", i] = sdev.read_slots(s_dst).clone()

                late.launch(forward, attention)
            forward.synchronize()

        await asyncio.to_thread(run_forward)
        await _guarded(group)
        group.wait_device(forward)  # landed: nothing left to wait for
    for kind, k in plan:
        assert torch.equal(seen[kind, k], want[kind][k]), f"{kind} layer {k} read early"
    for i in range(0 if mapped else len(plan)):
        assert torch.equal(seen["swa_all", i], want["swa"]), f"SWA read early ({i})"
