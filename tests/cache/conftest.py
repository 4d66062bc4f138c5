"""Fixtures of the HierarchicalCache (async facade) tests.

Every cache is real: CPU torch pools from ``asynccache.transfers.pools`` and the real copy engine (a worker
thread). The tests run with ``--import-mode=importlib``, so helpers are handed out through the
``kit`` fixture rather than imported from a sibling module.

``make_cache(**overrides)`` builds and starts a cache on small pools; at teardown it checks, for
every cache it made (unless ``strict=False``):

* ``flush()`` completes, ``in_flight == 0``, ``sanity_check()`` passes (tree invariants and pool
  accounting) and no lock receipt is held (every test finishes its requests);
* ``aclose()`` completes, both allocators are back to ``used_size == 0`` and no copy thread of
  the cache (nor any new ``asynccache-copy*`` thread) is alive.
"""

from __future__ import annotations

import asyncio
import faulthandler
import hashlib
import struct
import threading
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from asynccache import CacheConfig, CacheRequest, HierarchicalCache
from asynccache.errors import PoolExhaustedError

TIMEOUT = 20.0  # seconds: a hang fails the test instead of blocking the run
HANG_GUARD = 120.0  # seconds per test: past it, dump every thread's stack and exit

BASE = {
    "page_size": 4,
    "num_layers": 2,
    "num_heads": 2,
    "head_dim": 8,
    "dtype": "float16",
    "device_tokens": 64,
    "host_tokens": 256,
    "load_back_threshold": 1,
}

