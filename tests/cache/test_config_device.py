"""``CacheConfig(device=...)``: "auto" (the default) resolves once, at construction, to "cuda"
when CUDA is available and "cpu" otherwise; everything that reads ``config.device`` (the device
pool, the hybrid SWA / Mamba pools, ``small_config``, ``dataclasses.replace``) sees the resolved
device, never "auto"."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asynccache import CacheConfig, ConfigError, HierarchicalCache
from asynccache.testing import small_config

GOOD = {"page_size": 4, "num_layers": 2, "num_heads": 2, "head_dim": 8, "device_tokens": 64}
EXPECTED = "cuda" if torch.cuda.is_available() else "cpu"


def test_default_device_is_auto_resolved_once():
    assert next(f for f in dataclasses.fields(CacheConfig) if f.name == "device").default == "auto"
    assert CacheConfig(**GOOD).device == EXPECTED
    assert CacheConfig(**GOOD, device="auto").device == EXPECTED
    assert CacheConfig(**GOOD) == CacheConfig(**GOOD, device=EXPECTED)
    assert CacheConfig.from_dict({**GOOD, "device": "auto"}).device == EXPECTED


def test_auto_picks_cuda_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert CacheConfig(**GOOD).device == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert CacheConfig(**GOOD).device == "cpu"


def test_explicit_devices_are_kept():
    assert CacheConfig(**GOOD, device="cpu").device == "cpu"
    with pytest.raises(ConfigError, match="tpu"):
        CacheConfig(**GOOD, device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_explicit_cuda_without_cuda_is_still_an_error():
    with pytest.raises(ConfigError, match="'cuda' requested but CUDA is not available"):
        CacheConfig(**GOOD, device="cuda")


def test_everything_reading_config_device_sees_the_resolved_device():
    cfg = CacheConfig(**GOOD, host_tokens=128, sliding_window=8, mamba_states=4)
    cache = HierarchicalCache(cfg)
    assert cache.device_pool.device.type == EXPECTED
    assert cache.hybrid is not None
    assert cache.hybrid.swa_pool is not None and cache.hybrid.swa_pool.device.type == EXPECTED
    assert cache.hybrid.mamba_pool is not None
    assert cache.hybrid.mamba_pool.states.device.type == EXPECTED
    # configs derived from a resolved one carry the resolved device
    assert dataclasses.replace(cfg, device_tokens=32).device == EXPECTED
    assert small_config(cfg).device == EXPECTED
    assert dataclasses.asdict(cfg)["device"] == EXPECTED
