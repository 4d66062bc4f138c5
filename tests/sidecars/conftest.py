"""Fixtures of the sidecar-pool tests: real caches (CPU torch pools, the real copy engines) with
a draft-model KV sidecar (layered, per token ``(2, heads, head_dim)`` like a small KV) and an
indexer-style sidecar (one small fp32 vector per token, one layer).

``make_cache(sidecars=SIDECARS, **config)`` builds a cache, registers the sidecars and starts
it; at teardown every cache is flushed, checked (``sanity_check``, no lock held) and closed
(pools back to empty, no copy thread alive, the sidecar engines' included).

``model`` (:class:`SidecarModel`) gives each token's KV and sidecar data as a function of its
whole prefix, writes them into the slots of a request and checks them bit for bit, so data
served from a wrong slot, a wrong prefix, or never copied (the device pools are clobbered
between steps) is caught.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from asynccache import CacheConfig, CacheRequest, HierarchicalCache
from asynccache.transfers.sidecars import SidecarSpec

TIMEOUT = 20.0

BASE: dict[str, Any] = {
    "page_size": 4,
    "num_layers": 2,
    "num_heads": 2,
    "head_dim": 8,
    "dtype": "float16",
    "device_tokens": 64,
    "host_tokens": 256,
    "load_back_threshold": 1,
}

DRAFT = "draft"
INDEXER = SidecarSpec(name="indexer", source="kv", token_shape=(4,), dtype="float32",
                      num_layers=1, hit_policy="all_pages")
SIDECARS = (DRAFT, INDEXER)
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.dtype])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    gb, wb = bits(got), bits(want)
    if not torch.equal(gb, wb):
        diff = (gb != wb).nonzero()
        raise AssertionError(f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}")


def register(cache: HierarchicalCache, sidecars: Sequence[Any]) -> None:
    for sc in sidecars:
        if sc == DRAFT:
            cache.register_draft_pools(num_layers=1, num_heads=2, head_dim=8)
        else:
            cache.register_sidecar_pool(sc)


class SidecarModel:
    """Each token's KV and sidecar data: deterministic functions of (pool, position, prefix)."""

    def __init__(self, cache: HierarchicalCache) -> None:
        self.cache = cache
        s = cache.shape
        self.pools: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "kv": ((s.num_layers, 2, s.num_heads, s.head_dim), s.dtype)}
        for sc in cache.sidecars:
            sh = sc.spec.shape
            self.pools[sc.name] = ((sh.num_layers, *sh.token_shape), sh.dtype)
        self._memo: dict[tuple[str, bytes], torch.Tensor] = {}

    def _token(self, pool: str, digest: bytes) -> torch.Tensor:
        t = self._memo.get((pool, digest))
        if t is None:
            shape, dtype = self.pools[pool]
            seed = int.from_bytes(hashlib.blake2b(pool.encode() + digest, digest_size=8).digest(),
                                  "little")
            vals = np.random.default_rng(seed).standard_normal(int(np.prod(shape)),
                                                               dtype=np.float32) * 4.0
            t = torch.from_numpy(vals).reshape(shape).to(dtype)
            self._memo[(pool, digest)] = t
        return t

    def expected(self, pool: str, tokens: Sequence[int], start: int = 0,
                 end: int | None = None) -> torch.Tensor:
        """KV as (layers, 2, n, heads, dim); a sidecar as (layers, n, *token_shape)."""
        toks = list(tokens)
        end = len(toks) if end is None else end
        digest = b"sidecar-model"
        out = []
        for i, tok in enumerate(toks[:end]):
            digest = hashlib.blake2b(digest + struct.pack("<QI", i, tok), digest_size=16).digest()
            if i >= start:
                out.append(self._token(pool, digest))
        dim = 2 if pool == "kv" else 1
        shape, dtype = self.pools[pool]
        if not out:
            return torch.empty((*shape[:dim], 0, *shape[dim:]), dtype=dtype)
        return torch.stack(out, dim=dim)

    def source_slots(self, sc: Any, full_slots: np.ndarray) -> np.ndarray:
        return np.asarray(full_slots)

    def write(self, slots: Any, tokens: Sequence[int], lo: int, hi: int) -> None:
        """The "forward pass": KV and every sidecar of ``tokens[lo:hi]`` into ``slots``."""
        arr = np.asarray(slots)
        self.cache.write_kv(arr, self.expected("kv", tokens, lo, hi))
        for sc in self.cache.sidecars:
            dev = sc.device.device
            idx = torch.from_numpy(self.source_slots(sc, arr).astype(np.int64)).to(dev)
            sc.device.data[:, idx] = self.expected(sc.name, tokens, lo, hi).to(dev)

    def check(self, tokens: Sequence[int], slots: Any, what: str) -> None:
        """The device KV and every sidecar in ``slots`` are those of ``tokens[:len(slots)]``."""
        arr = np.asarray(slots)
        n = len(arr)
        assert_bits_equal(self.cache.read_kv(arr).cpu(), self.expected("kv", tokens, 0, n),
                          f"{what}: KV")
        for sc in self.cache.sidecars:
            got = sc.device.read_slots(self.source_slots(sc, arr)).cpu()
            assert_bits_equal(got, self.expected(sc.name, tokens, 0, n), f"{what}: {sc.name}")

    def clobber(self) -> None:
        """Overwrite the device sidecar data of every free slot of the source pool: data that
        was never copied back would still be found there otherwise."""
        alloc = self.cache.device_pool.allocator
        all_slots = np.arange(alloc.total_size, dtype=np.int64)
        free = all_slots[~alloc.is_allocated(all_slots)]
        for sc in self.cache.sidecars:
            idx = torch.from_numpy(self.source_slots(sc, free).astype(np.int64))
            sc.device.data[:, idx.to(sc.device.device)] = 7


