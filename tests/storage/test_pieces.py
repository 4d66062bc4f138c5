"""Pages given as ``Pieces`` (their bytes apart in the caller's memory) on the file backend:
the object is byte for byte the one the joined page makes (single files, segments, with a MAC),
a read fills the pieces in order, write faults damage them as they damage a joined page, and a
backend that cannot take pieces names the buffer."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from asynccache.errors import InvalidInputError
from asynccache.storage.base import Pieces, check_batch
from asynccache.storage.faults import FaultInjectingBackend, FaultKind, FaultRule
from asynccache.storage.file import FileBackend

PAGE = 4096


def split(page: bytes, cuts: tuple[int, ...]) -> Pieces:
    """``page`` in pieces, each its own bytearray (apart in memory)."""
    bounds = [0, *cuts, len(page)]
    return Pieces([bytearray(page[a:b]) for a, b in itertools.pairwise(bounds)])


def files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.rglob("*.kv"))}


@pytest.mark.parametrize("options", [{}, {"segment_bytes": 4 * (PAGE + 64)},
                                     {"mac_key": b"k" * 32}],
                         ids=["files", "segments", "mac"])
async def test_pieces_store_the_same_object_as_the_joined_page(
    tmp_path, layout, make_keys, make_pages, options
) -> None:
    keys, pages = make_keys(6), make_pages(6, PAGE)
    joined = FileBackend(tmp_path / "joined", layout, **options)
    pieced = FileBackend(tmp_path / "pieced", layout, **options)
    cuts = [(), (1,), (PAGE // 2,), (7, 100, 4000), (PAGE - 1,), (64, 128)]
    assert await joined.set_batch(keys, pages) == [True] * 6
    assert await pieced.set_batch(keys, [split(p, c) for p, c in zip(pages, cuts, strict=True)]) \
        == [True] * 6
    a, b = files(tmp_path / "joined"), files(tmp_path / "pieced")
    assert a and a == b
    # either one reads back whole, into one buffer or into pieces
    for backend in (joined, pieced):
        bufs = [bytearray(PAGE) for _ in keys]
        assert await backend.get_batch(keys, bufs) == [True] * 6
        assert [bytes(x) for x in bufs] == pages
        targets = [split(bytes(PAGE), c) for c in cuts]
        assert await backend.get_batch(keys, targets) == [True] * 6
        assert [t.tobytes() for t in targets] == pages
    await joined.aclose()
    await pieced.aclose()


async def test_a_torn_or_flipped_pieced_write_is_a_miss(tmp_path, layout, make_keys, make_pages):
    inner = FileBackend(tmp_path, layout)
    keys, pages = make_keys(3), make_pages(3, PAGE)
    fb = FaultInjectingBackend(inner, [
        FaultRule(FaultKind.PARTIAL_WRITE, keys=frozenset({keys[0]}), times=1),
        FaultRule(FaultKind.FLIP_BYTES, ops=frozenset({"write"}), keys=frozenset({keys[1]}),
                  times=1)])
    assert await fb.set_batch(keys, [split(p, (10, 3000)) for p in pages]) == [True] * 3
    targets = [split(bytes(PAGE), (5,)) for _ in keys]
    assert await fb.get_batch(keys, targets) == [False, False, True]
    assert targets[2].tobytes() == pages[2]
    await inner.aclose()


async def test_bad_pieces_are_named(tmp_path, layout, make_keys) -> None:
    b = FileBackend(tmp_path, layout)
    keys = make_keys(2)
    with pytest.raises(InvalidInputError, match=r"a piece of buffers\[1\] is read-only"):
        await b.get_batch(keys, [bytearray(8), Pieces([bytearray(4), b"1234"])])
    with pytest.raises(InvalidInputError, match="at least one buffer"):
        Pieces([])
    with pytest.raises(InvalidInputError, match=r"buffers\[0\] is Pieces\(2 parts, 8 bytes\); "
                                                "this backend takes one contiguous buffer"):
        check_batch(keys[:1], [Pieces([memoryview(bytearray(4)), memoryview(bytearray(4))])],
                    writable=False)
    assert await b.exists_prefix(keys) == 0
    await b.aclose()
