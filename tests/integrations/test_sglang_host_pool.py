"""The adapter's v1 calls (``batch_set_v1`` / ``batch_get_v1``) over SGLang's own host pool
(``MHATokenToKVPoolHost`` built from SGLang's ``MHATokenToKVPool`` on CPU, unpinned), in each
of its page layouts: pages written from one SGLang host pool come back into another one
bit-exact, through files and a real S3 server, and are the same objects SGLang's generic calls
and asynccache's own backends read and write.

SGLang's host-pool modules reach its vision configs, which import torchvision at module level;
they are imported under :mod:`asynccache.integrations.sglang_import_guard` (torchvision cannot
be installed with this machine's CPU torch, and nothing here calls it)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.integrations.sglang_import_guard import missing_package_stand_in
from asynccache.storage.factory import open_backend

try:
    with missing_package_stand_in():
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from asynccache.integrations.sglang import AsyncCacheStorage
except Exception as exc:  # not installed (scripts/install_sglang_cpu.sh installs it)
    pytest.skip(f"SGLang's host pool does not import here ({exc!r}); run "
                "scripts/install_sglang_cpu.sh", allow_module_level=True)

PAGE = 4
LAYERS, HEADS, DIM = 3, 2, 8
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def _device_pool() -> MHATokenToKVPool:
    return MHATokenToKVPool(64, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False,
                            start_layer=0, end_layer=LAYERS)


def _host_pool(layout: str) -> MHATokenToKVPoolHost:
    kv = _device_pool()
    return MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout, pin_memory=False,
        device_capacity_tokens=kv.size, start_layer=kv.start_layer, end_layer=kv.end_layer)


def _config(url: str, layout: str, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first",  # as SGLang's controller sets it
        model_name="tiny/llama",
        extra_config={"backend_name": "asynccache", "class_name": "AsyncCacheStorage",
                      "module_path": "asynccache.integrations.sglang", "url": url,
                      "page_size": PAGE, "kv_dtype": "float16", "interface_v1": 1, **extra})


def _attach(url: str, host: MHATokenToKVPoolHost, **extra) -> AsyncCacheStorage:
    """As SGLang's controller attaches a storage backend: the factory, then the host pool."""
    storage = StorageBackendFactory.create_backend("dynamic", _config(url, host.layout, **extra),
                                                   host)
    assert isinstance(storage, AsyncCacheStorage)
    storage.register_mem_pool_host(host)
    return storage


def _keys(n: int, salt: str = "") -> list[str]:
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{salt}{i}".encode()).digest()
        out.append(prev.hex())
    return out


