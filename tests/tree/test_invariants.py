"""sanity_check() really checks: corrupting any piece of tree state makes it fail.

These tests poke private state on purpose (they test the checker, not the API).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from asynccache.tree import RadixTree


def _tree(alloc) -> RadixTree:
    tree = RadixTree(page_size=2, host_enabled=True, write_policy="write_through",
                     enable_page_hashes=True)
    for key in ([1, 2, 3, 4], [1, 2, 5, 6]):
        for r in tree.insert(key, alloc.take(4)).backups:
            tree.commit_backup(r.op_id, alloc.take(r.num_tokens))
    tree.sanity_check()
    return tree


def _node(tree: RadixTree, node_id: int):
    return next(n for n in tree.iter_nodes() if n.id == node_id)


CORRUPTIONS: list[tuple[str, str, Callable[[RadixTree], None]]] = [
    ("evictable size", "sizes (evictable, protected, host-pinned, host)",
     lambda t: setattr(t, "_evictable", t._evictable + 1)),
    ("host size", "sizes (evictable, protected, host-pinned, host)",
     lambda t: setattr(t, "_host_size", t._host_size - 2)),
    ("host-pinned size", "sizes (evictable, protected, host-pinned, host)",
     lambda t: setattr(t, "_host_pinned", t._host_pinned + 1)),
    ("device child count", "dchildren",
     lambda t: setattr(_node(t, 2), "dchildren", 0)),
    ("lock count", "lock_ref 1 != expected 0",
     lambda t: setattr(_node(t, 1), "lock_ref", 1)),
    ("leaf queue", "queue 0 membership",
     lambda t: t._queues[0].discard(_node(t, 1))),
    ("page hashes", "page hashes do not continue",
     lambda t: setattr(_node(t, 1), "digests", [b"\x00" * 32])),
    ("value length", "device slots for 2 tokens",
     lambda t: setattr(_node(t, 1), "value", _node(t, 1).value[:1])),
    ("neither tier", "holds neither device nor host KV",
     lambda t: (setattr(_node(t, 1), "value", None), setattr(_node(t, 1), "host_value", None),
                setattr(_node(t, 2), "dchildren", 1))),
]


@pytest.mark.parametrize(("message", "corrupt"),
                         [pytest.param(m, c, id=n) for n, m, c in CORRUPTIONS])
def test_sanity_check_detects(alloc, message: str, corrupt) -> None:
    tree = _tree(alloc)
    corrupt(tree)
    with pytest.raises(AssertionError, match=re.escape(message)):
        tree.sanity_check()


def test_sanity_check_detects_a_slot_held_twice() -> None:
    tree = RadixTree(page_size=1)
    tree.insert([1], [5])
    tree.insert([2], [5])  # the caller handed out slot 5 twice
    with pytest.raises(AssertionError, match="a device slot is held by two nodes"):
        tree.sanity_check()
