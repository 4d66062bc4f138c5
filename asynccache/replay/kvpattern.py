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

**Draft KV** (``--draft-layers``: a speculative-decoding draft model's KV in a sidecar pool,
``(layers, slots, 2, heads, head_dim)``) uses the same ``token_bits`` with lanes of its own
(:meth:`PrefixKV.draft_lanes`): lane ``j`` of the draft differs from lane ``j`` of the KV in
every element (their offsets differ), so a draft page can never pass for a KV page of the same
position and vice versa, and another position or prefix differs through ``token_bits``.

**EAGLE** (``eagle=True``): the cache keys positions by bigrams ``(t_i, t_i+1)`` (the draft KV
at position ``i`` reads token ``i + 1``), so the identity of page ``k`` is the chain hash of the
*bigram view* (``BigramKey(tokens).data``: ``t_0 t_1 t_1 t_2 ...`` as 32-bit words, a page
being ``2 * page_size`` words) up to the end of that page: two prompts share a page's id only
when they share its tokens and the one after it. A prompt of ``L`` tokens has ``L - 1`` bigram
positions; its last position (computed, never cached) lies in a page of its own id when it
starts one.

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
# Ends the ``extra`` of the replay's storage layout, so that its objects are named apart from
# any other writer's: an engine's pages of the same tokens hold other KV, and so do a replay's
# of an earlier pattern. Change it whenever the pattern below changes.
STORAGE_TAG = "replaykv2"
INT_VIEW = {2: torch.int16, 4: torch.int32}
# Bits that keep a value finite and non-negative: float16 (exponent <= 0b01110), bfloat16
# (exponent <= 0x77) and float32 (exponent <= 0x7E).
MASK = {2: 0x3BFF, 4: 0x3F7FFFFF}
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
KV_LANES = 0x1D3  # the lanes' offsets: the KV's and the draft KV's differ in every lane
DRAFT_LANES = 0x2A61
_TAIL = _U64(0x7F4A7C159E3779B9)  # an EAGLE prompt's last position, when it starts a page


def bigram_words(tokens: np.ndarray) -> np.ndarray:
    """The bigram view of ``tokens`` as uint32 words ``t_0 t_1 t_1 t_2 ... t_L-2 t_L-1`` (the
    words of ``BigramKey(tokens).data``); empty for fewer than two tokens."""
    t = np.asarray(tokens, dtype=np.uint32)
    n = max(len(t) - 1, 0)
    out = np.empty(2 * n, dtype=np.uint32)
    out[0::2] = t[:n]
    out[1::2] = t[1 : n + 1]
    return out


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

    def __init__(self, shape: KVShape, page_size: int, device: torch.device | str = "cpu", *,
                 eagle: bool = False) -> None:
        self.shape = shape
        self.page_size = page_size
        self.eagle = eagle
        self.device = torch.device(device)
        item = shape.itemsize
        self.int_dtype = INT_VIEW[item]
        self._np_dtype = np.int16 if item == 2 else np.int32
        self.mask = MASK[item]
        # EAGLE: a bigram page is 2 * page_size words of the bigram view
        self.hasher = PrefixHasher(2 * page_size if eagle else page_size)
        rng = np.random.default_rng(0xC0FFEE)
        self._salt = rng.integers(0, 1 << 63, size=page_size, dtype=np.uint64)
        L, H, D = shape.num_layers, shape.num_heads, shape.head_dim
        self.lanes = self._lanes(L * 2 * H * D, KV_LANES).view(L, 2, 1, H, D)

    def _lanes(self, count: int, offset: int) -> torch.Tensor:
        """``count`` distinct lane values (a bijection of ``j`` while ``count`` is below the
        mask's patterns), offset by ``offset``."""
        bits = bin(self.mask).count("1")
        j = np.arange(count, dtype=np.int64)
        odd = 0x2F5B  # odd: j -> j * odd + c is a bijection modulo 2^bits
        lane = (j * odd + offset + (j >> bits) * 0x3A7) & ((1 << bits) - 1)
        return torch.from_numpy(_deposit(lane, self.mask).astype(self._np_dtype)).to(self.device)

    def draft_lanes(self, num_layers: int, num_heads: int, head_dim: int) -> torch.Tensor:
        """The draft KV's lanes, shaped as its pool ``(layers, 1, 2, heads, head_dim)``: lane
        ``j`` differs from the KV's lane ``j`` in every element."""
        return self._lanes(num_layers * 2 * num_heads * head_dim, DRAFT_LANES).view(
            num_layers, 1, 2, num_heads, head_dim)

    def positions(self, n: int) -> int:
        """Positions of a prompt of ``n`` tokens the cache can serve: ``n``, EAGLE ``n - 1``."""
        return max(n - 1, 0) if self.eagle else n

    def page_ids(self, tokens: np.ndarray, namespace: str | None) -> np.ndarray:
        """The identity of every page of the prompt ``tokens``, a partial last one included
        (the first ``positions(len(tokens)) // page_size`` are the whole pages' prefix hashes;
        EAGLE: of the bigram view, and one more id when the last position starts a page)."""
        t = np.asarray(tokens)
        if not self.eagle:
            return self.hasher.hashes(t, namespace, partial=True)
        ids = self.hasher.hashes(bigram_words(t), namespace, partial=True)
        if len(t) > len(ids) * self.page_size:
            last = ids[-1] if len(ids) else _U64(self.hasher.hashes(t[:1], namespace,
                                                                    partial=True)[0])
            ids = np.append(ids, np.bitwise_xor(last, _TAIL))
        return ids

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

    def expected_draft(self, tokens: np.ndarray, namespace: str | None, start: int, end: int,
                       lanes: torch.Tensor) -> torch.Tensor:
        """The draft KV of positions ``start .. end - 1`` as ``(layers, n, 2, heads,
        head_dim)`` (``lanes``: :meth:`draft_lanes`)."""
        bits = torch.from_numpy(self.token_bits(self.page_ids(tokens, namespace), start, end))
        out = torch.bitwise_xor(bits.view(1, -1, 1, 1, 1).to(lanes.device), lanes)
        return out.view(self.shape.dtype)
