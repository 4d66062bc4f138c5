"""asynccache's storage backends as SGLang's HiCache L3: the adapter created through SGLang's
own backend factory (``dynamic``), called the way SGLang's cache controller calls it (page
tensors from its host pool, from its own threads), over a real file directory and a real S3
server; pages it writes are asynccache's pages and the other way round, bit-exact."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib

import pytest
import torch

from asynccache.storage.factory import open_backend

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from asynccache.integrations.sglang import AsyncCacheStorage, layout_for
except Exception as exc:  # not installed (scripts/install_sglang_cpu.sh installs it)
    pytest.skip(f"SGLang's HiCache storage interface does not import here ({exc!r}); run "
                "scripts/install_sglang_cpu.sh", allow_module_level=True)

PAGE = 4
LAYERS, HEADS, DIM = 2, 2, 8
PAGE_NUMEL = 2 * LAYERS * PAGE * HEADS * DIM  # SGLang's flat data page: (2, L, page, H, D)


def _config(url: str, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="tiny/llama",
        extra_config={"backend_name": "asynccache", "class_name": "AsyncCacheStorage",
                      "module_path": "asynccache.integrations.sglang", "url": url,
                      "page_size": PAGE, "kv_dtype": "float16", **extra})


def _create(url: str, **extra) -> AsyncCacheStorage:
    backend = StorageBackendFactory.create_backend("dynamic", _config(url, **extra), None)
    assert isinstance(backend, AsyncCacheStorage)
    return backend


def _keys(n: int, salt: str = "") -> list[str]:
    """SGLang-style page hashes: a SHA-256 chain over the page's token ids."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{salt}{i}".encode()).digest()
        out.append(prev.hex())
    return out


def _pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGE_NUMEL, generator=g).to(torch.float16) for _ in range(n)]


def _round_trip(storage: AsyncCacheStorage) -> None:
    keys, pages = _keys(6), _pages(6, seed=1)
    assert storage.batch_exists(keys) == 0
    assert storage.batch_set(keys[:4], pages[:4]) is True
    assert storage.batch_exists(keys) == 4  # the consecutive-prefix count
    assert storage.exists(keys[3]) and not storage.exists(keys[4])
    dst = [torch.zeros(PAGE_NUMEL, dtype=torch.float16) for _ in keys]
    got = storage.batch_get(keys, dst)
    for i in range(4):
        assert got[i] is dst[i] and torch.equal(got[i].view(torch.int16), pages[i].view(torch.int16))
    assert got[4] is None and got[5] is None
    assert storage.set(keys[4], pages[4]) is True
    one = storage.get(keys[4], torch.zeros(PAGE_NUMEL, dtype=torch.float16))
    assert one is not None and torch.equal(one.view(torch.int16), pages[4].view(torch.int16))
    assert isinstance(storage.get_stats(), dict)


def test_factory_creates_it_and_pages_round_trip_on_files(tmp_path):
    storage = _create(f"file://{tmp_path}")
    try:
        _round_trip(storage)
        assert storage.get_stats()["objects"] == 5
        storage.clear()
        assert storage.batch_exists(_keys(6)) == 0
    finally:
        storage.close()


def test_round_trip_on_a_real_s3_server(asynccache_s3):
    storage = _create(asynccache_s3.url("sglang-adapter"),
                      backend_kwargs=asynccache_s3.backend_kwargs())
    try:
        _round_trip(storage)
        storage.clear()
    finally:
        storage.close()


def test_calls_from_sglang_threads_at_once(tmp_path):
    storage = _create(f"file://{tmp_path}")
    try:
        def worker(t: int) -> bool:
            keys, pages = _keys(8, salt=f"t{t}"), _pages(8, seed=t)
            assert storage.batch_set(keys, pages)
            dst = [torch.zeros(PAGE_NUMEL, dtype=torch.float16) for _ in keys]
            got = storage.batch_get(keys, dst)
            return all(g is not None and torch.equal(g, p) for g, p in zip(got, pages, strict=True))

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert all(pool.map(worker, range(8)))
        assert storage.batch_exists(_keys(8, salt="t3")) == 8
    finally:
        storage.close()


def test_pages_cross_between_sglang_and_asynccache_bit_exact(tmp_path):
    storage = _create(f"file://{tmp_path}")
    try:
        keys, pages = _keys(5), _pages(5, seed=7)
        assert storage.batch_set(keys[:3], pages[:3])
        layout = layout_for(_config(""), page_size=PAGE, kv_dtype="float16")
        assert layout == storage.layout

        async def ours() -> list[torch.Tensor]:
            backend = await open_backend(f"file://{tmp_path}", layout)
            try:
                assert await backend.exists_prefix(keys) == 3
                bufs = [torch.zeros(PAGE_NUMEL, dtype=torch.float16) for _ in range(3)]
                assert await backend.get_batch(keys[:3], bufs) == [True] * 3
                assert await backend.set_batch(keys[3:], pages[3:]) == [True, True]
                return bufs
            finally:
                await backend.aclose()

        read = asyncio.run(ours())
        for a, b in zip(read, pages[:3], strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert storage.batch_exists(keys) == 5  # asynccache's writes, seen by SGLang's side
        dst = [torch.zeros(PAGE_NUMEL, dtype=torch.float16) for _ in range(2)]
        got = storage.batch_get(keys[3:], dst)
        assert all(torch.equal(g.view(torch.int16), p.view(torch.int16))
                   for g, p in zip(got, pages[3:], strict=True))
    finally:
        storage.close()


def test_bad_extra_config_names_the_field(tmp_path):
    from asynccache.errors import ConfigError

    with pytest.raises(ConfigError, match="'url'"):
        AsyncCacheStorage(_config(None))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'page_size'"):
        AsyncCacheStorage(_config(f"file://{tmp_path}", page_size=0))


def test_missing_page_tensors_are_named_before_any_io(tmp_path):
    from asynccache.errors import InvalidInputError

    storage = _create(f"file://{tmp_path}")
    try:
        keys = _keys(2)
        with pytest.raises(InvalidInputError, match=r"batch_get: target_locations\[1\]"):
            storage.batch_get(keys, [torch.zeros(PAGE_NUMEL, dtype=torch.float16), None])
        with pytest.raises(InvalidInputError, match=r"batch_get: target_locations\[0\] is not a tensor: None"):
            storage.get(keys[0])
        with pytest.raises(InvalidInputError, match="batch_set needs values"):
            storage.batch_set(keys, _pages(1, seed=0))
        assert storage.batch_exists(keys) == 0  # nothing was written
    finally:
        storage.close()
