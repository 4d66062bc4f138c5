"""The replay's KV: a cheap deterministic function of (prefix, position), like a real model's.

A token's KV depends on its whole prefix, as in a transformer: position ``p`` of a prompt
lies in page ``k = p // page_size``, and the page is identified by the 64-bit chain hash of
the namespace and every token up to the end of that page (:class:`PrefixHasher`; a partial
last page is hashed padded, so it equals no whole page). Element ``j`` of token ``p``'s KV
(``j`` over layers x K/V x heads x head_dim) is ``token_bits[p] XOR lane_bits[j]``:

* ``token_bits[p]`` mixes the page hash with the offset in the page (random-looking bits);
* ``lane_bits[j]`` is a bijection of ``j`` (distinct for every lane while there are fewer
  lanes than bit patterns: 8,192 for 16-bit dtypes), so a swapped layer, K/V or head differs;
* both are masked to bits that keep every dtype finite, so any copy keeps them bit for bit.

So the KV of ``n`` tokens is one broadcast XOR of ``n`` values with the lanes, written straight
into the pool (:mod:`.kvcheck`), and a page of another prefix, another position, another layer
or a stale slot differs from the expected one in every token (up to a 2^-13 chance per token
for a 16-bit dtype: a page of 16 tokens is missed with odds below 2^-200).
"""

from __future__ import annotations

import numpy as np
import torch

from asynccache.replay.bound import PrefixHasher
from asynccache.transfers.pools import KVShape

_U64 = np.uint64
INT_VIEW = {2: torch.int16, 4: torch.int32}
# Bits that keep a value finite and non-negative: float16 (exponent <= 0b01110), bfloat16
# (exponent <= 0x77) and float32 (exponent <= 0x7E).
MASK = {2: 0x3BFF, 4: 0x3F7FFFFF}
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _deposit(values: np.ndarray, mask: int) -> np.ndarray:
    """The low bits of ``values`` spread over the set bits of ``mask`` (in order)."""
    out = np.zeros(len(values), dtype=np.int64)
    bit = 0
    for pos in range(mask.bit_length()):
        if mask >> pos & 1:
            out |= ((values >> bit) & 1) << pos
            bit += 1
    return out


class PrefixKV:
    """The KV pattern of one cache geometry (``shape``, ``page_size``) on ``device``."""

    def __init__(self, shape: KVShape, page_size: int, device: torch.device | str = "cpu") -> None:
        self.shape = shape
        self.page_size = page_size
        item = shape.itemsize
        self.int_dtype = INT_VIEW[item]
        self._np_dtype = np.int16 if item == 2 else np.int32
        self.mask = MASK[item]
        self.hasher = PrefixHasher(page_size)
        rng = np.random.default_rng(0xC0FFEE)
        self._salt = rng.integers(0, 1 << 63, size=page_size, dtype=np.uint64)
        bits = bin(self.mask).count("1")
        L, H, D = shape.num_layers, shape.num_heads, shape.head_dim
        j = np.arange(L * 2 * H * D, dtype=np.int64)
        odd = 0x2F5B  # odd: j -> j * odd + c is a bijection modulo 2^bits
        lane = (j * odd + 0x1D3 + (j >> bits) * 0x3A7) & ((1 << bits) - 1)
        self.lanes = torch.from_numpy(
            _deposit(lane, self.mask).astype(self._np_dtype)).view(L, 2, 1, H, D).to(device)

    def page_ids(self, tokens: np.ndarray, namespace: str | None) -> np.ndarray:
        """The identity of every page of the prompt ``tokens``, a partial last one included
        (the first ``len(tokens) // page_size`` are the whole pages' prefix hashes)."""
        return self.hasher.hashes(np.asarray(tokens), namespace, partial=True)

    def token_bits(self, ids: np.ndarray, start: int, end: int) -> np.ndarray:
        """``token_bits`` of positions ``start .. end - 1`` of the prompt of ``ids``
        (:meth:`page_ids`) as int16 / int32."""
        ps = self.page_size
        pos = np.arange(start, end, dtype=np.int64)
        with np.errstate(over="ignore"):
            x = ids[pos // ps] ^ self._salt[pos % ps]
            x = x * _U64(_M1)
            x ^= x >> _U64(29)
            x = x * _U64(_M2)
        return ((x >> _U64(32)).astype(np.int64) & self.mask).astype(self._np_dtype)

    def expected(self, tokens: np.ndarray, namespace: str | None, start: int,
                 end: int) -> torch.Tensor:
        """The KV of positions ``start .. end - 1`` of the prompt ``tokens`` as a new
        (layers, 2, n, heads, head_dim) tensor of the shape's dtype (tests, error reports)."""
        bits = torch.from_numpy(self.token_bits(self.page_ids(tokens, namespace), start, end))
        out = torch.bitwise_xor(bits.view(1, 1, -1, 1, 1).to(self.lanes.device), self.lanes)
        return out.view(self.shape.dtype)
