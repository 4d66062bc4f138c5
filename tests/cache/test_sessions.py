"""Radix sessions (generations, references, closed ids) and streaming sessions, on a real cache."""

from __future__ import annotations

import asyncio

import pytest

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.sessions import SessionTracker
from asynccache.tree import RadixKey, RadixTree

A = list(range(100, 108))
B = list(range(200, 208))
C = list(range(300, 308))


async def _serve_all(cache, kit, model, *reqs):
    for tokens, sid in reqs:
        req = cache.admit(tokens, session_id=sid)
        new = await cache.extend(req, len(tokens))
        cache.write_kv(new, model.expected(tokens))
        cache.cache_finished_req(req)
    cache.sanity_check()


async def _computed_turn(cache, model, s, tokens):
    """Start a streaming turn with ``tokens``, compute it (its KV written) and end it."""
    req = s.turn(tokens)
    new = await cache.extend(req, len(tokens))
    cache.write_kv(new, model.expected(tokens))
    s.end_turn()
    return req


def _cached(cache, tokens) -> int:
    return cache.match_prefix(tokens).device_prefix_len


async def test_session_paths_are_evicted_last(make_cache, kit):
    cache = await make_cache(enable_sessions=True, host_tokens=0, device_tokens=64)
    model = kit.KVModel.of(cache)
    await _serve_all(cache, kit, model, (A, "s1"), (B, None), (C, None))
    assert cache.sessions.references("s1") == 1
    assert cache.tree.session_refs == 1
    assert cache.evict(8) == 8  # A is the oldest, but referenced: B goes
    assert (_cached(cache, A), _cached(cache, B), _cached(cache, C)) == (8, 0, 8)
    assert cache.evict(8) == 8
    assert (_cached(cache, A), _cached(cache, C)) == (8, 0)
    assert cache.evict(8) == 8  # a reference never protects: A goes when nothing else is left
    assert _cached(cache, A) == 0
    assert cache.release_session("s1") == 1
    assert cache.tree.session_refs == 0
    cache.sanity_check()


async def test_released_session_is_ordinary_again(make_cache, kit):
    cache = await make_cache(enable_sessions=True, host_tokens=0)
    model = kit.KVModel.of(cache)
    await _serve_all(cache, kit, model, (A, "s1"), (B, None))
    cache.release_session("s1")
    assert cache.evict(8) == 8  # plain LRU now: A, the oldest, goes first
    assert (_cached(cache, A), _cached(cache, B)) == (0, 8)
    assert cache.sessions.is_closed("s1")
    assert cache.release_session("s1") == 0  # closing twice is harmless


async def test_late_finishers_do_not_tag(make_cache, kit):
    cache = await make_cache(enable_sessions=True, host_tokens=0)
    model = kit.KVModel.of(cache)
    late = cache.admit(A, session_id="s1")
    stale = cache.admit(B, session_id="s2")
    cache.release_session("s1")  # closed before its request finished
    cache.open_session("s2")  # a new generation: the old request is stale
    for req, tokens in ((late, A), (stale, B)):
        new = await cache.extend(req, len(tokens))
        cache.write_kv(new, model.expected(tokens))
        cache.cache_finished_req(req)
    assert cache.tree.session_refs == 0
    assert (cache.sessions.references("s1"), cache.sessions.references("s2")) == (0, 0)
    # A request admitted after the close does not reopen the closed id either.
    req = cache.admit(C, session_id="s1")
    assert req.session_generation is None
    cache.abort_req(req)
    cache.release_session("s2")


async def test_aborted_requests_do_not_tag(make_cache, kit):
    cache = await make_cache(enable_sessions=True, host_tokens=0)
    req = cache.admit(A, session_id="s1")
    new = await cache.extend(req, len(A))
    cache.write_kv(new, kit.KVModel.of(cache).expected(A))
    cache.abort_req(req)
    assert cache.tree.session_refs == 0 and cache.sessions.references("s1") == 0
    cache.release_session("s1")


async def test_reopen_drops_the_old_generation(make_cache, kit):
    cache = await make_cache(enable_sessions=True, host_tokens=0)
    model = kit.KVModel.of(cache)
    g1 = cache.open_session("s1")
    await _serve_all(cache, kit, model, (A, "s1"))
    assert cache.sessions.generation("s1") == g1
    g2 = cache.open_session("s1")
    assert g2 > g1
    assert cache.tree.session_refs == 0
    cache.release_session("s1")


async def test_session_errors(make_cache):
    plain = await make_cache(host_tokens=0)
    with pytest.raises(ConfigError, match="enable_sessions"):
        plain.admit(A, session_id="s1")
    with pytest.raises(ConfigError, match="enable_sessions"):
        plain.open_session("s1")
    cache = await make_cache(enable_sessions=True, host_tokens=0)
    with pytest.raises(InvalidInputError, match="not open"):
        cache.release_session("never")
    with pytest.raises(InvalidInputError, match="session_id"):
        cache.open_session("")
    with pytest.raises(InvalidInputError, match="priority"):
        cache.admit(A, priority="high")


