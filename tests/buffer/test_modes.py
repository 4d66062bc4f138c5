"""host_mode: validation, and a buffer-only cache without storage (no L2: eviction deletes)."""

from __future__ import annotations

import numpy as np
import pytest

from asynccache import CacheConfig
from asynccache.errors import ConfigError, InvalidInputError


def test_host_mode_validation_names_the_value(kit) -> None:
    base = {k: v for k, v in kit.BASE.items() if k != "host_mode"}
    assert CacheConfig(**base).host_mode == "cache"
    with pytest.raises(ConfigError, match="unknown host_mode 'l2'"):
        CacheConfig(**base, host_mode="l2")
    with pytest.raises(ConfigError, match="host_tokens or host_bytes"):
        CacheConfig(**{**base, "host_tokens": None}, host_mode="buffer_only")
    with pytest.raises(ConfigError, match=r"write-through write_policy.*'write_back'"):
        CacheConfig(**{**base, "write_policy": "write_back"}, host_mode="buffer_only")
    c = CacheConfig(**base, host_mode="buffer_only")
    assert c.host_enabled and not c.host_tier
    assert CacheConfig(**base).host_tier


async def test_without_storage_it_behaves_like_no_host_tier(kit, make_cache) -> None:
    c = await make_cache(write_policy="write_through")
    s = kit.tokens(1, 40)
    req = c.admit(s)
    await kit.compute_rest(c, req)
    c.cache_finished_req(req)
    await c.flush()
    # write_through would have backed the 10 pages up at once in cache mode: nothing here.
    assert c.in_flight == 0 and c.host_size == 0
    assert c.host_pool.allocator.used_size == 0
    assert c.tree.device_size == 40
    assert c.evict_host(10**6) == 0
    assert c.evict(10**6) == 40  # deleted, not demoted
    m = c.match_prefix(s)
    assert (m.device_prefix_len, m.host_hit_length) == (0, 0)
    assert c.tree.node_count == 0  # no node but the root
    assert c.storage is None
    req = c.admit(s)
    assert await c.prefetch_request(req) == 0
    assert await c.load_back_request(req) == 0
    c.abort_req(req)
    kit.assert_at_rest(c)


async def test_start_prefetch_is_refused_in_buffer_mode(kit, make_cache, make_file_backend) -> None:
    c = await make_cache()
    c.attach_storage(await make_file_backend(c))
    with pytest.raises(InvalidInputError, match="prefetch_request"):
        c.start_prefetch(kit.tokens(1, 64), c.match_prefix(kit.tokens(1, 64)))
    with pytest.raises(ConfigError, match="already attached"):
        c.attach_storage(await make_file_backend(c))
    assert np.array_equal(c.match_prefix(kit.tokens(1, 8)).device_indices, [])
