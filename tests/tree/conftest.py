"""Shared fixtures of the tree-core tests.

The tests run with ``--import-mode=importlib``, so helpers are handed out as fixtures rather
than imported from a sibling module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from asynccache.tree import RadixTree

PAGE_SIZES = (1, 4, 16, 64)


class SlotSource:
    """Hands out fresh, never reused slot indices (a fake allocator)."""

    def __init__(self, start: int = 1000) -> None:
        self._next = start

    def take(self, n: int) -> np.ndarray:
        out = np.arange(self._next, self._next + n, dtype=np.int64)
        self._next += n
        return out


@pytest.fixture
def alloc() -> SlotSource:
    return SlotSource()


def tree_snapshot(tree: RadixTree) -> dict[str, Any]:
    """Everything observable about a tree's state, for "unchanged after an error" checks."""
    nodes = {}
    for n in tree.iter_nodes():
        nodes[n.id] = (
            tuple(tree.node_key(n.id).tokens),
            None if n.value is None else tuple(n.value.tolist()),
            None if n.host_value is None else tuple(n.host_value.tolist()),
            n.lock_ref,
            n.host_lock_ref,
            n.pending,
        )
    return {
        "evictable": tree.evictable_size,
        "protected": tree.protected_size,
        "host": tree.host_size,
        "device": tree.device_size,
        "nodes": tree.node_count,
        "locks": tree.held_locks,
        "pending": tree.pending_ops,
        "device_slots": sorted(tree.device_slots().tolist()),
        "host_slots": sorted(tree.host_slots().tolist()),
        "detail": nodes,
    }


@pytest.fixture
def snapshot() -> Callable[[RadixTree], dict[str, Any]]:
    return tree_snapshot


def cat(arrays: list[np.ndarray]) -> list[int]:
    """Concatenate a list of slot arrays into a plain list (empty list for no arrays)."""
    return np.concatenate(arrays).tolist() if arrays else []


@pytest.fixture
def flat() -> Callable[[list[np.ndarray]], list[int]]:
    return cat
