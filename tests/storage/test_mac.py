"""Keyed page MACs (issue 23 item 6): integrity is not authenticity.

The page header's checksums catch accidents, not a writer who means harm: anyone who can write
to a shared directory or bucket can put another page's payload under a page's name with a
header computed by the public format, and it was served. With ``mac_key`` a backend writes an
HMAC-SHA256 of the object name, header and payload into the header and serves only pages whose
MAC it can verify: a forged page is a corrupt miss, removed and counted, never served.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import obstore
import pytest

from asynccache.errors import ConfigError
from asynccache.storage.factory import open_backend
from asynccache.storage.file import FileBackend
from asynccache.storage.pageformat import HEADER_SIZE, PageMac, encode_header
from asynccache.storage.s3 import S3Backend

PAGE = 4096
KEY = b"k" * 32


def forge(path: Path, name: str, payload: bytes, mac: PageMac | None = None) -> None:
    """What a writer without the key can do: any payload under any name, a valid header
    (a new file under the name: a segment's other names keep the segment)."""
    side = path.with_name(".forged")
    side.write_bytes(encode_header(name, payload, mac) + payload)
    os.replace(side, path)


async def read(b, keys: list[str]) -> tuple[list[bool], list[bytes]]:
    bufs = [bytearray(PAGE) for _ in keys]
    ok = await b.get_batch(keys, bufs)
    return ok, [bytes(x) for x in bufs]


async def test_without_a_key_a_swapped_page_is_served(tmp_path, layout, make_keys, make_pages):
    """The threat, shown: integrity checks pass for a page rewritten by someone else."""
    b = FileBackend(tmp_path, layout)
    keys, pages = make_keys(2), make_pages(2, PAGE)
    await b.set_batch(keys, pages)
    forge(Path(b.path(keys[0])), b.object_name(keys[0]), pages[1])
    ok, got = await read(b, keys[:1])
    assert ok == [True] and got == [pages[1]]  # another page's KV, served


@pytest.mark.parametrize("segment_bytes", [None, 64 * 1024], ids=["file-per-page", "segments"])
async def test_with_a_key_a_forged_page_is_a_corrupt_miss(
    tmp_path, layout, make_keys, make_pages, segment_bytes
) -> None:
    b = FileBackend(tmp_path, layout, mac_key=KEY, segment_bytes=segment_bytes)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    keys, pages = make_keys(4), make_pages(4, PAGE)
    assert await b.set_batch(keys, pages) == [True] * 4
    ok, got = await read(b, keys)
    assert ok == [True] * 4 and got == pages
    # Forged with the public format (no key), and with a wrong key.
    forge(Path(b.path(keys[0])), b.object_name(keys[0]), pages[1])
    forge(Path(b.path(keys[1])), b.object_name(keys[1]), pages[2], PageMac(b"x" * 32))
    ok, got = await read(b, keys)
    assert ok == [False, False, True, True] and got[2:] == pages[2:]
    assert got[:2] == [bytes(PAGE)] * 2  # nothing of the forged payloads reached the caller
    assert b.stats()["faults"] == {"get.corrupt": 2}
    assert heard == keys[:2]
    assert not Path(b.path(keys[0])).exists() and not Path(b.path(keys[1])).exists()
    # The engine writes them again: served once more.
    assert await b.set_batch(keys[:2], pages[:2]) == [True, True]
    assert await read(b, keys[:2]) == ([True, True], pages[:2])


async def test_keys_name_their_own_objects(tmp_path, layout, make_keys, make_pages) -> None:
    keys, pages = make_keys(2), make_pages(2, PAGE)
    keyed = FileBackend(tmp_path, layout, mac_key=KEY)
    plain = FileBackend(tmp_path, layout)
    other = FileBackend(tmp_path, layout, mac_key="another secret of 32 characters!")
    await keyed.set_batch(keys[:1], pages[:1])
    await plain.set_batch(keys[1:], pages[1:])
    assert keyed.object_name(keys[0]) == f"{keys[0]}.{layout.tag}.mac-{PageMac(KEY).key_id}.kv"
    assert plain.object_name(keys[0]) == layout.object_name(keys[0])
    # Each sees only its own: no one deletes pages it cannot verify under its own names.
    assert [await keyed.exists_prefix([k]) for k in keys] == [1, 0]
    assert [await plain.exists_prefix([k]) for k in keys] == [0, 1]
    assert [await other.exists_prefix([k]) for k in keys] == [0, 0]
    assert await other.clear() == 0 and await plain.clear() == 1
    assert await read(keyed, keys[:1]) == ([True], pages[:1])
    assert "k" * 16 not in repr(PageMac(KEY)) + str(keyed.stats())


def test_default_pages_keep_the_format(layout) -> None:
    header = encode_header("name", b"payload")
    assert header[7] == 0 and header[36:56] == bytes(20)  # flags, reserved: as before
    keyed = encode_header("name", b"payload", PageMac(KEY))
    assert keyed[7] == 1 and keyed[36:56] != bytes(20) and keyed[:7] == header[:7]
    with pytest.raises(ConfigError, match="16 bytes"):
        PageMac(b"short")
    with pytest.raises(ConfigError, match="mac_key"):
        FileBackend("/tmp/x", layout, mac_key=123)  # type: ignore[arg-type]


async def test_the_factory_reads_the_key_from_the_environment(tmp_path, layout, monkeypatch):
    monkeypatch.setenv("TEST_ASYNCCACHE_MAC", "s" * 24)
    b = await open_backend(f"file://{tmp_path}?mac_key_env=TEST_ASYNCCACHE_MAC", layout)
    assert b.object_name("ab" * 32).endswith(f".mac-{PageMac('s' * 24).key_id}.kv")
    monkeypatch.delenv("TEST_ASYNCCACHE_MAC")
    with pytest.raises(ConfigError, match="TEST_ASYNCCACHE_MAC"):
        await open_backend(f"file://{tmp_path}?mac_key_env=TEST_ASYNCCACHE_MAC", layout)
    b = await open_backend(f"file://{tmp_path}", layout, mac_key=KEY)  # a keyword argument
    assert b.object_name("ab" * 32).endswith(f".mac-{PageMac(KEY).key_id}.kv")


@pytest.mark.seaweedfs
async def test_s3_serves_only_pages_it_can_verify(seaweed, layout, make_keys, make_pages):
    b = S3Backend(
        seaweed.bucket, layout, prefix=f"t-{secrets.token_hex(6)}", endpoint=seaweed.endpoint,
        access_key_id=seaweed.access_key, secret_access_key=seaweed.secret_key, mac_key=KEY,
        exists_cache_ttl_s=0,
    )
    keys, pages = make_keys(3), make_pages(3, PAGE)
    assert await b.set_batch(keys, pages) == [True] * 3
    assert await read(b, keys) == ([True] * 3, pages)
    raw = seaweed.store(b.prefix)
    name = b.object_name(keys[0])
    await obstore.put_async(raw, name, encode_header(name, pages[1]) + pages[1])
    ok, got = await read(b, keys)
    assert ok == [False, True, True] and got[0] == bytes(PAGE)
    assert b.stats()["faults"] == {"get.corrupt": 1}
    with pytest.raises(FileNotFoundError):
        await obstore.head_async(raw, name)
    assert HEADER_SIZE == 64
