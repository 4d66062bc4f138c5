"""Segment files: several pages of one ``set_batch`` packed into one file.

A segment is one file holding a table and then ordinary pages (each with its own 64-byte
header and checksum, :mod:`asynccache.storage.pageformat`), written once, then published under every
page's own object name with ``os.link`` (hard links: one inode, one name per page). A
reader opening any page's name finds the table at offset 0 and its page at the offset the
table gives; a prefix read takes a run of neighbouring pages with one ``preadv``.

Table (little-endian), at offset 0::

    offset size field
         0    4 magic            b"ACSG"
         4    2 version          1
         6    2 reserved
         8    4 page count       n (1 .. MAX_PAGES)
        12    4 data offset      where the first page starts (table size rounded up to 4 KiB)
        16    8 entries checksum xxh3_64(the n entries)
        24    8 header checksum  xxh3_64(bytes 0..24)
        32 24*n entries          (name hash, page offset, page bytes incl. its header)

The table is only a map: every page is still verified against its own header (name hash,
length, payload checksum), so a stale or wrong table can make a page a miss, never wrong data.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from asynccache.storage.pageformat import HEADER_SIZE, checksum, corrupt

__all__ = [
    "BLOCK",
    "HEAD_READ",
    "MAX_PAGES",
    "SEGMENT_MAGIC",
    "Entry",
    "encode_table",
    "file_bytes",
    "is_segment",
    "parse_table",
    "plan_files",
    "table_bytes",
]

SEGMENT_MAGIC = b"ACSG"
SEGMENT_VERSION = 1
BLOCK = 4096
_HEAD = struct.Struct("<4sHHII")  # 16 bytes
_CHECKS = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
_ENTRY = struct.Struct("<QQQ")
_TABLE_HEAD = _HEAD.size + _CHECKS.size  # 32
#: One 4 KiB block holds the table of up to this many pages: readers fetch it in one read.
MAX_PAGES = (BLOCK - _TABLE_HEAD) // _ENTRY.size  # 169
#: What a reader reads first to find the table.
HEAD_READ = BLOCK


class Entry(NamedTuple):
    offset: int
    length: int  # header + payload


def table_bytes(n: int) -> int:
    """Bytes before the first page of an ``n``-page segment (a whole number of blocks)."""
    raw = _TABLE_HEAD + _ENTRY.size * n
    return -(-raw // BLOCK) * BLOCK


def encode_table(name_hashes: list[int], payload_sizes: list[int]) -> tuple[bytes, list[Entry]]:
    """The table (padded to :func:`table_bytes`) and each page's entry."""
    n = len(name_hashes)
    if not 1 <= n <= MAX_PAGES or len(payload_sizes) != n:
        raise ValueError(f"a segment holds 1..{MAX_PAGES} pages, got {n}")
    start = table_bytes(n)
    entries: list[Entry] = []
    offset = start
    packed = bytearray()
    for nh, size in zip(name_hashes, payload_sizes, strict=True):
        length = HEADER_SIZE + size
        entries.append(Entry(offset, length))
        packed += _ENTRY.pack(nh, offset, length)
        offset += length
    head = _HEAD.pack(SEGMENT_MAGIC, SEGMENT_VERSION, 0, n, start) + _U64.pack(checksum(packed))
    table = head + _U64.pack(checksum(head)) + packed
    return table + bytes(start - len(table)), entries


def is_segment(head: memoryview | bytes | bytearray) -> bool:
    return bytes(head[:4]) == SEGMENT_MAGIC


def parse_table(head: memoryview | bytes | bytearray, name: str) -> dict[int, Entry]:
    """name hash -> entry, from the first bytes of a segment (at least its table).

    Raises CorruptPageError (reason ``corrupt`` kinds, or ``partial`` when ``head`` is
    shorter than the table it announces).
    """
    if len(head) < _TABLE_HEAD:
        raise corrupt("partial", f"segment {name}: {len(head)} bytes, shorter than its table")
    magic, version, _res, n, start = _HEAD.unpack_from(head)
    entries_check, head_check = _CHECKS.unpack_from(head, _HEAD.size)
    if magic != SEGMENT_MAGIC:
        raise corrupt("bad_magic", f"segment {name}: bad magic {bytes(magic)!r}")
    if head_check != checksum(bytes(head[: _HEAD.size + 8])):
        raise corrupt("header_checksum", f"segment {name}: table header checksum mismatch")
    if version != SEGMENT_VERSION or not 1 <= n <= MAX_PAGES or start != table_bytes(n):
        raise corrupt("version", f"segment {name}: unsupported table v{version} n={n}")
    end = _TABLE_HEAD + _ENTRY.size * n
    if len(head) < end:
        raise corrupt("partial", f"segment {name}: {len(head)} bytes, table needs {end}")
    body = bytes(head[_TABLE_HEAD:end])
    if checksum(body) != entries_check:
        raise corrupt("header_checksum", f"segment {name}: table checksum mismatch")
    out: dict[int, Entry] = {}
    for nh, offset, length in _ENTRY.iter_unpack(body):
        out[nh] = Entry(offset, length)
    return out


def plan_files(todo: list[int], payload_sizes: list[int], limit: int | None) -> list[list[int]]:
    """Group pages (indices ``todo`` into ``payload_sizes``) into files: runs of up to
    ``limit`` bytes and :data:`MAX_PAGES` pages, in order; pages of ``limit`` bytes or more
    alone; ``limit`` None: one page per file."""
    if limit is None:
        return [[i] for i in todo]
    groups: list[list[int]] = []
    current: list[int] = []
    nbytes = 0
    for i in todo:
        size = HEADER_SIZE + payload_sizes[i]
        if size >= limit:
            groups.append([i])
            continue
        if current and (nbytes + size > limit or len(current) == MAX_PAGES):
            groups.append(current)
            current, nbytes = [], 0
        current.append(i)
        nbytes += size
    if current:
        groups.append(current)
    return groups


def file_bytes(payload_sizes: list[int], direct: bool) -> int:
    """Bytes on disk of a file holding pages of these payload sizes (a single page, or a
    segment; an ``O_DIRECT`` segment is padded to a whole block)."""
    pages = sum(HEADER_SIZE + s for s in payload_sizes)
    if len(payload_sizes) == 1:
        return pages
    size = table_bytes(len(payload_sizes)) + pages
    return -(-size // BLOCK) * BLOCK if direct else size
