"""Slot-index normalisation and page arithmetic shared by the allocator and the copy engine.

Slot indices are numpy int64 arrays everywhere inside ``transfers``. At the API boundary
we also accept torch integer tensors (any device), lists, tuples and ranges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

from asynccache.errors import InvalidInputError

SlotIndices: TypeAlias = np.ndarray | torch.Tensor | Sequence[int] | range

_TORCH_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def as_slot_array(indices: Any, *, name: str = "indices") -> np.ndarray:
    """Return ``indices`` as a 1-D numpy int64 array (no copy when it already is one).

    Raises :class:`InvalidInputError` for non-integer, multi-dimensional or non-array input.
    """
    if isinstance(indices, np.ndarray):
        arr = indices
    elif isinstance(indices, torch.Tensor):
        if indices.dtype not in _TORCH_INT_DTYPES:
            raise InvalidInputError(f"{name} must hold integers, got a tensor of {indices.dtype}")
        arr = indices.detach().to("cpu", torch.int64).numpy()
    elif isinstance(indices, (list, tuple, range)):
        if len(indices) == 0:
            return np.empty(0, dtype=np.int64)
        arr = np.asarray(indices)
    else:
        raise InvalidInputError(
            f"{name} must be a numpy array, a torch tensor or a list of ints, "
            f"got {type(indices).__name__}"
        )
    if arr.dtype != np.int64:
        if arr.dtype.kind not in "iu":
            raise InvalidInputError(f"{name} must hold integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise InvalidInputError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    return arr


def pages_to_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """Expand page ids into their slot indices (``page_size`` consecutive slots per page)."""
    if page_size == 1:
        return pages.astype(np.int64, copy=True)
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)