def test_closed_ids_are_bounded():
    t = SessionTracker(RadixTree(enable_sessions=True), closed_limit=2)
    for sid in ("a", "b", "c"):
        t.open(sid)
        t.release(sid)
    assert [t.is_closed(s) for s in "abc"] == [False, True, True]
    assert t.ensure("a") is not None  # forgotten: a late request may reopen it
    assert t.ensure("b") is None


async def test_priority_reaches_the_tree(make_cache, kit):
    cache = await make_cache(eviction_policy="priority", host_tokens=0)
    model = kit.KVModel.of(cache)
    for tokens, prio in ((A, 5), (B, 0), (C, 1)):
        req = cache.admit(tokens, priority=prio)
        new = await cache.extend(req, len(tokens))
        cache.write_kv(new, model.expected(tokens))
        cache.cache_finished_req(req)
    order = []
    for _ in range(3):
        cache.evict(8)
        order.append(next(n for n, t in (("A", A), ("B", B), ("C", C))
                          if _cached(cache, t) == 0 and n not in order))
    assert order == ["B", "C", "A"]


# ---------------------------------------------------------------------- streaming sessions
async def test_streaming_session_round_trip(make_cache, kit):
    cache = await make_cache(host_tokens=0, device_tokens=64)
    model = kit.KVModel.of(cache)
    await _serve_all(cache, kit, model, (A, None))  # a cached prefix the first turn matches
    turn1 = [*A, 1, 2, 3]
    turn2 = [4, 5, 6, 7, 8]
    s = cache.stream("chat")
    req = s.turn(turn1)
    assert req.prefix_len == 8 and req.rid == "chat/turn-1"
    new = await cache.extend(req, 3)
    cache.write_kv(new, model.expected(turn1, 8, 11))
    s.end_turn()
    assert s.held_tokens == 12 and cache.streaming_held_tokens == 12  # 11 + 1 spare
    # Nothing of the session can be evicted between turns.
    assert cache.evict(64) == 0
    req2 = s.turn(turn2)
    assert req2 is req and req.prefix_len == 8 and len(req.key) == 16
    new = await cache.extend(req, 5)
    convo = turn1 + turn2
    cache.write_kv(new, model.expected(convo, 11, 16))
    model.check(cache, convo, req.slots, "streamed conversation")
    s.end_turn()
    s.close(cache=True)
    assert cache.streaming_held_tokens == 0
    m = cache.match_prefix(convo)
    assert m.device_prefix_len == 16
    model.check(cache, convo, m.device_indices, "cached conversation")
    cache.sanity_check()


async def test_streaming_session_close_without_caching_frees(make_cache, kit):
    cache = await make_cache(host_tokens=0)
    model = kit.KVModel.of(cache)
    s = cache.stream("chat")
    await _computed_turn(cache, model, s, B)
    assert cache.device_pool.allocator.used_size == 8
    s.close(cache=False)
    assert cache.device_pool.allocator.used_size == 0
    assert cache.match_prefix(B).device_prefix_len == 0
    s.close()  # idempotent


async def test_streaming_session_errors(make_cache):
    cache = await make_cache(host_tokens=0)
    s = cache.stream("chat")
    with pytest.raises(InvalidInputError, match="already open"):
        cache.stream("chat")
    with pytest.raises(InvalidInputError, match="no turn open"):
        s.end_turn()
    s.turn(A)
    with pytest.raises(InvalidInputError, match="end turn 1 first"):
        s.turn(B)
    s.end_turn()
    s.close(cache=False)
    with pytest.raises(InvalidInputError, match="closed"):
        s.turn(B)
    cache.stream("chat").close()  # the id is free again once closed


async def test_streaming_session_keeps_its_slots_under_pressure(make_cache, kit):
    cache = await make_cache(host_tokens=0, device_tokens=16)
    s = cache.stream("chat")
    req = s.turn(list(range(12)))
    await cache.extend(req, 12)
    other = cache.admit(B)
    # The pool is full of the session (12 + spare): another request cannot take its slots.
    task = asyncio.ensure_future(cache.extend(other, 16))
    done, _ = await asyncio.wait({task}, timeout=kit.TIMEOUT)
    assert done
    with pytest.raises(kit.PoolExhaustedError):
        task.result()
    cache.abort_req(other)
    s.end_turn()
    s.close(cache=False)
    cache.sanity_check()


VOCAB_ERROR = ("token id 60000 at position 2 exceeds max_token_id 50000 "
               "(CacheConfig: the model's largest token id)")
BAD = [1, 2, 60000, 4]


