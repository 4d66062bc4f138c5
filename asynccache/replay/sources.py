"""Where trace bytes come from: plain files, single compressed files (``.gz``, ``.xz``,
``.bz2``) and tar archives (``.tar``, ``.tar.gz`` / ``.tgz``, ``.tar.xz`` / ``.txz``,
``.tar.bz2``), all read as streams: nothing is unpacked to disk and an archive's members are
read one at a time, in the archive's order.

Every failure to read becomes a :class:`TraceFormatError` naming the file (and member).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import tarfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from asynccache.errors import InvalidInputError

COMPRESSED: dict[str, Callable[..., Any]] = {".gz": gzip.open, ".xz": lzma.open,
                                            ".bz2": bz2.open}
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2")
# What a broken compressed stream raises while it is read.
STREAM_ERRORS: tuple[type[BaseException], ...] = (
    OSError, EOFError, zlib.error, lzma.LZMAError, tarfile.TarError, ValueError)


class TraceFormatError(InvalidInputError):
    """A trace file is malformed (the message names the file, line and field)."""


def is_archive(path: str | Path) -> bool:
    """A tar archive (of trace files), judged by its name."""
    return str(path).lower().endswith(TAR_SUFFIXES)


def inner_suffix(path: str | Path) -> str:
    """The suffix of a file's content: ``x.jsonl.gz`` -> ``.jsonl``, ``x.json`` -> ``.json``."""
    p = Path(str(path).lower())
    if p.suffix in COMPRESSED:
        p = p.with_suffix("")
    return p.suffix


def open_binary(path: str | Path) -> IO[bytes]:
    """A binary stream of the file's content, decompressed by its suffix."""
    p = Path(path)
    opener = COMPRESSED.get(p.suffix.lower())
    try:
        if opener is None:
            return p.open("rb")
        stream: IO[bytes] = opener(p, "rb")
        return stream
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {p}: {exc}") from None


def open_text(path: str | Path) -> IO[str]:
    """A UTF-8 text stream of the file's content, decompressed by its suffix."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8")


def read_all(path: str | Path) -> bytes:
    """The whole (decompressed) content of a file."""
    with open_binary(path) as fh:
        try:
            return fh.read()
        except STREAM_ERRORS as exc:
            raise TraceFormatError(f"cannot read trace {path}: {exc}") from None


def archive_members(path: str | Path) -> Iterator[tuple[str, bytes, float]]:
    """``(name, content, fraction)`` of each regular file of a tar archive, in archive order,
    one at a time (the archive is read as a stream); ``fraction`` is the share of the
    archive's bytes read so far."""
    p = Path(path)
    try:
        raw = p.open("rb")
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace archive {p}: {exc}") from None
    with raw:
        size = max(1, os.fstat(raw.fileno()).st_size)
        try:
            tf = tarfile.open(fileobj=raw, mode="r|*")  # noqa: SIM115 (closed below)
        except STREAM_ERRORS as exc:
            raise TraceFormatError(f"cannot read trace archive {p}: {exc}") from None
        with tf:
            while True:
                try:
                    member = tf.next()
                    if member is None:
                        return
                    if not member.isfile():
                        continue
                    fh = tf.extractfile(member)
                    data = fh.read() if fh is not None else b""
                except STREAM_ERRORS as exc:
                    raise TraceFormatError(f"cannot read trace archive {p}: {exc}") from None
                yield f"{p}:{member.name}", data, min(1.0, raw.tell() / size)


def count_records(path: str | Path) -> int:
    """Non-blank lines of a (possibly compressed) line-oriented file: its request count, for
    a progress bar's total."""
    n = 0
    with open_binary(path) as fh:
        try:
            for line in fh:
                if line.strip():
                    n += 1
        except STREAM_ERRORS as exc:
            raise TraceFormatError(f"cannot read trace {path}: {exc}") from None
    return n
