"""The replay's KV work on one cache, in place: write the KV of a request's computed tokens
straight into the device pool and check, bit for bit, every token of the KV it was served.

Neither makes a tensor per request (fresh memory costs a page fault per 4 KiB, which on a VM
costs more than the copy engine's work): a run of consecutive slots is written with one
broadcast XOR (:mod:`.kvpattern`) into the pool's own memory, and checked against the
expected KV generated into a reused scratch buffer of a few MiB, compared as 64-bit words.
Slots fragmented into many short runs go through the scratch buffer and one scatter / gather.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from asynccache.engine.kvaccess import KVAccess
from asynccache.replay.kvpattern import PrefixKV
from asynccache.transfers.pools import DevicePool, KVShape

_MAX_RUNS = 64  # more runs than this, each shorter than _MIN_RUN_BYTES: the scratch path
_MIN_RUN_BYTES = 64 << 10
_SCRATCH_BYTES = 4 << 20


def _wide(t: torch.Tensor) -> torch.Tensor:
    """An int view of (layers, 2, n, heads, head_dim) with the widest words a token row allows
    (fewer elements to compare)."""
    flat = t.reshape(t.shape[0], t.shape[1], t.shape[2], -1)
    row = flat.shape[-1] * flat.element_size()
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        if row % size == 0 and size > flat.element_size() \
                and (flat.storage_offset() * flat.element_size()) % size == 0:
            return flat.view(dtype)
    return flat


class ReplayKV:
    """Writes and verifies the replay's KV in ``device_pool`` (layer-first, ``shape``); keeps
    the seconds it spent (``write_s``, ``verify_s``, ``ids_s``)."""

    def __init__(self, device_pool: DevicePool, shape: KVShape) -> None:
        self.access = KVAccess(device_pool, shape)
        self.page_size = self.access.page_size
        self.pattern = PrefixKV(shape, self.page_size, device_pool.device)
        self.bytes_per_token = shape.bytes_per_token
        ps = self.page_size
        self.chunk = max(ps, _SCRATCH_BYTES // self.bytes_per_token // ps * ps)
        L, H, D = shape.num_layers, shape.num_heads, shape.head_dim
        dims = (L, 2, self.chunk, H, D)
        dt = self.pattern.int_dtype
        self._expect = torch.empty(dims, dtype=dt, device=device_pool.device)
        self._gather: torch.Tensor | None = None  # allocated on the first fragmented check
        # The whole pool as ints, a live view: a run is one slice of it (runs are many).
        self._pool = self.access.span(0, device_pool.num_slots).view(dt)
        self.write_s = self.verify_s = self.ids_s = 0.0

    def page_ids(self, tokens: np.ndarray, namespace: str | None) -> np.ndarray:
        """:meth:`PrefixKV.page_ids` of a prompt (timed)."""
        t0 = time.perf_counter()
        ids = self.pattern.page_ids(tokens, namespace)
        self.ids_s += time.perf_counter() - t0
        return ids

    def _bits(self, ids: np.ndarray, start: int, end: int) -> torch.Tensor:
        bits = torch.from_numpy(self.pattern.token_bits(ids, start, end))
        return bits.to(self._expect.device)

    def _fragmented(self, runs: list[tuple[int, int, int]], n: int) -> bool:
        return len(runs) > _MAX_RUNS and n * self.bytes_per_token < len(runs) * _MIN_RUN_BYTES

    def _head(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        """The first ``k`` tokens' worth of scratch ``buf``, contiguous, as (L, 2, k, H, D)."""
        L, _, _, H, D = buf.shape
        return buf.view(-1)[: L * 2 * k * H * D].view(L, 2, k, H, D)

    def _fill(self, out: torch.Tensor, bits: torch.Tensor) -> None:
        torch.bitwise_xor(bits.view(1, 1, -1, 1, 1), self.pattern.lanes, out=out)

    def write(self, slots: np.ndarray, ids: np.ndarray, start: int) -> None:
        """Write the KV of positions ``start .. start + len(slots) - 1`` of the prompt of
        ``ids`` (:meth:`page_ids`) into device ``slots``."""
        t0 = time.perf_counter()
        n = len(slots)
        runs = self.access.slot_runs(slots)
        bits = self._bits(ids, start, start + n)
        if not self._fragmented(runs, n):
            pool, lanes, xor = self._pool, self.pattern.lanes, torch.bitwise_xor
            b5 = bits.view(1, 1, -1, 1, 1)
            for at, first, m in runs:
                xor(b5[:, :, at : at + m], lanes, out=pool[:, :, first : first + m])
        else:
            for a in range(0, n, self.chunk):
                m = min(self.chunk, n - a)
                exp = self._head(self._expect, m)
                self._fill(exp, bits[a : a + m])
                self.access.write_kv(slots[a : a + m], exp.view(self.pattern.shape.dtype))
        self.write_s += time.perf_counter() - t0

    def verify(self, slots: np.ndarray, ids: np.ndarray, start: int) -> int | None:
        """Check the KV in device ``slots`` against positions ``start ..`` of the prompt of
        ``ids``: the index into ``slots`` of the first token that differs, None when all
        match."""
        t0 = time.perf_counter()
        try:
            return self._verify(slots, ids, start)
        finally:
            self.verify_s += time.perf_counter() - t0

    def _verify(self, slots: np.ndarray, ids: np.ndarray, start: int) -> int | None:
        n = len(slots)
        runs = self.access.slot_runs(slots)
        bits = self._bits(ids, start, start + n)
        if not self._fragmented(runs, n):
            for at, first, m in runs:
                for o in range(0, m, self.chunk):
                    k = min(self.chunk, m - o)
                    bad = self._compare(self._pool[:, :, first + o : first + o + k],
                                        bits[at + o : at + o + k])
                    if bad is not None:
                        return at + o + bad
            return None
        if self._gather is None:
            self._gather = torch.empty_like(self._expect)
        pool = self._pool
        for a in range(0, n, self.chunk):
            k = min(self.chunk, n - a)
            got = self._head(self._gather, k)
            idx = torch.from_numpy(np.ascontiguousarray(slots[a : a + k], dtype=np.int64))
            torch.index_select(pool, 2, idx.to(pool.device), out=got)
            bad = self._compare(got, bits[a : a + k])
            if bad is not None:
                return a + bad
        return None

    def _compare(self, got: torch.Tensor, bits: torch.Tensor) -> int | None:
        """The first token of ``got`` that differs from the KV of ``bits``, or None."""
        k = got.shape[2]
        exp = self._head(self._expect, k)
        self._fill(exp, bits)
        if torch.equal(_wide(got), _wide(exp)):
            return None
        diff = (got != exp).reshape(got.shape[0] * 2, k, -1).any(dim=2).any(dim=0)
        return int(torch.nonzero(diff)[0, 0])
