"""Sidecar specs and registration: every bad value is a ConfigError naming it, and nothing is
registered then."""

from __future__ import annotations

import pytest

from asynccache.errors import ConfigError
from asynccache.transfers.sidecars import SidecarSpec


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"name": "Draft"}, "'Draft'"),
    ({"name": "kv"}, "'kv'"),
    ({"name": "a.b"}, "'a.b'"),
    ({"name": ""}, "''"),
    ({"name": "x", "source": "full"}, "'full'"),
    ({"name": "x", "hit_policy": "block_groups"}, "'block_groups'"),
    ({"name": "x", "token_shape": (2, 0)}, "token_shape"),
    ({"name": "x", "token_shape": ()}, "token_shape"),
    ({"name": "x", "dtype": "int7"}, "'int7'"),
    ({"name": "x", "num_layers": 0}, "num_layers"),
    ({"name": "x", "host_slots": -4}, "host_slots"),
])
def test_bad_spec_names_the_value(kwargs, names):
    with pytest.raises(ConfigError, match=names.replace("(", r"\(").replace(")", r"\)")):
        SidecarSpec(**kwargs)


def test_spec_normalises_and_derives():
    s = SidecarSpec(name="idx", token_shape=8, dtype="fp32")
    assert s.token_shape == (8,) and s.shape.bytes_per_token == 32
    assert s.clamps
    assert not SidecarSpec(name="w", hit_policy="trailing_pages").clamps
    assert not SidecarSpec(name="m", source="mamba").clamps
    d = SidecarSpec(name="d", token_shape=(2, 2, 8), num_layers=3)
    assert d.shape.bytes_per_token == 3 * 32 * 2


async def test_registration_checks(make_cache, kit):
    cache = await make_cache(sidecars=(), start=False, host_tokens=256)
    with pytest.raises(ConfigError, match="host_slots=128 < 256"):
        cache.register_sidecar_pool(SidecarSpec(name="small", host_slots=128))
    with pytest.raises(ConfigError, match="source pool 'swa' is not a pool of this cache"):
        cache.register_sidecar_pool(SidecarSpec(name="w", source="swa"))
    with pytest.raises(ConfigError, match="not whole pages"):
        cache.register_sidecar_pool(SidecarSpec(name="odd", host_slots=258))
    with pytest.raises(ConfigError, match="SidecarSpec"):
        cache.register_sidecar_pool("draft")  # type: ignore[arg-type]
    assert cache.sidecars == ()
    big = cache.register_sidecar_pool(SidecarSpec(name="big", host_slots=512))
    assert big.host is not None and big.host.num_slots == 512
    draft = cache.register_draft_pools(num_layers=3, num_heads=2, head_dim=8)
    assert draft.spec.token_shape == (2, 2, 8) and draft.spec.dtype == cache.shape.dtype
    assert draft.device.data.shape == (3, 64, 2, 2, 8)
    assert draft.host is not None and draft.host.data.shape == (3, 256, 2, 2, 8)
    with pytest.raises(ConfigError, match="'draft' is registered already"):
        cache.register_draft_pools(num_layers=1, num_heads=2, head_dim=8)
    with pytest.raises(ConfigError, match="no sidecar pool named 'nope'"):
        cache.sidecar("nope")
    assert [s.name for s in cache.sidecars] == ["big", "draft"]
    await cache.start()
    assert all(s.engine is not None and s.engine.running for s in cache.sidecars)
    assert cache.copy_engine is not None
    assert cache.copy_engine.riders == tuple(s.engine for s in cache.sidecars)
    with pytest.raises(ConfigError, match="before the cache starts"):
        cache.register_sidecar_pool(SidecarSpec(name="late"))
    assert len(cache.sidecars) == 2


async def test_hybrid_sources_are_checked(make_cache):
    cache = await make_cache(sidecars=(), start=False, sliding_window=8, swa_tokens=32,
                             swa_host_tokens=64)
    with pytest.raises(ConfigError, match="host_slots=32 < 64"):
        cache.register_sidecar_pool(SidecarSpec(name="w", source="swa", host_slots=32))
    with pytest.raises(ConfigError, match="source pool 'mamba'"):
        cache.register_sidecar_pool(SidecarSpec(name="m", source="mamba"))
    w = cache.register_sidecar_pool(SidecarSpec(name="w", source="swa"))
    assert w.device.num_slots == 32 and w.host is not None and w.host.num_slots == 64
    await cache.start()


async def test_no_host_tier_keeps_a_device_pool_only(make_cache):
    cache = await make_cache(sidecars=(), start=False, host_tokens=None, host_bytes=None)
    s = cache.register_sidecar_pool(SidecarSpec(name="idx", token_shape=(4,)))
    assert s.host is None
    await cache.start()
    assert s.engine is None and s.device.num_slots == 64