_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a float tensor (bit-exact comparisons, NaN-safe)."""
    return t.contiguous().view(_BITS[t.dtype])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = "KV") -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    gb, wb = bits(got), bits(want)
    if not torch.equal(gb, wb):
        diff = (gb != wb).nonzero()
        raise AssertionError(f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}")


class KVModel:
    """The KV a model would compute: a deterministic function of the token *prefix*.

    The KV of token ``i`` of a sequence depends on ``(i, tokens[0..i])`` through a chained digest
    (like real attention KV, which depends on the whole prefix), so serving the KV of the wrong
    prefix, the wrong position or a recycled slot is detected. ``expected(tokens)`` is
    ``(layers, 2, n, heads, head_dim)`` in the cache's dtype.
    """

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.per_token = num_layers * 2 * num_heads * head_dim
        self.shape = (num_layers, 2, num_heads, head_dim)
        self.dtype = dtype
        self._memo: dict[bytes, torch.Tensor] = {}

    @classmethod
    def of(cls, cache: HierarchicalCache) -> KVModel:
        s = cache.shape
        return cls(s.num_layers, s.num_heads, s.head_dim, s.dtype)

    def _token(self, digest: bytes) -> torch.Tensor:
        t = self._memo.get(digest)
        if t is None:
            rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
            vals = rng.standard_normal(self.per_token, dtype=np.float32) * 4.0
            t = torch.from_numpy(vals).reshape(self.shape).to(self.dtype)
            self._memo[digest] = t
        return t

    def expected(self, tokens: Sequence[int], start: int = 0, end: int | None = None) -> torch.Tensor:
        toks = list(tokens)
        end = len(toks) if end is None else end
        digest = b"kv-model"
        out = []
        for i, tok in enumerate(toks[:end]):
            digest = hashlib.blake2b(digest + struct.pack("<QI", i, tok), digest_size=16).digest()
            if i >= start:
                out.append(self._token(digest))
        if not out:
            return torch.empty((self.shape[0], 2, 0, *self.shape[2:]), dtype=self.dtype)
        return torch.stack(out, dim=2)

    def check(self, cache: HierarchicalCache, tokens: Sequence[int], slots: Any,
              what: str = "served KV") -> None:
        """The device KV in ``slots`` is bit for bit the KV of ``tokens[:len(slots)]``."""
        arr = np.asarray(slots)
        assert_bits_equal(cache.read_kv(arr), self.expected(tokens, 0, len(arr)), what)


def event_hashes(tokens: Sequence[int], page_size: int) -> list[int]:
    """Independent KV-event block hashes: SHA-256 chain over uint32-LE pages, first 8 bytes BE."""
    out, prev = [], b""
    whole = len(tokens) - len(tokens) % page_size
    for i in range(0, whole, page_size):
        prev = hashlib.sha256(prev + struct.pack(f"<{page_size}I", *tokens[i : i + page_size])).digest()
        out.append(int.from_bytes(prev[:8], "big", signed=True))
    return out


async def run_cancelled(make: Callable[[], Awaitable[Any]], k: int,
                        before_cancel: Callable[[], Any] | None = None) -> tuple[str, Any]:
    """Run ``make()`` as a task, let the loop turn ``k`` times, then cancel it.

    Returns ``("completed", result)`` when the task finished within those ``k`` iterations (or
    finished despite the cancel), else ``("cancelled", None)``. ``k = 0`` cancels the task before
    its first step. ``before_cancel()`` runs just before the cancel is delivered.
    """
    task = asyncio.ensure_future(make())
    for _ in range(k):
        if task.done():
            break
        await asyncio.sleep(0)
    if task.done():
        return "completed", task.result()
    if before_cancel is not None:
        before_cancel()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=TIMEOUT)
    assert done, "cancelled task did not finish"
    if task.cancelled():
        return "cancelled", None
    return "completed", task.result()


async def serve(cache: HierarchicalCache, model: KVModel, tokens: Sequence[int], *,
                load: bool = True, chunk: int | None = None, finish: bool = True,
                yields: int = 0, rematch: bool = False, admit_yields: int = 0) -> CacheRequest:
    """Serve one request the way a scheduler would, checking every KV it is served.

    admit -> (``rematch``: wait for loads of the prefix others started, then admit again)
    -> (load back its host hit) -> check the cached prefix's KV -> extend and write the KV
    of the rest (in chunks of ``chunk`` tokens with ``cache_unfinished_req`` between them,
    checking the request's slots after each) -> ``cache_finished_req``.

    Deliberately no ``asyncio.wait_for`` around the calls: it would add a loop turn between
    ``admit`` and the load (see test_bugs.py, stale host hits) and let copies complete between
    calls that tests expect to see in flight. Hangs are caught by the callers' timeouts and by
    ``hang_guard``.
    """
    tokens = list(tokens)
    req = cache.admit(tokens)
    try:
        for _ in range(admit_yields):  # a scheduler doing other work between match and load
            await asyncio.sleep(0)
        while rematch and req.pending_loads:
            # Someone else is loading part of our prefix: wait, then match again (a deeper
            # part may have been loaded meanwhile, so the old host hit is stale).
            await cache.wait_loads(req.pending_loads)
            cache.abort_req(req)
            req = cache.admit(tokens)
        if load:
            await cache.load_back_request(req)
        else:
            await cache.wait_loads(req.pending_loads)
        for _ in range(yields):
            await asyncio.sleep(0)
        model.check(cache, tokens, req.slots[: req.prefix_len], "cached prefix")
        step = chunk or len(tokens)
        while req.computed < len(tokens):
            lo = req.computed
            hi = min(len(tokens), lo + step)
            new = await cache.extend(req, hi - lo)
            cache.write_kv(new, model.expected(tokens, lo, hi))
            if hi < len(tokens):
                cache.cache_unfinished_req(req)
                model.check(cache, tokens, req.slots, "request slots after cache_unfinished_req")
    except BaseException:
        if not req.finished:
            cache.abort_req(req)  # release the request's lock and slots, then re-raise
        raise
    model.check(cache, tokens, req.slots, "request slots")
    if finish:
        cache.cache_finished_req(req)
    return req


def copy_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("asynccache-copy") and t.is_alive()}


async def close_and_check(cache: HierarchicalCache,
                          baseline: set[threading.Thread] | None = None) -> None:
    """aclose, then: both pools fully free, the cache's copy threads gone (and, given a
    ``baseline``, no copy thread alive that was not alive before)."""
    engine = cache.copy_engine
    await asyncio.wait_for(cache.aclose(), TIMEOUT)
    assert cache.device_pool.allocator.used_size == 0, cache.device_pool.allocator
    if cache.host_pool is not None:
        assert cache.host_pool.allocator.used_size == 0, cache.host_pool.allocator
    if engine is not None:
        assert not [t.name for t in engine.threads if t.is_alive()]
    if baseline is not None:
        assert not (copy_threads() - baseline), [t.name for t in copy_threads() - baseline]


async def quiesce_and_check(cache: HierarchicalCache) -> None:
    """flush, then the at-rest invariants: nothing in flight, accounting balances, no lock held."""
    await asyncio.wait_for(cache.flush(), TIMEOUT)
    assert cache.in_flight == 0
    assert cache.tree.pending_ops == 0
    cache.sanity_check()
    assert cache.tree.held_locks == 0, f"{cache.tree.held_locks} lock receipts still held"


def config(**overrides: Any) -> CacheConfig:
    return CacheConfig(**{**BASE, **overrides})


@pytest.fixture(autouse=True)
def hang_guard() -> Any:
    """A test stuck outside an ``asyncio.wait_for`` (e.g. a deadlocked thread) must not block
    the run: past ``HANG_GUARD`` seconds the stacks are dumped and the process exits."""
    faulthandler.dump_traceback_later(HANG_GUARD, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
async def make_cache(cache_factory: Any) -> AsyncIterator[Callable[..., Awaitable[HierarchicalCache]]]:
    async with cache_factory(config, quiesce_and_check, close_and_check) as make:
        yield make


@pytest.fixture
def kit() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        KVModel=KVModel,
        bits=bits,
        assert_bits_equal=assert_bits_equal,
        event_hashes=event_hashes,
        run_cancelled=run_cancelled,
        serve=serve,
        quiesce_and_check=quiesce_and_check,
        close_and_check=close_and_check,
        copy_threads=copy_threads,
        config=config,
        BASE=BASE,
        TIMEOUT=TIMEOUT,
        PoolExhaustedError=PoolExhaustedError,
    )
