"""A request's load-back started without waiting (``begin_load_back_request``), its layers
used as they land, and finished (``finish_load_back_request``): the pins move to the request,
and a failed or cancelled load puts the request back on what the tree holds. Real pools and
copies; the leak-checking teardown runs after each test."""

from __future__ import annotations

import asyncio

import pytest

from asynccache.errors import InvalidInputError, TransferError
from asynccache.transfers.handles import LayerwiseHandle


async def _host_only(cache, kit, tokens):
    """Serve ``tokens`` once, then push them to host memory only."""
    model = kit.KVModel.of(cache)
    await kit.serve(cache, model, tokens)
    await cache.flush()
    await cache.evict_async(10**6)
    return model


async def test_layers_land_in_order_and_the_request_keeps_the_prefix(make_cache, kit):
    cache = await make_cache(write_policy="write_through", num_layers=4)
    tokens = list(range(40, 60))
    model = await _host_only(cache, kit, tokens)
    req = cache.admit([*tokens, 7, 8])
    assert (req.prefix_len, req.host_hit_length) == (0, 20)
    lb = cache.begin_load_back_request(req)
    assert lb is not None and req.prefix_len == 20 and req.host_receipt is None
    want = model.expected(tokens)
    for layer in range(4):
        await asyncio.wait_for(lb.layer(layer), kit.TIMEOUT)
        kit.assert_bits_equal(cache.read_kv(req.slots)[layer], want[layer], f"layer {layer}")
    await asyncio.wait_for(cache.finish_load_back_request(req, lb), kit.TIMEOUT)
    assert req.host_hit_length == 0 and req.last_node == req.best_node == lb.node_id
    assert req.receipt is not None and lb.receipt is None
    assert cache.evict(10**6) == 0  # the request pins its loaded prefix
    new = await cache.extend(req, 2)
    cache.write_kv(new, model.expected([*tokens, 7, 8])[:, :, 20:])
    cache.cache_finished_req(req)
    assert cache.match_prefix([*tokens, 7, 8]).device_prefix_len == 20 + 2 - 2 % cache.page_size


async def test_a_forward_thread_waits_for_each_layer_with_wait_layer(make_cache, kit):
    """The device-side wait from the forward's thread (CPU pools: it returns once the layer is
    in place), a bad layer named, and a hybrid-free cache only."""
    cache = await make_cache(write_policy="write_through", num_layers=4)
    tokens = list(range(70, 90))
    model = await _host_only(cache, kit, tokens)
    req = cache.admit([*tokens, 7])
    lb = cache.begin_load_back_request(req)
    assert lb is not None
    want = model.expected(tokens)
    seen = []

    def forward():
        for layer in range(4):
            lb.wait_layer(layer, timeout=kit.TIMEOUT)
            seen.append(cache.read_kv(req.slots)[layer].clone())

    await asyncio.wait_for(asyncio.to_thread(forward), kit.TIMEOUT)
    for layer in range(4):
        kit.assert_bits_equal(seen[layer], want[layer], f"layer {layer}")
    with pytest.raises(InvalidInputError, match="layer 4 out of range"):
        lb.wait_layer(4)
    await asyncio.wait_for(cache.finish_load_back_request(req, lb), kit.TIMEOUT)
    cache.abort_req(req)


async def test_nothing_to_load_returns_none(make_cache, kit):
    cache = await make_cache(write_policy="write_through")
    req = cache.admit([1, 2, 3, 4])
    assert cache.begin_load_back_request(req) is None
    cache.abort_req(req)


def _failing_layerwise(engine):
    """``engine.submit_h2d_layerwise`` whose copies land (the slots are written) and then
    report a failure, as a copy thread that failed at the end would."""
    real_submit = engine.submit_h2d_layerwise

    def submit(host, device, **kw):
        real = real_submit(host, device, **kw)
        fut = asyncio.get_running_loop().create_future()
        real.add_done_callback(lambda _h: fut.set_exception(TransferError("injected failure")))
        layers = [asyncio.ensure_future(real.layer(i)) for i in range(real.num_layers)]
        return LayerwiseHandle(fut, layers, real.src_indices, real.dst_indices, real.num_bytes)

    return submit


async def test_a_failed_load_puts_the_request_back_on_the_tree(make_cache, kit, monkeypatch):
    cache = await make_cache(write_policy="write_through")
    tokens = list(range(100, 116))
    model = await _host_only(cache, kit, tokens)
    monkeypatch.setattr(cache.copy_engine, "submit_h2d_layerwise",
                        _failing_layerwise(cache.copy_engine))
    req = cache.admit(tokens)
    lb = cache.begin_load_back_request(req)
    assert lb is not None and req.prefix_len == 16
    with pytest.raises(TransferError):
        await asyncio.wait_for(cache.finish_load_back_request(req, lb), kit.TIMEOUT)
    monkeypatch.undo()
    assert (req.prefix_len, req.host_hit_length, len(req.slots)) == (0, 16, 0)
    await cache.load_back_request(req)  # the host copy is still there: load it for real
    assert req.prefix_len == 16
    model.check(cache, tokens, req.slots)
    cache.cache_finished_req(req)


async def test_a_cancelled_finish_leaves_no_pin_or_slot(make_cache, kit, hold_copies):
    cache = await make_cache(write_policy="write_through")
    tokens = list(range(200, 216))
    await _host_only(cache, kit, tokens)
    copies = hold_copies()
    req = cache.admit(tokens)
    lb = cache.begin_load_back_request(req)
    assert lb is not None
    waiter = asyncio.ensure_future(cache.finish_load_back_request(req, lb))
    await asyncio.sleep(0)
    assert not lb.handle.finished  # cancelled while the copy is in flight
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert lb.abandoned and req.receipt is not None
    assert req.pending_loads == (lb.op_id,)  # the request sees the load still running
    copies.set()
    await cache.flush()  # the copy still lands and commits; nobody holds its lock
    assert lb.receipt is None
    cache.abort_req(req)


async def test_extend_before_finish_is_refused(make_cache, kit):
    cache = await make_cache(write_policy="write_through")
    tokens = list(range(300, 316))
    await _host_only(cache, kit, tokens)
    req = cache.admit([*tokens, 1, 2, 3, 4])
    lb = cache.begin_load_back_request(req)
    assert lb is not None
    await cache.extend(req, 4)
    with pytest.raises(InvalidInputError, match="must come before extend"):
        await cache.finish_load_back_request(req, lb)
    await lb.wait()
    cache.release_load(lb)
    cache.abort_req(req)
