"""Chunking a copy for two threads: exact chunk layouts and the shared hand-out."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from asynccache.transfers.chunks import SharedChunks, layer_chunks, split_block, whole_chunks

KW = {"parallel_bytes": 100, "chunk_bytes": 40, "max_chunks": 4}


def test_split_block_cuts_positions_first_then_layers() -> None:
    assert split_block((0, 3), 10, 4) == [(0, 3, 0, 2), (0, 3, 2, 5), (0, 3, 5, 7), (0, 3, 7, 10)]
    # 2 pages for 4 parts: each page on its own, layers cut in two
    assert split_block((0, 3), 2, 4) == [(0, 1, 0, 1), (0, 1, 1, 2), (1, 3, 0, 1), (1, 3, 1, 2)]
    assert split_block((5, 6), 1, 4) == [(5, 6, 0, 1)]
    assert split_block((0, 2), 3, 1) == [(0, 2, 0, 3)]


def test_whole_chunks_share_only_large_copies() -> None:
    # 2 pages x 3 layers x 10 bytes = 60 bytes < parallel_bytes: one chunk
    assert whole_chunks(2, 3, 10, **KW) == [(0, 3, 0, 2)]
    # 8 pages x 3 layers x 10 bytes = 240 bytes: 240 // 40 = 6 -> at most 4 chunks
    assert whole_chunks(8, 3, 10, **KW) == [(0, 3, 0, 2), (0, 3, 2, 4), (0, 3, 4, 6), (0, 3, 6, 8)]
    # 120 bytes: 120 // 40 = 3 chunks
    assert whole_chunks(4, 3, 10, **KW) == [(0, 3, 0, 1), (0, 3, 1, 2), (0, 3, 2, 4)]
    assert whole_chunks(0, 3, 10, **KW) == []


def test_layer_chunks_group_small_layers_and_cut_large_groups() -> None:
    # a layer of 3 pages x 10 bytes = 30 bytes; groups of >= 70 bytes -> 3 layers per group
    assert layer_chunks(3, 7, 10, group_bytes=70, max_groups=8, **KW) == [
        (0, 3, 0, 3), (3, 6, 0, 3), (6, 7, 0, 3)
    ]
    # at most 2 groups: 4 + 3 layers though one layer would do; the 120-byte group is shared
    assert layer_chunks(3, 7, 10, group_bytes=1, max_groups=2, **KW) == [
        (0, 4, 0, 1), (0, 4, 1, 2), (0, 4, 2, 3), (4, 7, 0, 3)
    ]
    # one layer of 10 pages x 12 bytes = 120 bytes per group: shared, cut in 3
    assert layer_chunks(10, 2, 12, group_bytes=1, max_groups=8, **KW) == [
        (0, 1, 0, 3), (0, 1, 3, 6), (0, 1, 6, 10), (1, 2, 0, 3), (1, 2, 3, 6), (1, 2, 6, 10)
    ]
    assert layer_chunks(0, 2, 12, group_bytes=1, max_groups=8, **KW) == []


def test_shared_chunks_run_each_chunk_once_and_report_a_done_prefix() -> None:
    chunks = [(layer, layer + 1, 0, 1) for layer in range(50)]
    ran: list[int] = []
    prefixes: list[int] = []

    def run(c: tuple[int, int, int, int]) -> None:
        ran.append(c[0])

    def helper_side() -> None:
        if shared.enter():
            shared.work()
            shared.leave()

    shared = SharedChunks(chunks, run, lambda s: prefixes.append(s.completed_layers(50)))
    helper = threading.Thread(target=helper_side)
    helper.start()
    shared.work()
    shared.close()
    helper.join()
    assert sorted(ran) == list(range(50))
    assert prefixes == sorted(prefixes) and prefixes[-1] == 50  # only ever grows, ends complete
    assert shared.error is None


def test_a_failing_chunk_stops_the_hand_out() -> None:
    ran: list[int] = []

    def run(c: tuple[int, int, int, int]) -> None:
        if c[0] == 2:
            raise RuntimeError("chunk 2")
        ran.append(c[0])

    shared = SharedChunks([(i, i + 1, 0, 1) for i in range(6)], run)
    shared.work()
    shared.close()
    assert ran == [0, 1] and shared.prefix == 2
    with pytest.raises(RuntimeError, match="chunk 2"):
        raise shared.error  # type: ignore[misc]


def test_a_late_helper_finds_the_list_closed_and_copies_nothing() -> None:
    ran: list[str] = []
    shared = SharedChunks([(0, 1, 0, 1), (0, 1, 1, 2)], lambda c: ran.append("w"))
    shared.work()
    shared.close()  # the helper never entered: nothing to wait for
    assert not shared.enter()
    assert ran == ["w", "w"]


def _covers(chunks: list[tuple[int, int, int, int, int]], n: int, layers: int) -> bool:
    seen = np.zeros((layers, n), dtype=int)
    for a, b, lo, hi, _ in chunks:
        seen[a:b, lo:hi] += 1
    return bool((seen == 1).all())


def test_ring_chunks_fit_a_slot_and_cover_every_layer_page_once() -> None:
    from asynccache.transfers.chunks import ring_chunks

    lpb = 100  # bytes of one page of one layer
    # a whole copy: all 4 layers of as many pages as fit (slot = 10 layer-pages -> 2 pages)
    c = ring_chunks(5, 4, lpb, 1000, layerwise=False, group_bytes=1)
    assert c == [(0, 4, 0, 2, -1), (0, 4, 2, 4, -1), (0, 4, 4, 5, -1)]
    # a page of all layers does not fit: one layer at a time, pages cut to the slot
    c = ring_chunks(5, 4, lpb, 300, layerwise=False, group_bytes=1)
    assert all((b - a) * (hi - lo) * lpb <= 300 for a, b, lo, hi, _ in c)
    assert _covers(c, 5, 4) and {b - a for a, b, *_ in c} == {1}
    # ... but when a layer of every page fits, as many whole layers as fit
    c = ring_chunks(2, 8, lpb, 700, layerwise=False, group_bytes=1)
    assert c == [(0, 3, 0, 2, -1), (3, 6, 0, 2, -1), (6, 8, 0, 2, -1)]
    # layer-wise: one layer per group, the last piece of each says the layers now complete
    c = ring_chunks(5, 3, lpb, 300, layerwise=True, group_bytes=1)
    assert [x for x in c if x[4] >= 0] == [(0, 1, 3, 5, 1), (1, 2, 3, 5, 2), (2, 3, 3, 5, 3)]
    assert _covers(c, 5, 3)
    # small layers are grouped (a first group of >= group_bytes, each later one twice the
    # layers of the one before, bounded by the slot: 5 layers of 2 pages)
    c = ring_chunks(2, 8, lpb, 1000, layerwise=True, group_bytes=400)
    assert c == [(0, 2, 0, 2, 2), (2, 6, 0, 2, 6), (6, 8, 0, 2, 8)]
    c = ring_chunks(1, 32, lpb, 3200, layerwise=True, group_bytes=1)
    assert [(a, b) for a, b, *_ in c] == [(0, 1), (1, 3), (3, 7), (7, 15), (15, 31), (31, 32)]
    assert _covers(c, 1, 32)
    assert ring_chunks(0, 4, lpb, 1000, layerwise=True, group_bytes=1) == []
    with pytest.raises(ValueError, match="cannot hold one page of one layer"):
        ring_chunks(1, 1, 500, 400, layerwise=False, group_bytes=1)
