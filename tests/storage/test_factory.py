"""open_backend: URLs to configured, started backends; clear errors for bad URLs."""

from __future__ import annotations

import pytest

from asynccache.errors import ConfigError, StorageError
from asynccache.storage.factory import open_backend, parse_size
from asynccache.storage.file import FileBackend
from asynccache.storage.s3 import S3Backend


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("1KiB", 1024), ("1.5MiB", 1572864), ("2GB", 2 * 10**9), ("64gib", 64 << 30)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "-1", "1XB", "0", "lots"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="bad size"):
        parse_size(text)


async def test_file_url(tmp_path, layout, make_keys) -> None:
    url = f"file://{tmp_path}/kv?capacity=1MiB&io_threads=2&fsync=true&timeout=5&label=disk"
    b = await open_backend(url, layout)
    assert isinstance(b, FileBackend)
    assert (b.capacity_bytes, b.fsync, b.timeout_s, b.metrics.label) == (1 << 20, True, 5.0, "disk")
    assert (tmp_path / "kv").is_dir()
    assert await b.set_batch(make_keys(1), [b"x"]) == [True]
    b2 = await open_backend(f"file://{tmp_path}/kv", layout, check=False, capacity_bytes=4096)
    assert b2.capacity_bytes == 4096 and b2.stats()["objects"] == 1
    b3 = await open_backend(f"file://{tmp_path}/kv?segment=8MiB&direct=0", layout)
    assert b3.segment_bytes == 8 << 20 and b2.segment_bytes is None
    assert b3.stats()["direct_io"] is False


async def test_s3_url_without_check(layout) -> None:
    url = "s3://bucket/some/prefix/?endpoint=http://127.0.0.1:1&region=eu-west-1&retries=0"
    b = await open_backend(url, layout, check=False, access_key_id="a", secret_access_key="b")
    assert isinstance(b, S3Backend)
    assert (b.bucket, b.prefix, b.endpoint) == ("bucket", "some/prefix", "http://127.0.0.1:1")


async def test_s3_url_check_fails_loudly(layout, refused_endpoint) -> None:
    """No server: the message says the endpoint is unreachable, names it, and carries the
    error's whole first paragraph (not a 300-character cut into obstore's debug dump)."""
    url = f"s3://bucket?endpoint={refused_endpoint}&retries=0&timeout=2"
    with pytest.raises(StorageError, match="endpoint is unreachable") as info:
        await open_backend(url, layout, access_key_id="a", secret_access_key="b")
    msg = str(info.value)
    assert refused_endpoint in msg and "Debug source" not in msg and "\n" not in msg


async def test_s3_custom_endpoint_without_credentials_is_refused(layout, monkeypatch) -> None:
    """No credentials for a custom endpoint: a clear ConfigError before any request (never a
    fall back to cloud instance metadata)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=r"http://127.0.0.1:1: no credentials.*AWS_ACCESS_KEY_ID"):
        await open_backend("s3://bucket?endpoint=http://127.0.0.1:1", layout)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("file://relative/dir", "file:///absolute"),
        ("file:///tmp/x?capacity=huge", "bad size"),
        ("file:///tmp/x?fsync=maybe", "fsync"),
        ("file:///tmp/x?colour=blue", "unknown parameter 'colour'"),
        ("file:///tmp/x?io_threads=two", "io_threads"),
        ("s3:///prefix", "must name a bucket"),
        ("s3://b?endpoint=ftp://x", "endpoint"),
        ("gs://bucket", "unsupported storage URL scheme"),
    ],
)
async def test_bad_urls_name_the_problem(layout, url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        await open_backend(url, layout, check=False)


async def test_every_backend_satisfies_the_protocol(tmp_path, layout) -> None:
    from obstore.store import MemoryStore

    from asynccache.storage.base import StorageBackend
    from asynccache.storage.faults import FaultInjectingBackend

    file_backend = FileBackend(tmp_path, layout)
    s3_backend = S3Backend("mem", layout, store=MemoryStore())
    for backend in (file_backend, s3_backend, FaultInjectingBackend(file_backend)):
        assert isinstance(backend, StorageBackend)
        assert backend.layout is layout