async def serve(cache: HierarchicalCache, model: SidecarModel, tokens: Sequence[int], *,
                finish: bool = True) -> CacheRequest:
    """admit -> load back -> check the cached prefix -> extend + write the rest -> finish."""
    return (await fetch_and_serve(cache, model, tokens, None, finish=finish))[0]


async def fetch_and_serve(cache: HierarchicalCache, model: SidecarModel, tokens: Sequence[int],
                          prefetch: str | None = "wait_complete", *,
                          finish: bool = True) -> tuple[CacheRequest, int]:
    """admit -> (``prefetch``: fetch from storage with that stop policy) -> load back -> check
    the cached prefix (KV and sidecars) -> extend + write the rest -> finish; returns the
    request and the tokens fetched from storage."""
    tokens = list(tokens)
    req = cache.admit(tokens)
    fetched = 0
    try:
        if prefetch is not None:
            fetched = await asyncio.wait_for(cache.prefetch_request(req, policy=prefetch),
                                             TIMEOUT)
        await cache.load_back_request(req)
        model.check(tokens, req.slots[: req.prefix_len], "cached prefix")
        if req.computed < len(tokens):
            lo = req.computed
            new = await cache.extend(req, len(tokens) - lo)
            model.write(new, tokens, lo, len(tokens))
    except BaseException:
        if not req.finished:
            cache.abort_req(req)
        raise
    model.check(tokens, req.slots, "request slots")
    if finish:
        cache.cache_finished_req(req)
    return req, fetched


async def run_cancelled(make: Callable[[], Awaitable[Any]], k: int) -> tuple[str, Any]:
    """Run ``make()`` as a task, let the loop turn ``k`` times, cancel it; ``("completed",
    result)`` if it finished anyway, else ``("cancelled", None)``."""
    task = asyncio.ensure_future(make())
    for _ in range(k):
        if task.done():
            break
        await asyncio.sleep(0)
    if task.done():
        return "completed", task.result()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=TIMEOUT)
    assert done, "cancelled task did not finish"
    if task.cancelled():
        return "cancelled", None
    return "completed", task.result()


async def clobber_device(cache: HierarchicalCache, model: SidecarModel) -> None:
    """Evict everything from the device and overwrite every free slot (KV and sidecars)."""
    await cache.evict_async(10_000)
    await cache.flush()
    slots = await cache.alloc_device(cache.device_available)
    s = cache.shape
    cache.write_kv(slots, torch.full((s.num_layers, 2, len(slots), s.num_heads, s.head_dim), 7.0,
                                     dtype=s.dtype, device=cache.device_pool.device))
    cache.free_device(slots)
    model.clobber()


def config(**overrides: Any) -> CacheConfig:
    return CacheConfig(**{**BASE, **overrides})


async def quiesce_and_check(cache: HierarchicalCache) -> None:
    await asyncio.wait_for(cache.flush(), TIMEOUT)
    storage = cache.storage
    if storage is not None:
        await asyncio.wait_for(storage.drain(), TIMEOUT)
        await asyncio.wait_for(cache.flush(), TIMEOUT)
    assert cache.in_flight == 0
    assert cache.tree.pending_ops == 0
    cache.sanity_check()
    assert cache.tree.held_locks == 0, f"{cache.tree.held_locks} lock receipts still held"
    if cache.host_pool is not None:
        assert cache.host_in_flight == 0, cache.host_in_flight


async def close_and_check(cache: HierarchicalCache) -> None:
    engines = [sc.engine for sc in cache.sidecars if sc.engine is not None]
    await asyncio.wait_for(cache.aclose(), TIMEOUT)
    assert cache.device_pool.allocator.used_size == 0
    if cache.host_pool is not None:
        assert cache.host_pool.allocator.used_size == 0
    for e in engines:
        assert e.closed and not [t.name for t in e.threads if t.is_alive()]


@pytest.fixture
async def make_cache(cache_factory: Any) -> AsyncIterator[Callable[..., Awaitable[HierarchicalCache]]]:
    async with cache_factory(config, quiesce_and_check, close_and_check) as make:

        async def build(*, sidecars: Sequence[Any] = SIDECARS, start: bool = True,
                        **overrides: Any) -> HierarchicalCache:
            cache = await make(start=False, **overrides)
            register(cache, sidecars)
            if start:
                await cache.start()
            return cache

        yield build


@pytest.fixture
def kit() -> types.SimpleNamespace:
    return types.SimpleNamespace(SidecarModel=SidecarModel, serve=serve, TIMEOUT=TIMEOUT,
                                 run_cancelled=run_cancelled, SIDECARS=SIDECARS, clobber_device=clobber_device,
                                 fetch_and_serve=fetch_and_serve,
                                 assert_bits_equal=assert_bits_equal, INDEXER=INDEXER,
                                 DRAFT=DRAFT, config=config)
