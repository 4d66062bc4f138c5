"""The on-storage page format shared by every backend: a 64-byte header, then the payload.

Header (little-endian)::

    offset size field
         0    4 magic            b"ACKV"
         4    2 version          1
         6    1 checksum algo    1 = xxh3_64
         7    1 flags            0 (reserved)
         8    4 header size      64
        12    8 payload length   bytes after the header
        20    8 payload checksum xxh3_64(payload)
        28    8 name hash        xxh3_64(object name, utf-8): a renamed or misplaced object fails
        36   20 reserved         zeros
        56    8 header checksum  xxh3_64(bytes 0..56)

xxh3_64 runs at ~25 GB/s on one core here, against ~4.7 GB/s for zlib.crc32: verifying
every read costs a few percent of a ~2 GB/s disk instead of ~40 %.

Readers verify everything: magic, version, header checksum, name, length against the
object's size, and the payload checksum. Any mismatch raises :class:`CorruptObjectError` with
a short machine-readable ``reason``.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from asynccache.errors import CorruptObjectError

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "CorruptPageError",
    "HeaderInfo",
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

_BODY = struct.Struct("<4sHBBIQQQ20x")  # 56 bytes, then the header checksum
_TAIL = struct.Struct("<Q")
_HEADER = struct.Struct("<4sHBBIQQQ20xQ")
assert _BODY.size + _TAIL.size == _HEADER.size == HEADER_SIZE

checksum = xxhash.xxh3_64_intdigest


class HeaderInfo(NamedTuple):
    payload_len: int
    payload_checksum: int
    name_hash: int


class CorruptPageError(CorruptObjectError):
    """A page failed verification; ``reason`` says how (``checksum``, ``partial``, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def corrupt(reason: str, message: str) -> CorruptPageError:
    return CorruptPageError(reason, message)


def name_hash(name: str) -> int:
    return checksum(name.encode())


def encode_header(name: str, payload: memoryview | bytes | bytearray) -> bytes:
    """The 64-byte header of ``payload`` stored as object ``name``."""
    body = _BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        ALGO_XXH3_64,
        0,
        HEADER_SIZE,
        len(payload) if not isinstance(payload, memoryview) else payload.nbytes,
        checksum(payload),
        name_hash(name),
    )
    return body + _TAIL.pack(checksum(body))


def parse_header(header: memoryview | bytes | bytearray, name: str) -> HeaderInfo:
    """Check a header read back from object ``name``; raise CorruptObjectError if it is bad."""
    if len(header) < HEADER_SIZE:
        raise corrupt("partial", f"object {name}: {len(header)} bytes, shorter than a header")
    magic, version, algo, _flags, hsize, plen, pcheck, nhash, hcheck = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise corrupt("bad_magic", f"object {name}: bad magic {magic!r}")
    if hcheck != checksum(memoryview(header)[: _BODY.size]):
        raise corrupt("header_checksum", f"object {name}: header checksum mismatch")
    if version != FORMAT_VERSION or algo != ALGO_XXH3_64 or hsize != HEADER_SIZE:
        raise corrupt(
            "version",
            f"object {name}: unsupported format version={version} algo={algo} header={hsize}",
        )
    if nhash != name_hash(name):
        raise corrupt("name_mismatch", f"object {name}: header names another object")
    return HeaderInfo(plen, pcheck, nhash)


def verify_payload(info: HeaderInfo, payload: memoryview | bytes, name: str) -> None:
    """Check the payload against its header; raise CorruptObjectError on mismatch."""
    size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    if size != info.payload_len:
        raise corrupt(
            "partial", f"object {name}: payload has {size} bytes, header says {info.payload_len}"
        )
    if checksum(payload) != info.payload_checksum:
        raise corrupt("checksum", f"object {name}: payload checksum mismatch")