def _fill(host: MHATokenToKVPoolHost, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    flat = host.kv_buffer.view(-1)
    flat.copy_(torch.randn(flat.numel(), generator=g).to(host.dtype))


def _page(host: MHATokenToKVPoolHost, start: int) -> torch.Tensor:
    """A page's bytes in SGLang's flat order, as 16-bit ints (bit-exact comparisons)."""
    return host.get_data_page(start, flat=True).view(torch.int16).clone()


def _starts(indices: torch.Tensor) -> list[int]:
    return indices[::PAGE].tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_go_from_one_sglang_host_pool_into_another_bit_exact(tmp_path, layout):
    src, dst = _host_pool(layout), _host_pool(layout)
    _fill(src, seed=1)
    _fill(dst, seed=2)
    keys = _keys(5)
    src_idx = src.alloc(5 * PAGE)
    dst.alloc(3 * PAGE)  # the reader's pages sit elsewhere in its pool
    dst_idx = dst.alloc(5 * PAGE)
    writer = _attach(f"file://{tmp_path}", src)
    reader = _attach(f"file://{tmp_path}", dst)
    try:
        assert writer.layout.kv_layout == layout  # objects named for the pool's byte order
        assert writer.batch_exists(keys) == 0
        assert writer.batch_set_v1(keys[:4], src_idx[: 4 * PAGE]) == [True] * 4
        assert reader.batch_exists(keys) == 4
        before = _page(dst, _starts(dst_idx)[4])
        assert reader.batch_get_v1(keys, dst_idx) == [True] * 4 + [False]
        for s, d in zip(_starts(src_idx)[:4], _starts(dst_idx)[:4], strict=True):
            assert torch.equal(_page(dst, d), _page(src, s))
        assert torch.equal(_page(dst, _starts(dst_idx)[4]), before)  # a miss writes nothing
        assert writer.get_stats()["objects"] == 4
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_v1_and_generic_calls_and_asynccache_share_objects(tmp_path, layout):
    host = _host_pool(layout)
    _fill(host, seed=3)
    idx = host.alloc(6 * PAGE)
    starts = _starts(idx)
    keys = _keys(6, salt="mix")
    storage = _attach(f"file://{tmp_path}", host)
    try:
        # v1 writes pages 0-1; SGLang's generic path (controller._generic_page_set) writes 2-3
        assert storage.batch_set_v1(keys[:2], idx[: 2 * PAGE]) == [True, True]
        assert storage.batch_set(keys[2:4], [host.get_data_page(s) for s in starts[2:4]])
        # the generic path (controller._generic_page_get) reads what v1 wrote ...
        flat = [host.get_dummy_flat_data_page() for _ in range(2)]
        got = storage.batch_get(keys[:2], flat)
        for page, s in zip(got, starts[:2], strict=True):
            assert page is not None and torch.equal(page.view(torch.int16), _page(host, s))

        # ... and asynccache's own backend reads all four and writes 4-5
        async def ours() -> list[torch.Tensor]:
            backend = await open_backend(f"file://{tmp_path}", storage.layout)
            try:
                assert await backend.exists_prefix(keys) == 4
                bufs = [torch.empty_like(flat[0]) for _ in range(4)]
                assert await backend.get_batch(keys[:4], bufs) == [True] * 4
                more = [host.get_data_page(s) for s in starts[4:]]
                assert await backend.set_batch(keys[4:], more) == [True, True]
                return bufs
            finally:
                await backend.aclose()

        read = asyncio.run(ours())
        for buf, s in zip(read, starts[:4], strict=True):
            assert torch.equal(buf.view(torch.int16), _page(host, s))
        expected = [_page(host, s) for s in starts]
        host.kv_buffer.zero_()
        assert storage.batch_get_v1(keys, idx) == [True] * 6  # v1 reads everyone's pages
        for s, want in zip(starts, expected, strict=True):
            assert torch.equal(_page(host, s), want)
    finally:
        storage.close()


def test_host_pool_pages_through_a_real_s3_server(asynccache_s3):
    src, dst = _host_pool("page_first"), _host_pool("page_first")
    _fill(src, seed=4)
    keys = _keys(3, salt="s3")
    src_idx, dst_idx = src.alloc(3 * PAGE), dst.alloc(3 * PAGE)
    url = asynccache_s3.url("sglang-host-pool")
    writer = _attach(url, src, backend_kwargs=asynccache_s3.backend_kwargs())
    reader = _attach(url, dst, backend_kwargs=asynccache_s3.backend_kwargs())
    try:
        assert writer.batch_set_v1(keys, src_idx) == [True] * 3
        assert reader.batch_exists(keys) == 3
        assert reader.batch_get_v1(keys, dst_idx) == [True] * 3
        for s, d in zip(_starts(src_idx), _starts(dst_idx), strict=True):
            assert torch.equal(_page(dst, d), _page(src, s))

        async def ours() -> list[torch.Tensor]:  # asynccache's own S3 backend, same objects
            backend = await open_backend(url, writer.layout, **asynccache_s3.backend_kwargs())
            try:
                bufs = [torch.empty(src.get_data_page(0).numel(), dtype=torch.float16)
                        for _ in keys]
                assert await backend.get_batch(keys, bufs) == [True] * 3
                more = torch.randn(bufs[0].numel()).to(torch.float16)
                assert await backend.set_batch([extra], [more]) == [True]
                return [*bufs, more]
            finally:
                await backend.aclose()

        extra = _keys(4, salt="s3")[3]
        *read, more = asyncio.run(ours())
        for buf, s in zip(read, _starts(src_idx), strict=True):
            assert torch.equal(buf.view(torch.int16), _page(src, s))
        one = dst.alloc(PAGE)
        assert reader.batch_get_v1([extra], one) == [True]
        assert torch.equal(_page(dst, int(one[0])), more.view(torch.int16))
        writer.clear()
        assert writer.batch_exists(keys) == 0
    finally:
        writer.close()
        reader.close()


def test_v1_bad_input_is_named_before_any_io(tmp_path):
    host = _host_pool("layer_first")
    idx = host.alloc(2 * PAGE)
    keys = _keys(2)
    storage = StorageBackendFactory.create_backend("dynamic",
                                                   _config(f"file://{tmp_path}", "layer_first"),
                                                   host)
    try:
        with pytest.raises(ConfigError, match="register_mem_pool_host"):
            storage.batch_set_v1(keys, idx)
        storage.register_mem_pool_host(host)
        with pytest.raises(InvalidInputError, match=r"2 keys need 8 host indices .* got 4"):
            storage.batch_set_v1(keys, idx[:PAGE])
        with pytest.raises(InvalidInputError, match="1-D tensor"):
            storage.batch_get_v1(keys, idx.tolist())
        with pytest.raises(InvalidInputError, match="starts at host index 1"):
            storage.batch_get_v1(keys[:1], idx[1 : PAGE + 1])
        assert storage.batch_exists(keys) == 0  # nothing was written
        other = _host_pool("layer_first")
        other.page_size = PAGE * 2
        with pytest.raises(ConfigError, match="page_size 8"):
            storage.register_mem_pool_host(other)
    finally:
        storage.close()
