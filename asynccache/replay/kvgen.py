"""Deterministic KV contents for replay and tests: a pure function of (token id, position).

Bit patterns are chosen inside the finite range of every supported dtype, so values survive any
copy bit for bit and a comparison of raw bits detects every wrong page.
"""

from __future__ import annotations

import numpy as np
import torch

from asynccache.transfers.pools import KVShape

_INT_VIEW = {2: torch.int16, 4: torch.int32}
_MASK = {2: 0x3BFF, 4: 0x3F7FFFFF}


def expected_kv(shape: KVShape, tokens: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """KV of ``tokens`` at ``positions`` as a (layers, 2, n, heads, head_dim) tensor."""
    item = torch.empty(0, dtype=shape.dtype).element_size()
    view = _INT_VIEW[item]
    t = np.asarray(tokens, dtype=np.int64)
    p = np.asarray(positions, dtype=np.int64)
    base = ((((t * 40503 + p * 7919) & 0xFFFFFFF) * 0x9E3779B1 >> 9) & _MASK[item]).astype(
        np.int32 if item == 4 else np.int16
    )
    lanes = shape.num_layers * 2 * shape.num_heads * shape.head_dim
    lane = ((np.arange(lanes, dtype=np.int64) * 2654435761 >> 5) & _MASK[item]).astype(base.dtype)
    lane = lane.reshape(shape.num_layers * 2, 1, shape.num_heads * shape.head_dim)
    bits = np.bitwise_xor(base[None, :, None], lane)  # (L*2, n, H*D)
    out = torch.from_numpy(bits).view(view)
    n = len(t)
    return out.view(shape.num_layers, 2, n, shape.num_heads, shape.head_dim).view(shape.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two KV tensors are bit-for-bit equal."""
    item = a.element_size()
    return a.shape == b.shape and torch.equal(a.view(_INT_VIEW[item]), b.view(_INT_VIEW[item]))


def mismatched_tokens(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Token indices (dimension 2) where two same-shaped KV tensors differ in any bit."""
    view = _INT_VIEW[a.element_size()]
    diff = (a.view(view) != b.view(view)).any(dim=4).any(dim=3).any(dim=1).any(dim=0)
    return np.flatnonzero(diff.numpy())
