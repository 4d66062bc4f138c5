"""Cutting one copy into chunks that two threads take in order (the CPU copy worker's work list).

A *chunk* is ``(layer_lo, layer_hi, pos_lo, pos_hi)``: the layers ``[layer_lo, layer_hi)`` of the
page pairs at positions ``[pos_lo, pos_hi)`` of a :class:`~asynccache.transfers.plan.CopyPlan`'s sorted
order. Chunks are listed layer-major, so taking them in order copies layers in order: a
layer-wise load knows layer ``i`` is in place once every chunk before the first chunk of layer
``i + 1`` is done.

:class:`SharedChunks` hands the chunks of one copy to the worker thread and, for large copies,
to a helper thread: whoever is free takes the next chunk (one lock operation). If the helper is
slow to wake (a loaded machine), the worker simply takes more chunks; nobody waits for a fixed
half. The worker closes the list when it runs out and waits only for a chunk the helper is
still copying.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Chunk = tuple[int, int, int, int]


def _cuts(n: int, parts: int) -> list[int]:
    """``parts + 1`` ascending cut points splitting ``range(n)`` into near-equal parts."""
    return [n * i // parts for i in range(parts + 1)]


def split_block(layers: tuple[int, int], n: int, parts: int) -> list[Chunk]:
    """Split layers ``[a, b)`` x positions ``[0, n)`` into about ``parts`` chunks, layer-major.

    Positions are split first (every chunk then covers all its layers with one call per
    segment); layers only when there are fewer pages than parts.
    """
    a, b = layers
    p = max(1, min(parts, n))
    q = max(1, min(b - a, -(-parts // p)))
    pos = _cuts(n, p)
    lay = [a + c for c in _cuts(b - a, q)]
    return [
        (lay[j], lay[j + 1], pos[i], pos[i + 1]) for j in range(q) for i in range(p)
    ]


def parts_for(nbytes: int, parallel_bytes: int, chunk_bytes: int, max_chunks: int) -> int:
    """How many chunks a block of ``nbytes`` is cut into (1: too small to share)."""
    if nbytes < parallel_bytes:
        return 1
    return max(2, min(max_chunks, nbytes // chunk_bytes))


def whole_chunks(
    n: int, num_layers: int, layer_page_bytes: int, *, parallel_bytes: int, chunk_bytes: int,
    max_chunks: int,
) -> list[Chunk]:
    """Chunks of a whole copy (all layers at once) of ``n`` pages."""
    if n == 0:
        return []
    parts = parts_for(n * num_layers * layer_page_bytes, parallel_bytes, chunk_bytes, max_chunks)
    return split_block((0, num_layers), n, parts)


def layer_chunks(
    n: int, num_layers: int, layer_page_bytes: int, *, group_bytes: int, max_groups: int,
    parallel_bytes: int, chunk_bytes: int, max_chunks: int,
) -> list[Chunk]:
    """Chunks of a layer-wise copy: layers in groups of at least ``group_bytes`` and at most
    ``max_groups`` groups (one hand-off to the loop per group), each group cut like a whole
    copy."""
    if n == 0:
        return []
    per_layer = n * layer_page_bytes
    g = max(1, -(-group_bytes // per_layer), -(-num_layers // max_groups))
    g = min(num_layers, g)
    out: list[Chunk] = []
    for a in range(0, num_layers, g):
        b = min(num_layers, a + g)
        parts = parts_for((b - a) * per_layer, parallel_bytes, chunk_bytes, max_chunks)
        out.extend(split_block((a, b), n, parts))
    return out


class SharedChunks:
    """The chunks of one copy, taken in order by up to two threads.

    ``run(i)`` copies chunk ``i``; ``on_done(i)`` is called after it (under the list's lock, so
    layer completions are posted in order). The first error stops the hand-out; the worker
    re-raises it after :meth:`close`.
    """

    __slots__ = ("_helper_in", "_left", "chunks", "closed", "done", "error", "lock", "next",
                 "on_done", "prefix", "run")

    def __init__(
        self, chunks: list[Chunk], run: Callable[[Chunk], None],
        on_done: Callable[[SharedChunks], None] | None = None,
    ) -> None:
        self.chunks = chunks
        self.run = run
        self.on_done = on_done
        self.lock = threading.Lock()
        self.next = 0
        self.done = [False] * len(chunks)
        self.prefix = 0  # chunks[:prefix] are all done
        self.error: BaseException | None = None
        self.closed = False
        self._helper_in = False
        self._left = threading.Event()

    def work(self) -> None:
        """Take and copy chunks until none is left (or one failed)."""
        chunks, lock = self.chunks, self.lock
        while True:
            with lock:
                i = self.next
                if self.error is not None or i >= len(chunks):
                    return
                self.next = i + 1
            try:
                self.run(chunks[i])
            except BaseException as exc:
                with lock:
                    if self.error is None:
                        self.error = exc
                return
            with lock:
                self.done[i] = True
                p = self.prefix
                while p < len(chunks) and self.done[p]:
                    p += 1
                if p != self.prefix:
                    self.prefix = p
                    if self.on_done is not None:
                        self.on_done(self)

    def completed_layers(self, num_layers: int) -> int:
        """Layers fully copied (every chunk of them done). Call under :attr:`lock`."""
        p = self.prefix
        return self.chunks[p][0] if p < len(self.chunks) else num_layers

    # ---------------------------------------------------------------- the helper's side
    def enter(self) -> bool:
        """The helper joins; False when the worker already closed the list."""
        with self.lock:
            if self.closed:
                return False
            self._helper_in = True
            return True

    def leave(self) -> None:
        with self.lock:
            self._helper_in = False
            if self.closed:
                self._left.set()

    # ---------------------------------------------------------------- the worker's side
    def close(self) -> None:
        """No more chunks for anyone; wait for the chunk the helper may still be copying."""
        with self.lock:
            self.closed = True
            wait = self._helper_in
        if wait:
            self._left.wait()


#: ``(layer_lo, layer_hi, pos_lo, pos_hi, layers_done)``: a chunk of a staged copy, and the
#: number of layers complete once it is (``layer_hi`` on a layer group's last chunk of a
#: layer-wise load, else -1).
RingChunk = tuple[int, int, int, int, int]


def ring_chunks(
    n: int, num_layers: int, layer_page_bytes: int, slot_bytes: int, *, layerwise: bool,
    group_bytes: int,
) -> list[RingChunk]:
    """Cut a staged copy of ``n`` pages into pieces that fit one staging slot of
    ``slot_bytes`` (which holds at least one page of one layer), listed layer-major.

    A whole copy takes all layers of as many pages as fit; a layer-wise load takes its first
    layer alone, or several small ones together (a group of at least ``group_bytes``), so that
    the first layers are ready as soon as they are copied; each later group has twice the
    layers of the one before, bounded by the slot: a piece costs the issuing thread ~0.1 ms
    whatever its size (measured on an H200), and a forward needs the later layers later. A
    group whose pages do not fit one slot is cut by pages (all its layers per piece); when not
    even one page of all its layers fits, by layers (as many layers of all the pages as fit),
    and when not even one layer of all the pages fits, one layer of some pages at a time.
    """
    if n == 0:
        return []
    if layer_page_bytes > slot_bytes:
        raise ValueError(f"a staging slot of {slot_bytes} bytes cannot hold one page of one "
                         f"layer ({layer_page_bytes} bytes)")
    per_layer = n * layer_page_bytes
    most = slot_bytes // per_layer if per_layer <= slot_bytes else 1  # layers in one slot
    if layerwise:
        g = max(1, min(num_layers, -(-group_bytes // per_layer), most))
    else:
        g = most = num_layers
    out: list[RingChunk] = []
    a = 0
    while a < num_layers:
        b = min(num_layers, a + g)
        g = min(2 * g, most)
        pieces: list[Chunk]
        k = slot_bytes // ((b - a) * layer_page_bytes)  # pages per piece, all layers a..b
        if k >= 1:
            pieces = [(a, b, lo, min(n, lo + k)) for lo in range(0, n, k)]
        elif per_layer <= slot_bytes:  # as many layers of all the pages as fit
            q = slot_bytes // per_layer
            pieces = [(la, min(b, la + q), 0, n) for la in range(a, b, q)]
        else:
            m = slot_bytes // layer_page_bytes
            pieces = [(la, la + 1, lo, min(n, lo + m)) for la in range(a, b)
                      for lo in range(0, n, m)]
        for i, (la, lb, lo, hi) in enumerate(pieces):
            last = layerwise and i == len(pieces) - 1
            out.append((la, lb, lo, hi, b if last else -1))
        a = b
    return out
