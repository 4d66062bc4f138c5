"""Random request lifecycles on one real cache: admit, compute in chunks, cache partway, finish,
abort, retract / restore, radix sessions and streaming sessions interleaved, with the device
pool under pressure. After every step the invariants and the pool accounting hold, and every
KV a request reads is bit for bit the KV of its tokens."""

from __future__ import annotations

import asyncio
import random

import pytest

from asynccache.errors import PoolExhaustedError


@pytest.mark.parametrize("seed", range(4))
async def test_random_lifecycles(make_cache, kit, seed):
    rng = random.Random(seed)
    cache = await make_cache(enable_sessions=True, retraction_backup=True, device_tokens=96,
                             host_tokens=192, write_policy=rng.choice(
                                 ["write_through", "write_through_selective", "write_back"]))
    model = kit.KVModel.of(cache)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    running: list = []  # (req, tokens)
    parked: list = []
    streams: dict = {}

    def new_tokens():
        return rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 13))]

    async def compute(req, tokens, n):
        lo = req.computed
        hi = min(len(tokens), lo + n)
        if hi > lo:
            new = await cache.extend(req, hi - lo)
            cache.write_kv(new, model.expected(tokens, lo, hi))
        model.check(cache, tokens, req.slots, f"slots of {req.rid}")

    for _step in range(120):
        op = rng.random()
        try:
            if op < 0.25 and len(running) < 4:
                tokens = new_tokens()
                req = cache.admit(tokens, session_id=rng.choice([None, "s1", "s2"]))
                await cache.load_back_request(req)
                model.check(cache, tokens, req.slots, "cached prefix")
                running.append((req, tokens))
            elif op < 0.45 and running:
                req, tokens = rng.choice(running)
                await compute(req, tokens, rng.randrange(1, 9))
                if rng.random() < 0.5:
                    cache.cache_unfinished_req(req)
                    model.check(cache, tokens, req.slots, "after cache_unfinished_req")
            elif op < 0.6 and running:
                req, tokens = running.pop(rng.randrange(len(running)))
                if rng.random() < 0.8:
                    cache.cache_finished_req(req)
                else:
                    cache.abort_req(req)
            elif op < 0.7 and running:
                i = rng.randrange(len(running))
                req, tokens = running[i]
                await cache.retract(req)
                parked.append(running.pop(i))
            elif op < 0.8 and parked:
                req, tokens = parked[0]
                await cache.restore(req)
                parked.pop(0)
                model.check(cache, tokens, req.slots, "restored")
                running.append((req, tokens))
            elif op < 0.85:
                sid = rng.choice(["s1", "s2"])
                if cache.sessions.generation(sid) is not None:
                    cache.release_session(sid)
                else:
                    cache.open_session(sid)
            elif op < 0.95:
                name = rng.choice(["a", "b"])
                stream = streams.get(name)
                if stream is None:
                    stream = streams[name] = cache.stream(name)
                req = stream.turn([rng.randrange(50) for _ in range(rng.randrange(1, 7))])
                convo = req.key.tokens  # everything computed so far + this turn
                try:
                    await compute(req, convo, len(convo))
                finally:
                    stream.end_turn()
                if rng.random() < 0.3:
                    stream.close(cache=rng.random() < 0.7)
                    del streams[name]
            else:
                await cache.evict_async(rng.randrange(1, 40))
        except PoolExhaustedError:
            pass  # the pool is small on purpose; the step changed nothing
        cache.sanity_check()

    for req, _ in running + parked:
        cache.cache_finished_req(req)
    for stream in streams.values():
        stream.close()
    for sid in ("s1", "s2"):
        if cache.sessions.generation(sid) is not None:
            cache.release_session(sid)
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    cache.sanity_check()
    assert cache.tree.session_refs == 0
    assert cache.device_pool.allocator.used_size == cache.tree.device_size
