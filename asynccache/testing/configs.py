"""Small cache configurations for tests: tiny pools, so eviction and write-back happen early."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asynccache.config import CacheConfig

__all__ = ["DEFAULT_CONFIG", "small_config"]

#: What ``asynccache_cache`` is built from unless overridden: 32 device pages and 128 host pages
#: of 4 tokens, 2 layers x 2 heads x 8 dims of float16 (256 bytes per token), load-backs of any
#: length. Every tier is a real CPU tensor and the copy engine a real worker thread.
DEFAULT_CONFIG: Mapping[str, Any] = MappingProxyType({
    "page_size": 4,
    "num_layers": 2,
    "num_heads": 2,
    "head_dim": 8,
    "dtype": "float16",
    "device_tokens": 128,
    "host_tokens": 512,
    "load_back_threshold": 1,
    "write_policy": "write_through_selective",
    "device": "cpu",
})


def small_config(base: CacheConfig | Mapping[str, Any] | None = None,
                 **overrides: Any) -> CacheConfig:
    """A :class:`~asynccache.CacheConfig` of :data:`DEFAULT_CONFIG` (or ``base``) + ``overrides``.

    ``device_bytes`` / ``host_bytes`` in the overrides replace the token capacities of the
    defaults (a config takes one or the other). ``host_tokens=0`` turns the host tier off.
    """
    from dataclasses import asdict

    from asynccache.config import CacheConfig

    if isinstance(base, CacheConfig):
        values = asdict(base)
    elif base is None or isinstance(base, Mapping):
        values = _merged(dict(DEFAULT_CONFIG), base or {})
    else:
        raise TypeError(f"base must be a CacheConfig, a mapping or None, got {base!r}")
    return CacheConfig.from_dict(_merged(values, overrides))


def _merged(values: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` updated by ``extra``; a capacity given in bytes replaces one given in tokens."""
    for tier in ("device", "host"):
        if extra.get(f"{tier}_bytes") is not None:
            values.pop(f"{tier}_tokens", None)
        if extra.get(f"{tier}_tokens") is not None:
            values.pop(f"{tier}_bytes", None)
    values.update(extra)
    return values