async def test_streaming_turn_refuses_token_ids_above_the_vocabulary(make_cache, kit):
    """A later turn's tokens are checked as admit checks them: refused at ``turn()`` with
    admit's error, nothing of the session changed; the session then goes on and closes clean."""
    cache = await make_cache(host_tokens=0, max_token_id=50000)
    model = kit.KVModel.of(cache)
    with pytest.raises(InvalidInputError) as admitted:
        cache.admit(BAD)
    assert str(admitted.value) == VOCAB_ERROR
    s = cache.stream("s1")
    req = await _computed_turn(cache, model, s, A)
    cache.sanity_check()
    assert (s.held_tokens, cache.device_pool.allocator.used_size, cache.tree.held_locks) == (
        8, 8, 1)

    with pytest.raises(InvalidInputError) as turned:
        s.turn(BAD)
    assert str(turned.value) == VOCAB_ERROR  # positions count the turn's own tokens
    assert (s.turns, s.request is req, req.rid, req.key.tokens) == (1, True, "s1/turn-1", A)
    assert (s.held_tokens, cache.device_pool.allocator.used_size) == (8, 8)
    with pytest.raises(InvalidInputError, match="has no turn open"):
        s.end_turn()
    cache.sanity_check()

    # The session goes on: the next turn is turn 2, and closing caches the conversation.
    req2 = s.turn([4, 5, 6, 7])
    assert (req2 is req, req.rid, s.turns) == (True, "s1/turn-2", 2)
    convo = [*A, 4, 5, 6, 7]
    new = await cache.extend(req, 4)
    cache.write_kv(new, model.expected(convo, 8, 12))
    s.end_turn()
    s.close()
    assert (s.closed, s.request, req.finished) == (True, None, True)
    m = cache.match_prefix(convo)
    assert m.device_prefix_len == 12
    model.check(cache, convo, m.device_indices, "cached conversation")
    assert cache.tree.held_locks == 0
    assert cache.device_pool.allocator.used_size == cache.tree.device_size == 12
    cache.sanity_check()
    cache.stream("s1").close()  # the id is free again


async def test_streaming_first_turn_refused_changes_nothing(make_cache):
    cache = await make_cache(host_tokens=0, max_token_id=50000)
    s = cache.stream("s1")
    with pytest.raises(InvalidInputError) as turned:
        s.turn(BAD)
    assert str(turned.value) == VOCAB_ERROR
    assert (s.turns, s.request, s.held_tokens) == (0, None, 0)
    assert (cache.device_pool.allocator.used_size, cache.tree.held_locks) == (0, 0)
    cache.sanity_check()
    req = s.turn(A)
    assert (req.rid, s.turns) == ("s1/turn-1", 1)
    s.end_turn()
    s.close(cache=False)
    assert (cache.device_pool.allocator.used_size, cache.tree.held_locks) == (0, 0)
    cache.sanity_check()


async def test_streaming_turn_of_another_namespace_changes_nothing(make_cache):
    cache = await make_cache(host_tokens=0)
    s = cache.stream("s1")
    req = s.turn(A)
    await cache.extend(req, len(A))
    s.end_turn()
    with pytest.raises(InvalidInputError, match="has namespace"):
        s.turn(RadixKey([4, 5, 6, 7], extra_key="lora-2"))
    assert (s.turns, req.rid, req.key.tokens) == (1, "s1/turn-1", A)
    with pytest.raises(InvalidInputError, match="has no turn open"):
        s.end_turn()
    cache.sanity_check()
    assert s.turn([4, 5, 6, 7]).rid == "s1/turn-2"
    s.end_turn()
    s.close(cache=False)
    assert (cache.device_pool.allocator.used_size, cache.tree.held_locks) == (0, 0)
    cache.sanity_check()


async def test_streaming_close_that_fails_stays_open_and_retryable(make_cache, kit, monkeypatch):
    """If finishing the request raises, the session is not half-closed: it still holds its
    request (nothing leaked, the id still taken) and a second ``close()`` finishes it."""
    cache = await make_cache(host_tokens=0)
    model = kit.KVModel.of(cache)
    s = cache.stream("s1")
    req = await _computed_turn(cache, model, s, A)
    finish = cache.cache_finished_req
    calls: list[bool] = []

    def fail_once(r, *, insert=True):
        calls.append(insert)
        if len(calls) == 1:
            raise RuntimeError("finishing failed")
        finish(r, insert=insert)

    monkeypatch.setattr(cache, "cache_finished_req", fail_once)
    with pytest.raises(RuntimeError, match="finishing failed"):
        s.close()
    assert (s.closed, s.request is req, req.finished, s.held_tokens) == (False, True, False, 8)
    assert (cache.streaming_held_tokens, cache.tree.held_locks) == (8, 1)
    with pytest.raises(InvalidInputError, match="already open"):
        cache.stream("s1")
    cache.sanity_check()
    s.close()
    assert calls == [True, True]
    assert (s.closed, s.request, req.finished, cache.streaming_held_tokens) == (True, None, True, 0)
    assert cache.match_prefix(A).device_prefix_len == 8
    assert cache.tree.held_locks == 0
    assert cache.device_pool.allocator.used_size == cache.tree.device_size == 8
    cache.sanity_check()
    s.close()  # idempotent once closed
    assert calls == [True, True]
    cache.stream("s1").close()
