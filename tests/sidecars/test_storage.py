"""Sidecars in storage (L3): each page's sidecar data is written as ``<page key>.<name>`` in the
same backend call as the page and read back with it. A prefetch keeps the longest prefix every
pool can restore: KV-derived ``all_pages`` sidecars clamp it to the shared minimum, any other
sidecar makes it all or nothing. File and S3 (SeaweedFS) backends, bit-exact."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asynccache.l3 import StoragePolicy
from asynccache.transfers.sidecars import SidecarSpec

POLICY = StoragePolicy(prefetch_threshold=4)
SEQ = list(range(3000, 3000 + 4 * 40 + 3))  # 40 pages + an unaligned tail
STRICT = SidecarSpec(name="window", source="kv", token_shape=(2,), dtype="float16",
                     hit_policy="trailing_pages")

CONFIG = {"device_tokens": 256, "host_tokens": 512, "write_policy": "write_through",
          "host_layout": "page_first"}


async def _write(make_cache, kit, open_backend, sidecars, **config):
    """Cache A writes SEQ through host to storage; returns its page keys (A is closed)."""
    a = await make_cache(sidecars=sidecars, **{**CONFIG, **config})
    a.attach_storage(await open_backend(a), POLICY)
    model = kit.SidecarModel(a)
    await kit.serve(a, model, SEQ)
    await asyncio.wait_for(a.flush(), kit.TIMEOUT)
    await asyncio.wait_for(a.storage.drain(), kit.TIMEOUT)
    keys = a.tree.node_page_keys(a.match_prefix(SEQ).best_node)
    assert len(keys) == 40
    await a.detach_storage()
    await a.aclose()
    return keys


async def _fresh(make_cache, open_backend, sidecars, **config):
    b = await make_cache(sidecars=sidecars, **{**CONFIG, **config})
    b.attach_storage(await open_backend(b), POLICY)
    return b


@pytest.fixture
def file_backend(make_file_backend):
    return make_file_backend


@pytest.fixture(params=["cache", "buffer_only"])
def host_mode(request):
    """Both host modes: the L2 tier (cache) and staging only (buffer_only)."""
    CONFIG["host_mode"] = request.param
    yield request.param
    CONFIG.pop("host_mode")


async def _round_trip(make_cache, kit, open_backend, layout):
    await _write(make_cache, kit, open_backend, kit.SIDECARS, host_layout=layout)
    b = await _fresh(make_cache, open_backend, kit.SIDECARS, host_layout=layout)
    model = kit.SidecarModel(b)
    req, fetched = await kit.fetch_and_serve(b, model, SEQ)  # checks KV and both sidecars
    assert fetched == 160 and req.prefix_len == 160


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_round_trip_file(make_cache, kit, file_backend, storage_dir, layout, host_mode):
    await _round_trip(make_cache, kit, file_backend, layout)
    names = {p.name for p in storage_dir.rglob("*") if p.is_file()}
    assert sum(".draft" in n for n in names) == 40 and sum(".indexer" in n for n in names) == 40


@pytest.mark.seaweedfs
async def test_round_trip_s3(make_cache, kit, make_s3_backend, seaweed, host_mode):
    prefix = f"sidecars-{np.random.default_rng().integers(1 << 40)}"

    async def open_backend(cache):
        return make_s3_backend(seaweed, cache, prefix)

    await _round_trip(make_cache, kit, open_backend, "page_first")


@pytest.mark.parametrize("missing", ["indexer", "draft", "kv"])
async def test_a_missing_object_clamps_the_prefix(make_cache, kit, file_backend, missing, host_mode):
    """KV-derived all_pages sidecars: the prefetch keeps the pages before the first page any
    pool lacks (13 of 40), bit-exact; the rest is computed."""
    keys = await _write(make_cache, kit, file_backend, kit.SIDECARS)
    b = await _fresh(make_cache, file_backend, kit.SIDECARS)
    name = keys[13] if missing == "kv" else f"{keys[13]}.{missing}"
    assert await b.storage.backend.delete([name]) == 1
    model = kit.SidecarModel(b)
    req, fetched = await kit.fetch_and_serve(b, model, SEQ)
    assert fetched == 13 * 4 and req.prefix_len == 13 * 4
    # The computed pages were written again (the missing object included).
    await asyncio.wait_for(b.flush(), kit.TIMEOUT)
    await asyncio.wait_for(b.storage.drain(), kit.TIMEOUT)
    assert await b.storage.backend.exists_prefix([name]) == 1


async def test_a_trailing_pages_sidecar_is_all_or_nothing(make_cache, kit, file_backend, host_mode):
    sidecars = (kit.INDEXER, STRICT)
    keys = await _write(make_cache, kit, file_backend, sidecars)
    b = await _fresh(make_cache, file_backend, sidecars)
    model = kit.SidecarModel(b)
    assert await b.storage.backend.delete([f"{keys[30]}.window"]) == 1
    req, fetched = await kit.fetch_and_serve(b, model, SEQ)
    assert fetched == 0 and req.prefix_len == 0
    await asyncio.wait_for(b.flush(), kit.TIMEOUT)
    await asyncio.wait_for(b.storage.drain(), kit.TIMEOUT)
    assert b.host_in_flight == 0
    b.sanity_check()


async def test_a_trailing_pages_sidecar_whole_prefix_arrives(make_cache, kit, file_backend, host_mode):
    sidecars = (kit.INDEXER, STRICT)
    await _write(make_cache, kit, file_backend, sidecars)
    b = await _fresh(make_cache, file_backend, sidecars)
    req, fetched = await kit.fetch_and_serve(b, kit.SidecarModel(b), SEQ)
    assert fetched == 160 and req.prefix_len == 160
