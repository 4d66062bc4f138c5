"""The on-storage page format shared by every backend: a 64-byte header, then the payload.

Header (little-endian)::

    offset size field
         0    4 magic            b"ACKV"
         4    2 version          1
         6    1 checksum algo    1 = xxh3_64
         7    1 flags            0, or 1 = a MAC follows (FLAG_MAC)
         8    4 header size      64
        12    8 payload length   bytes after the header
        20    8 payload checksum xxh3_64(payload)
        28    8 name hash        xxh3_64(object name, utf-8): a renamed or misplaced object fails
        36   20 MAC              zeros, or with FLAG_MAC: HMAC-SHA256(key, len(name) as u32 LE ||
                                 name || bytes 0..36 || payload), first 20 bytes (PageMac)
        56    8 header checksum  xxh3_64(bytes 0..56)

xxh3_64 runs at ~25 GB/s on one core here, against ~4.7 GB/s for zlib.crc32: verifying
every read costs a few percent of a ~2 GB/s disk instead of ~40 %.

Readers verify everything: magic, version, header checksum, name, length against the
object's size, and the payload checksum. Any mismatch raises :class:`CorruptObjectError` with
a short machine-readable ``reason``.

The checksums catch accidents, not intent: anyone who can write objects can compute a valid
header for any payload. A backend given a secret (:class:`PageMac`) also writes a keyed MAC and
reads only pages whose MAC verifies (reasons ``unauthenticated``: no MAC; ``mac``: a wrong
one). Without a key the format and its cost are unchanged (flags 0, zeros).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple

import xxhash

from asynccache.errors import ConfigError, CorruptObjectError
from asynccache.storage.base import Pieces

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "CorruptPageError",
    "HeaderInfo",
    "PageMac",
    "checksum",
    "encode_header",
    "name_hash",
    "parse_header",
    "verify_payload",
]

MAGIC = b"ACKV"
FORMAT_VERSION = 1
ALGO_XXH3_64 = 1
HEADER_SIZE = 64

FLAG_MAC = 0x01
MAC_SIZE = 20
_HEAD = struct.Struct("<4sHBBIQQQ")  # 36 bytes: what the MAC covers besides name and payload
_BODY = struct.Struct("<4sHBBIQQQ20s")  # 56 bytes, then the header checksum
_TAIL = struct.Struct("<Q")
_HEADER = struct.Struct("<4sHBBIQQQ20sQ")
_NO_MAC = bytes(MAC_SIZE)
assert _HEAD.size + MAC_SIZE == _BODY.size
assert _BODY.size + _TAIL.size == _HEADER.size == HEADER_SIZE

checksum = xxhash.xxh3_64_intdigest

Payload = memoryview | bytes | bytearray | Pieces


def _payload_checksum(payload: Payload) -> int:
    """xxh3_64 of the payload's bytes (a :class:`Pieces` payload streamed piece by piece: the
    same value as for the joined bytes)."""
    if isinstance(payload, Pieces):
        h = xxhash.xxh3_64()
        for part in payload.parts:
            h.update(part)
        return h.intdigest()
    return checksum(payload)


def _payload_len(payload: Payload) -> int:
    return payload.nbytes if isinstance(payload, memoryview | Pieces) else len(payload)


class HeaderInfo(NamedTuple):
    payload_len: int
    payload_checksum: int
    name_hash: int
    mac: bytes = _NO_MAC  # the MAC stored in the header (zeros without one)
    head: bytes = b""  # header bytes 0..36 (what the MAC covers with the name and payload)


class PageMac:
    """A secret key that authenticates pages: HMAC-SHA256 truncated to 160 bits.

    HMAC-SHA256 runs at ~1.8 GB/s per core where the CPU has SHA instructions (SHA-NI, ARMv8
    crypto), about twice keyed BLAKE2b here; hashlib releases the GIL while hashing. The MAC
    covers the object name (so a page cannot be moved under another key or layout), the
    header (length, checksum, flags) and the payload. ``key_id``: 8 hex digits derived from
    the key (not revealing it) that backends put in object names, so that writers with
    different keys, or none, never read or delete each other's objects.
    """

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes | bytearray | memoryview | str) -> None:
        if isinstance(key, str):
            raw = key.encode()
        elif isinstance(key, bytes | bytearray | memoryview):
            raw = bytes(key)
        else:
            raise ConfigError(f"mac_key must be bytes or a string, got {type(key).__name__}")
        if len(raw) < 16:
            raise ConfigError(
                f"mac_key must have at least 16 bytes (128 bits) of secret, got {len(raw)}"
            )
        self._key = raw
        self.key_id = hmac.new(raw, b"asynccache-page-mac-key-id", hashlib.sha256).hexdigest()[:8]

    def tag(self, name: str, head: bytes, payload: Payload) -> bytes:
        """The MAC of a page stored as ``name`` with header bytes 0..36 ``head``."""
        encoded = name.encode()
        h = hmac.new(self._key, len(encoded).to_bytes(4, "little"), hashlib.sha256)
        h.update(encoded)
        h.update(head)
        for part in payload.parts if isinstance(payload, Pieces) else (payload,):
            h.update(part)
        return h.digest()[:MAC_SIZE]

    def __repr__(self) -> str:
        return f"PageMac(key_id={self.key_id!r})"


class CorruptPageError(CorruptObjectError):
    """A page failed verification; ``reason`` says how (``checksum``, ``partial``, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def corrupt(reason: str, message: str) -> CorruptPageError:
    return CorruptPageError(reason, message)


def name_hash(name: str) -> int:
    return checksum(name.encode())


def encode_header(name: str, payload: Payload, mac: PageMac | None = None) -> bytes:
    """The 64-byte header of ``payload`` stored as object ``name`` (with a MAC under ``mac``)."""
    head = _HEAD.pack(
        MAGIC,
        FORMAT_VERSION,
        ALGO_XXH3_64,
        FLAG_MAC if mac is not None else 0,
        HEADER_SIZE,
        _payload_len(payload),
        _payload_checksum(payload),
        name_hash(name),
    )
    body = head + (mac.tag(name, head, payload) if mac is not None else _NO_MAC)
    return body + _TAIL.pack(checksum(body))


def parse_header(
    header: memoryview | bytes | bytearray, name: str, mac: PageMac | None = None
) -> HeaderInfo:
    """Check a header read back from object ``name``; raise CorruptObjectError if it is bad
    (under ``mac``, also if it carries no MAC: reason ``unauthenticated``)."""
    if len(header) < HEADER_SIZE:
        raise corrupt("partial", f"object {name}: {len(header)} bytes, shorter than a header")
    magic, version, algo, flags, hsize, plen, pcheck, nhash, tag, hcheck = _HEADER.unpack_from(
        header
    )
    if magic != MAGIC:
        raise corrupt("bad_magic", f"object {name}: bad magic {magic!r}")
    if hcheck != checksum(memoryview(header)[: _BODY.size]):
        raise corrupt("header_checksum", f"object {name}: header checksum mismatch")
    if version != FORMAT_VERSION or algo != ALGO_XXH3_64 or hsize != HEADER_SIZE or flags & ~1:
        raise corrupt(
            "version",
            f"object {name}: unsupported format version={version} algo={algo} header={hsize} "
            f"flags={flags}",
        )
    if nhash != name_hash(name):
        raise corrupt("name_mismatch", f"object {name}: header names another object")
    if mac is not None and not flags & FLAG_MAC:
        raise corrupt("unauthenticated", f"object {name}: no MAC (written without the key)")
    return HeaderInfo(plen, pcheck, nhash, tag, bytes(memoryview(header)[: _HEAD.size]))


def verify_payload(
    info: HeaderInfo, payload: memoryview | bytes, name: str, mac: PageMac | None = None
) -> None:
    """Check the payload against its header (and its MAC under ``mac``); raise
    CorruptObjectError on mismatch."""
    size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    if size != info.payload_len:
        raise corrupt(
            "partial", f"object {name}: payload has {size} bytes, header says {info.payload_len}"
        )
    if checksum(payload) != info.payload_checksum:
        raise corrupt("checksum", f"object {name}: payload checksum mismatch")
    if mac is not None and not hmac.compare_digest(mac.tag(name, info.head, payload), info.mac):
        raise corrupt("mac", f"object {name}: MAC mismatch (not written with this key)")
