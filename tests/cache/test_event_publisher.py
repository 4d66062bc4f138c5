"""KV events over ZMQ (SGLang's / vLLM's PUB + replay protocol) and metrics over HTTP, with
real sockets on 127.0.0.1 and a real scrape."""

from __future__ import annotations

import asyncio
import urllib.request

import numpy as np
import pytest

from asynccache.errors import ConfigError
from asynccache.eventpub import END_SEQ, KVEventPublisher
from asynccache.kvevents import decode_batch
from asynccache.metrics import serve_metrics
from asynccache.tree import BlockStored, Medium

pytest.importorskip("zmq", reason="pyzmq (asynccache[events]) is not installed")
import zmq
import zmq.asyncio


async def _serve_some(cache, kit, prompts):
    model = kit.KVModel.of(cache)
    for tokens in prompts:
        await kit.serve(cache, model, tokens)


async def test_subscriber_gets_live_batches_and_a_late_one_replays_them(make_cache, kit):
    cache = await make_cache(page_size=2, enable_kv_events=True)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        async with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                                    topic="kv", attn_dp_rank=1) as pub:
            sub.connect(pub.endpoint)
            # A PUB drops what it sends before the subscription arrives (ZMQ's slow joiner):
            # publish until the subscriber sees a batch, then every later one arrives in order.
            got = None
            for step in range(200):
                await _serve_some(cache, kit, [[step * 10 + 1, step * 10 + 2, 7, 8]])
                pub.publish_from(cache)
                if await sub.poll(50):
                    got = await sub.recv_multipart()
                    break
            assert got is not None, "the subscriber never received a batch"
            # (the first batch received may be an earlier step's that arrived after its poll;
            # those after it arrive in order)
            first = int.from_bytes(got[1], "big")
            assert first <= step
            received = [got] + [await asyncio.wait_for(sub.recv_multipart(), kit.TIMEOUT)
                                for _ in range(first, step)]
            for seq, (topic, seq_bytes, payload) in enumerate(received, first):
                assert topic == b"kv" and int.from_bytes(seq_bytes, "big") == seq
                _ts, events, rank = decode_batch(payload)
                assert rank == 1 and all(isinstance(e, BlockStored) for e in events)
                assert events[0].token_ids == [seq * 10 + 1, seq * 10 + 2, 7, 8]
            for more in range(3):
                await _serve_some(cache, kit, [[900 + more, 2, 3, 4]])
                assert pub.publish_from(cache) == step + 1 + more
                _topic, s, p = await asyncio.wait_for(sub.recv_multipart(), kit.TIMEOUT)
                assert int.from_bytes(s, "big") == step + 1 + more
                assert decode_batch(p)[1][0].token_ids == [900 + more, 2, 3, 4]
            assert pub.publish_from(cache) is None  # nothing new: nothing sent

            # A subscriber that joined late asks the replay socket for everything from seq 0.
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(pub.replay_endpoint)
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            seqs = []
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), kit.TIMEOUT)
                assert frames[0] == b""
                if frames[2] == END_SEQ:
                    break
                assert frames[1] == b"kv"
                seqs.append(int.from_bytes(frames[2], "big"))
                decode_batch(frames[3])
            assert seqs == list(range(step + 4))
            dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()


async def test_publisher_needs_start_and_a_sane_buffer():
    with pytest.raises(ConfigError, match="buffer_steps"):
        KVEventPublisher("tcp://127.0.0.1:0", buffer_steps=0)
    pub = KVEventPublisher("tcp://127.0.0.1:0")
    with pytest.raises(ConfigError, match="not started"):
        pub.publish([BlockStored([1], None, [1], 1, medium=Medium.GPU)])


async def test_metrics_are_scraped_over_http(make_cache, kit):
    a = await make_cache()
    b = await make_cache()
    await _serve_some(a, kit, [[1, 2, 3, 4], [1, 2, 3, 4]])
    await _serve_some(b, kit, [[5, 6, 7, 8]])
    want_a = a.metrics.registry.get_sample_value("asynccache_hit_tokens_total")
    assert want_a == 4.0
    server = serve_metrics(a.metrics)
    try:
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(server.url, timeout=10)
                                       .read().decode())
    finally:
        server.close()
    assert "asynccache_hit_tokens_total 4.0" in text.splitlines()
    server = serve_metrics([a.metrics, b.metrics])
    try:
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(server.url, timeout=10)
                                       .read().decode())
    finally:
        server.close()
    lines = text.splitlines()
    assert 'asynccache_hit_tokens_total{cache="0"} 4.0' in lines
    assert 'asynccache_hit_tokens_total{cache="1"} 0.0' in lines


async def test_replay_serves_its_metrics_while_it_runs(tmp_path):
    """``ReplayOptions(metrics_port=0)`` (``asynccache replay --metrics-port 0``): a scrape in
    the middle of a paced replay sees the cache's counters; the server is gone afterwards."""
    from asynccache import CacheConfig
    from asynccache.replay.driver import Replayer, ReplayOptions
    from asynccache.replay.formats import TraceRequest

    config = CacheConfig(page_size=4, num_layers=1, num_heads=1, head_dim=2,
                         device_tokens=64, host_tokens=0, device="cpu")
    prompt = np.arange(1, 17, dtype=np.uint32)
    trace = [TraceRequest(f"r{i}", i * 0.05, prompt) for i in range(40)]
    rp = Replayer(config, ReplayOptions(verify="none", time_scale=1.0, metrics_port=0))
    run = asyncio.ensure_future(rp.run(trace))
    while rp.driver.metrics_url is None:
        assert not run.done()
        await asyncio.sleep(0.01)
    url = rp.driver.metrics_url
    await asyncio.sleep(0.5)  # a few requests in
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    hits = [float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("asynccache_hit_tokens_total ")]
    assert hits and hits[0] > 0
    stats = await asyncio.wait_for(run, 60)
    assert stats.requests == 40 and rp.driver.metrics_url is None
    with pytest.raises(OSError):
        await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=2))
