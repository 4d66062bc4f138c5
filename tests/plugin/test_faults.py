"""faults(): raw-I/O faults for the built-in backends, protocol-level faults for any other."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import pytest

from asynccache import HierarchicalCache
from asynccache.l3 import StoragePolicy
from asynccache.storage.base import StorageLayout, readable_view, writable_view
from asynccache.testing import (
    FaultInjectingBackend,
    FaultKind,
    FaultRule,
    KVFactory,
    KVMismatchError,
    faults,
)

POLICY = StoragePolicy(prefetch_threshold=0, prefetch_policy="wait_complete")


def keys(n: int) -> list[str]:
    return [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]


class MemoryBackend:
    """A user's own backend: the storage protocol over a dict, no fault hook."""

    def __init__(self, layout: StorageLayout) -> None:
        self._layout = layout
        self.pages: dict[str, bytes] = {}

    @property
    def layout(self) -> StorageLayout:
        return self._layout

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.pages), len(keys))

    async def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        out = []
        for i, (k, buf) in enumerate(zip(keys, buffers, strict=True)):
            data = self.pages.get(k)
            if data is not None:
                writable_view(buf, i)[:] = data
            out.append(data is not None)
        return out

    async def set_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        for i, (k, buf) in enumerate(zip(keys, buffers, strict=True)):
            self.pages.setdefault(k, bytes(readable_view(buf, i)))
        return [True] * len(keys)

    async def delete(self, keys: Sequence[str]) -> int:
        return sum(self.pages.pop(k, None) is not None for k in keys)

    async def clear(self) -> int:
        n = len(self.pages)
        self.pages.clear()
        return n

    def stats(self) -> dict[str, Any]:
        return {"objects": len(self.pages)}

    async def aclose(self) -> None:
        pass


async def test_built_in_backends_get_raw_io_faults(asynccache_file_storage: Any) -> None:
    ks = keys(4)
    pages = [bytes([i]) * 256 for i in range(4)]
    assert await asynccache_file_storage.set_batch(ks, pages) == [True] * 4

    flaky = faults(asynccache_file_storage, "eio", FaultRule(FaultKind.FLIP_BYTES, ops=frozenset(
        {"read"}), keys=frozenset(ks[3:])), ops={"read"}, keys=ks[1:2])
    assert isinstance(flaky, FaultInjectingBackend) and flaky.inner is asynccache_file_storage
    bufs = [bytearray(256) for _ in ks]
    assert await flaky.get_batch(ks, bufs) == [True, False, True, False]  # EIO; checksum caught
    assert flaky.injected == {("read", "eio"): 1, ("read", "flip_bytes"): 1}
    assert bufs[0] == pages[0]
    flaky.clear_rules()
    assert await flaky.get_batch(ks[:3], bufs[:3]) == [True, True, True]


def test_bad_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault kind 'eoi'"):
        faults(MemoryBackend(StorageLayout(model="m", page_size=4)), "eoi")
    with pytest.raises(ValueError, match="short_read faults need raw-I/O access"):
        faults(MemoryBackend(StorageLayout(model="m", page_size=4)), "short_read")


async def test_any_protocol_backend_gets_protocol_faults() -> None:
    mem = MemoryBackend(StorageLayout(model="m", page_size=4))
    ks = keys(4)
    pages = [bytes([i + 1]) * 64 for i in range(4)]
    wrapped = faults(mem, "enospc", ops={"write"}, keys=ks[2:3])
    assert await wrapped.set_batch(ks, pages) == [True, True, False, True]  # ENOSPC: skipped
    assert sorted(mem.pages) == sorted(ks[:2] + ks[3:])
    mem.pages[ks[2]] = pages[2]

    wrapped.clear_rules()
    wrapped.add_rule(FaultRule(FaultKind.DROP, ops=frozenset({"exists"}), keys=frozenset(ks[1:2])))
    assert await wrapped.exists_prefix(ks) == 1  # the dropped lookup ends the prefix

    wrapped.clear_rules()
    wrapped.add_rule(FaultRule(FaultKind.FLIP_BYTES, ops=frozenset({"read"}), times=1))
    wrapped.add_rule(FaultRule(FaultKind.DELAY, ops=frozenset({"read"}), delay_s=0.05))
    bufs = [bytearray(64) for _ in ks]
    t0 = time.perf_counter()
    assert await wrapped.get_batch(ks, bufs) == [True] * 4  # corrupt, and says nothing
    assert time.perf_counter() - t0 >= 0.05
    assert [b == p for b, p in zip(bufs, pages, strict=True)] == [False, True, True, True]

    wrapped.clear_rules()
    wrapped.add_rule(FaultRule(FaultKind.EIO, ops=frozenset({"delete"})))
    assert await wrapped.delete(ks) == 0
    assert wrapped.stats()["injected"]["delete.eio"] == 4
    await wrapped.aclose()


@pytest.mark.asynccache_config(write_policy="write_through")
async def test_the_kv_check_catches_a_backend_serving_corrupt_pages(
    asynccache_cache: HierarchicalCache, asynccache_cache_factory: Any, asynccache_kv: KVFactory
) -> None:
    mem = MemoryBackend(asynccache_cache.storage_layout())
    prompt = asynccache_kv.prompt(32)
    asynccache_cache.attach_storage(mem, POLICY)
    await asynccache_kv.serve(asynccache_cache, prompt)
    await asynccache_cache_factory.close(asynccache_cache)
    assert len(mem.pages) == 8

    restarted = await asynccache_cache_factory()
    restarted.attach_storage(faults(mem, "flip_bytes", ops={"read"}, times=1), POLICY)
    with pytest.raises(KVMismatchError, match=r"cached prefix of req-\d+: 1 of 32 tokens differ"):
        await asynccache_kv.serve(restarted, prompt, prefetch=True)
    # serve() aborted the request: the teardown finds nothing held.
