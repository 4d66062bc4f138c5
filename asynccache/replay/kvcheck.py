"""The replay's KV work on one cache, in place: write the KV of a request's computed tokens
straight into the device pool and check, bit for bit, every token of the KV it was served.

Neither makes a tensor per request (fresh memory costs a page fault per 4 KiB, which on a VM
costs more than the copy engine's work): a run of consecutive slots is written with one
broadcast XOR (:mod:`.kvpattern`) into the pool's own memory, and checked against the
expected KV generated into a reused scratch buffer of a few MiB, compared as 64-bit words.
Slots fragmented into many short runs go through the scratch buffer and one scatter / gather.

With a draft sidecar (``draft=``: a speculative-decoding draft model's KV, laid out
``(layers, slots, 2, heads, head_dim)``) every write and check covers its data at the same
slots too, with the draft's own lanes (:meth:`~.kvpattern.PrefixKV.draft_lanes`): each pool
is a :class:`_Plane`, the token bits are computed once for both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch

from asynccache.engine.kvaccess import KVAccess
from asynccache.errors import ConfigError
from asynccache.replay.kvpattern import PrefixKV
from asynccache.transfers.pools import DevicePool, KVShape
from asynccache.transfers.sidecars import DeviceSidecarPool

_MAX_RUNS = 64  # more runs than this, each shorter than _MIN_RUN_BYTES: the scratch path
_MIN_RUN_BYTES = 64 << 10
_SCRATCH_BYTES = 4 << 20


def _wide(t: torch.Tensor, dim: int) -> torch.Tensor:
    """An int view of ``t`` (slots along ``dim``, a token's elements after it) with the widest
    words a token row allows (fewer elements to compare)."""
    flat = t.reshape(*t.shape[: dim + 1], -1)
    row = flat.shape[-1] * flat.element_size()
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        if row % size == 0 and size > flat.element_size() \
                and (flat.storage_offset() * flat.element_size()) % size == 0:
            return flat.view(dtype)
    return flat


class Mismatch(int):
    """The index (into the checked slots) of the first token whose served data differs;
    ``pool`` names where: ``"KV"`` or ``"draft KV"``."""

    pool: str

    def __new__(cls, index: int, pool: str) -> Mismatch:
        out = super().__new__(cls, index)
        out.pool = pool
        return out


class _Plane:
    """One pool written and checked in place: ``pool`` is a live int view of the whole pool
    with its slots along ``dim``; ``lanes`` broadcast against one slot of it; ``scatter`` (or
    None: ``index_copy_``) writes the scratch into fragmented slots."""

    def __init__(self, name: str, pool: torch.Tensor, dim: int, lanes: torch.Tensor,
                 page_size: int, scatter: Callable[[np.ndarray, torch.Tensor], None] | None,
                 ) -> None:
        self.name = name
        self.dim = dim
        self.lanes = lanes
        self._pool = pool
        self._scatter = scatter
        shape = list(pool.shape)
        self.bytes_per_token = math.prod(shape) // shape[dim] * pool.element_size()
        ps = page_size
        self.chunk = max(ps, _SCRATCH_BYTES // self.bytes_per_token // ps * ps)
        shape[dim] = self.chunk
        self._expect = torch.empty(shape, dtype=pool.dtype, device=pool.device)
        self._gather: torch.Tensor | None = None  # allocated on the first fragmented check
        self._bshape = [1] * pool.dim()
        self._bshape[dim] = -1

    def fragmented(self, runs: list[tuple[int, int, int]], n: int) -> bool:
        return len(runs) > _MAX_RUNS and n * self.bytes_per_token < len(runs) * _MIN_RUN_BYTES

    def _head(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        """The first ``k`` tokens' worth of scratch ``buf``, contiguous, shaped as the pool
        with ``k`` slots."""
        shape = list(buf.shape)
        shape[self.dim] = k
        return buf.view(-1)[: math.prod(shape)].view(shape)

    def _fill(self, out: torch.Tensor, bits: torch.Tensor) -> None:
        torch.bitwise_xor(bits.view(self._bshape), self.lanes, out=out)

    def write(self, slots: np.ndarray, runs: list[tuple[int, int, int]],
              bits: torch.Tensor) -> None:
        n, d = len(slots), self.dim
        if not self.fragmented(runs, n):
            pool, lanes, xor = self._pool, self.lanes, torch.bitwise_xor
            b = bits.view(self._bshape)
            for at, first, m in runs:
                xor(b.narrow(d, at, m), lanes, out=pool.narrow(d, first, m))
            return
        for a in range(0, n, self.chunk):
            m = min(self.chunk, n - a)
            exp = self._head(self._expect, m)
            self._fill(exp, bits[a : a + m])
            if self._scatter is not None:
                self._scatter(slots[a : a + m], exp)
            else:
                idx = torch.as_tensor(np.array(slots[a : a + m], dtype=np.int64))
                self._pool.index_copy_(d, idx.to(self._pool.device), exp)

    def verify(self, slots: np.ndarray, runs: list[tuple[int, int, int]],
               bits: torch.Tensor) -> int | None:
        n, d = len(slots), self.dim
        if not self.fragmented(runs, n):
            for at, first, m in runs:
                for o in range(0, m, self.chunk):
                    k = min(self.chunk, m - o)
                    bad = self._compare(self._pool.narrow(d, first + o, k),
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
            idx = torch.as_tensor(np.array(slots[a : a + k], dtype=np.int64))
            torch.index_select(pool, d, idx.to(pool.device), out=got)
            bad = self._compare(got, bits[a : a + k])
            if bad is not None:
                return a + bad
        return None

    def _compare(self, got: torch.Tensor, bits: torch.Tensor) -> int | None:
        """The first token of ``got`` that differs from the data of ``bits``, or None."""
        d = self.dim
        k = got.shape[d]
        exp = self._head(self._expect, k)
        self._fill(exp, bits)
        if torch.equal(_wide(got, d), _wide(exp, d)):
            return None
        diff = (got != exp).movedim(d, 0).reshape(k, -1).any(dim=1)
        return int(torch.nonzero(diff)[0, 0])


class ReplayKV:
    """Writes and verifies the replay's KV in ``device_pool`` (layer-first, ``shape``), and a
    draft model's KV in the sidecar pool ``draft`` when given; keeps the seconds it spent
    (``write_s``, ``verify_s``, ``ids_s``). ``eagle``: pages are of the bigram view."""

    def __init__(self, device_pool: DevicePool, shape: KVShape, *,
                 draft: DeviceSidecarPool | None = None, eagle: bool = False) -> None:
        self.access = KVAccess(device_pool, shape)
        self.page_size = self.access.page_size
        self.pattern = PrefixKV(shape, self.page_size, device_pool.device, eagle=eagle)
        dt = self.pattern.int_dtype
        # The whole pool as ints, a live view: a run is one slice of it (runs are many).
        kv_pool = self.access.span(0, device_pool.num_slots).view(dt)
        dtype = shape.dtype
        self.kv = _Plane("KV", kv_pool, 2, self.pattern.lanes, self.page_size,
                         lambda slots, exp: self.access.write_kv(slots, exp.view(dtype)))
        self.planes = [self.kv]
        self.draft: _Plane | None = None
        if draft is not None:
            ds = draft.shape
            if ds.dtype != shape.dtype or len(ds.token_shape) != 3 or ds.token_shape[0] != 2:
                raise ConfigError(
                    f"the draft sidecar must hold (2, heads, head_dim) of the KV's dtype "
                    f"{shape.dtype} per token and layer, got {ds.token_shape} of {ds.dtype}")
            if draft.num_slots != device_pool.num_slots:
                raise ConfigError(f"the draft sidecar has {draft.num_slots} slots, the KV pool "
                                  f"{device_pool.num_slots}")
            _, heads, dim = ds.token_shape
            lanes = self.pattern.draft_lanes(ds.num_layers, heads, dim)
            self.draft = _Plane("draft KV", draft.data.view(dt), 1, lanes, self.page_size, None)
            self.planes.append(self.draft)
        self.bytes_per_token = self.kv.bytes_per_token
        self.write_s = self.verify_s = self.ids_s = 0.0

    @property
    def chunk(self) -> int:
        """Tokens of the KV's scratch buffer."""
        return self.kv.chunk

    @property
    def draft_bytes_per_token(self) -> int:
        return self.draft.bytes_per_token if self.draft is not None else 0

    def page_ids(self, tokens: np.ndarray, namespace: str | None) -> np.ndarray:
        """:meth:`PrefixKV.page_ids` of a prompt (timed)."""
        t0 = time.perf_counter()
        ids = self.pattern.page_ids(tokens, namespace)
        self.ids_s += time.perf_counter() - t0
        return ids

    def _bits(self, ids: np.ndarray, start: int, end: int) -> torch.Tensor:
        bits = torch.from_numpy(self.pattern.token_bits(ids, start, end))
        return bits.to(self.pattern.device)

    def write(self, slots: np.ndarray, ids: np.ndarray, start: int) -> None:
        """Write the KV (and draft KV) of positions ``start .. start + len(slots) - 1`` of the
        prompt of ``ids`` (:meth:`page_ids`) into device ``slots``."""
        t0 = time.perf_counter()
        runs = self.access.slot_runs(slots)
        bits = self._bits(ids, start, start + len(slots))
        for plane in self.planes:
            plane.write(slots, runs, bits)
        self.write_s += time.perf_counter() - t0

    def verify(self, slots: np.ndarray, ids: np.ndarray, start: int) -> Mismatch | None:
        """Check the KV (and draft KV) in device ``slots`` against positions ``start ..`` of
        the prompt of ``ids``: the first token that differs (its index into ``slots``, naming
        the pool), None when all match."""
        t0 = time.perf_counter()
        try:
            runs = self.access.slot_runs(slots)
            bits = self._bits(ids, start, start + len(slots))
            for plane in self.planes:
                bad = plane.verify(slots, runs, bits)
                if bad is not None:
                    return Mismatch(bad, plane.name)
            return None
        finally:
            self.verify_s += time.perf_counter() - t0
