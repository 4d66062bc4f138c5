"""Open a backend from a URL.

* ``file:///abs/dir?capacity=64GiB&io_threads=4&fsync=1&segment=8MiB&timeout=10``
* ``s3://bucket/prefix?endpoint=http://127.0.0.1:8333&region=us-east-1&concurrency=16``
* ``...&mac_key_env=ASYNCCACHE_MAC_KEY``: authenticate pages with the secret held in that
  environment variable (``mac_key``; see ``docs/storage.md``)

Query values override nothing silently: an unknown parameter or a bad value raises
ConfigError naming it. Keyword arguments of :func:`open_backend` are passed to the backend
constructor and win over the URL (credentials belong there or in the environment, never in
a URL).
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from asynccache.errors import ConfigError
from asynccache.storage.base import StorageLayout

__all__ = ["open_backend", "parse_size"]

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def parse_size(text: str) -> int:
    """``"64GiB"`` -> 68719476736, ``"500MB"`` -> 500000000, ``"4096"`` -> 4096."""
    m = _SIZE_RE.fullmatch(text)
    if not m:
        raise ConfigError(f"bad size {text!r}: expected e.g. 4096, 512MiB, 64GB")
    number, unit, binary = m.groups()
    base = 1024 if binary else 1000
    value = float(number) * base ** _POWERS[unit.upper()]
    if value < 1:
        raise ConfigError(f"bad size {text!r}: must be at least one byte")
    return int(value)


def _bool(name: str, text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"URL parameter {name}={text!r} is not a boolean (use 1/0, true/false)")


def _env_secret(name: str, text: str) -> str:
    """The value of the environment variable a URL parameter names (secrets stay out of URLs)."""
    if not text:
        raise ConfigError(f"URL parameter {name}= needs the name of an environment variable")
    value = os.environ.get(text)
    if not value:
        raise ConfigError(
            f"URL parameter {name}={text}: the environment variable {text} is not set or empty"
        )
    return value


def _number(name: str, text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        what = "an int" if kind is int else "a number"
        raise ConfigError(f"URL parameter {name}={text!r} is not {what}") from None


_FILE_PARAMS: dict[str, tuple[str, Any]] = {
    "capacity": ("capacity_bytes", lambda n, v: parse_size(v)),
    "io_threads": ("io_threads", lambda n, v: _number(n, v, int)),
    "fsync": ("fsync", _bool),
    "segment": ("segment_bytes", lambda n, v: parse_size(v)),
    "direct": ("direct_io", _bool),
    "timeout": ("timeout_s", lambda n, v: _number(n, v, float)),
    "timeout_per_gib": ("timeout_per_gib_s", lambda n, v: _number(n, v, float)),
    "adopt_external": ("adopt_external", _bool),
    "label": ("metrics_label", lambda n, v: v),
    "mac_key_env": ("mac_key", _env_secret),
}
_S3_PARAMS: dict[str, tuple[str, Any]] = {
    "endpoint": ("endpoint", lambda n, v: v),
    "region": ("region", lambda n, v: v),
    "concurrency": ("max_concurrency", lambda n, v: _number(n, v, int)),
    "retries": ("retries", lambda n, v: _number(n, v, int)),
    "timeout": ("timeout_s", lambda n, v: _number(n, v, float)),
    "timeout_per_gib": ("timeout_per_gib_s", lambda n, v: _number(n, v, float)),
    "request_timeout": ("request_timeout_s", lambda n, v: _number(n, v, float)),
    "exists_cache_ttl": ("exists_cache_ttl_s", lambda n, v: _number(n, v, float)),
    "label": ("metrics_label", lambda n, v: v),
    "mac_key_env": ("mac_key", _env_secret),
}


def _params(query: str, table: dict[str, tuple[str, Any]], url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in table:
            raise ConfigError(
                f"unknown parameter {name!r} in storage URL {url!r}; known: {sorted(table)}"
            )
        kwarg, convert = table[name]
        out[kwarg] = convert(name, value)
    return out


async def open_backend(
    url: str, layout: StorageLayout, *, check: bool = True, **kwargs: Any
) -> Any:
    """Create and start the backend a URL names (see the module docstring).

    A ``file://`` backend is started (index rebuilt; StorageError if the directory is
    unusable). An ``s3://`` backend is checked with a probe round trip unless
    ``check=False`` is passed (StorageError on bad credentials, bucket or endpoint).
    """
    if not isinstance(url, str):
        raise ConfigError(f"storage URL must be a string, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"file URL {url!r} must be file:///absolute/path")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ConfigError(f"file URL {url!r} must name an absolute path")
        from asynccache.storage.file import FileBackend

        backend = FileBackend(path, layout, **{**_params(parts.query, _FILE_PARAMS, url), **kwargs})
        await backend.start()
        return backend
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ConfigError(f"s3 URL {url!r} must name a bucket: s3://bucket/prefix")
        from asynccache.storage.s3 import S3Backend

        params = {**_params(parts.query, _S3_PARAMS, url), **kwargs}
        s3 = S3Backend(parts.netloc, layout, prefix=unquote(parts.path).strip("/"), **params)
        if check:
            try:
                await s3.check()
            except BaseException:
                await s3.aclose()
                raise
        return s3
    raise ConfigError(f"unsupported storage URL scheme in {url!r}: use file:// or s3://")
