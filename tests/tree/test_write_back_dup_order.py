"""Which host copies ``evict_host`` reclaims first under write-back (behavior.md 1.17).

SGLang 0.5.23 reclaims the host duplicates (host copies of nodes also on device) of a
write-back tree in the order they *became* duplicates, not in eviction-policy order: a node is
registered when its backup's ack lands (still on device, just before its demotion), when an
insert or a load-back gives it device KV again, or when it is split off a duplicate as the new
prefix; a node that was demoted and comes back keeps its old place until a reclaim pass walks
past it while it is not a duplicate. A first pass spares the evictable device leaves (a device
eviction would demote them next and need their host copy); a second pass takes them.

Each scenario has the exact victims (pages named by their token path), the same on SGLang's own
tree (its Python and Rust cores, when SGLang is installed) and on ours; ours runs
``sanity_check`` after every step. Before the fix ours took the policy's (LRU) order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.tree.sglang_write_back import OursWriteBack, driver_params

Make = Callable[[], Any]


def _node(prefix: tuple[int, ...], tokens: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The pages of a node holding ``tokens`` below ``prefix``."""
    return [prefix + tokens[:i] for i in range(1, len(tokens) + 1)]


@pytest.mark.parametrize("make", driver_params())
def test_a_non_leaf_duplicate_goes_before_an_older_leaf(make: Make) -> None:
    """[1,2] -> {[3,4], [5,6]}, all evicted (backed up on the way), then [1,2,3,4] loaded back:
    [1,2] and [3,4] are duplicates. Touching [1,2] makes the leaf [3,4] the older one, which
    LRU would take; the reference spares the device leaf [3,4] in its first pass and takes
    [1,2], whose device copy no eviction will demote while [3,4] is on device."""
    t = make()
    t.insert([1, 2, 3, 4])
    t.insert([1, 2, 5, 6])
    assert t.evict(100) == 6
    assert t.load([1, 2, 3, 4]) == 4
    t.match([1, 2])
    assert t.evict_host(2) == (2, _node((), (1, 2)))
    assert t.evict_host(2) == (2, _node((1, 2), (3, 4)))
    assert t.evict_host(2) == (2, _node((1, 2), (5, 6)))  # the host-only leaf last
    assert t.evict_host(2) == (0, [])


@pytest.mark.parametrize("make", driver_params())
def test_duplicates_go_in_the_order_they_were_first_backed_up(make: Make) -> None:
    """[1,2] and [3,4] are backed up at eviction in that order (LRU), then loaded back in the
    other order and [1,2] touched last. LRU would take [3,4] first, and so would an order kept
    from the load-backs; the reference keeps each node's place from its backup (its entry
    outlives the demotion) and takes [1,2]."""
    t = make()
    t.insert([1, 2])
    t.insert([3, 4])
    assert t.evict(100) == 4
    assert t.load([3, 4]) == 2
    assert t.load([1, 2]) == 2
    t.match([1, 2])
    assert t.evict_host(2) == (2, _node((), (1, 2)))
    assert t.evict_host(2) == (2, _node((), (3, 4)))


@pytest.mark.parametrize("make", driver_params())
def test_a_device_locked_duplicate_goes_in_the_first_pass(make: Make) -> None:
    """A locked node is no evictable device leaf, so its host copy goes in the first pass,
    before an unlocked leaf's that became a duplicate earlier (and LRU would take first)."""
    t = make()
    t.insert([1, 2])
    t.insert([3, 4])
    t.evict(100)
    t.load([1, 2])
    t.load([3, 4])
    t.match([1, 2])
    assert t.lock([3, 4])
    assert t.evict_host(2) == (2, _node((), (3, 4)))
    assert t.evict_host(2) == (2, _node((), (1, 2)))


@pytest.mark.parametrize("make", driver_params())
def test_a_split_keeps_the_suffix_in_place_and_lists_the_prefix_last(make: Make) -> None:
    """[1,2,3,4] and [5,6] are duplicates (in that order); a match of [1,2] splits the first
    into [1,2] (listed after [5,6]) and [3,4] (keeping the place). With [1,2,3,4] locked, the
    first pass takes [3,4] then [1,2] and spares the leaf [5,6], which goes next."""
    t = make()
    t.insert([1, 2, 3, 4])
    t.insert([5, 6])
    t.evict(100)
    t.load([1, 2, 3, 4])
    t.load([5, 6])
    t.match([1, 2])
    assert t.lock([1, 2, 3, 4])
    assert t.evict_host(4) == (4, _node((1, 2), (3, 4)) + _node((), (1, 2)))
    assert t.evict_host(2) == (2, _node((), (5, 6)))


@pytest.mark.parametrize("make", driver_params())
def test_a_passed_stale_entry_loses_its_place(make: Make) -> None:
    """[1,2], [3,4], [5,6] are backed up in that order; [1,2] and [5,6] come back. Reclaiming 2
    tokens walks past [3,4] (host only: its entry goes) and stops at [1,2], so [5,6] keeps its
    place. [3,4] loaded back now joins at the end: after [5,6], though LRU says it is older."""
    t = make()
    for key in ([1, 2], [3, 4], [5, 6]):
        t.insert(key)
    t.evict(100)
    t.load([1, 2])
    t.load([5, 6])
    assert t.evict_host(2) == (2, _node((), (1, 2)))
    t.load([3, 4])
    t.match([5, 6])
    assert t.evict_host(2) == (2, _node((), (5, 6)))
    assert t.evict_host(2) == (2, _node((), (3, 4)))


def test_reclaim_duplicates_false_leaves_them_alone() -> None:
    t = OursWriteBack()
    t.insert([1, 2, 3, 4])
    t.insert([1, 2, 5, 6])
    t.evict(100)
    t.load([1, 2, 3, 4])
    res = t.tree.evict_host(100, reclaim_duplicates=False)
    assert res.num_evicted == 2  # the host-only leaf [5,6] alone
    t.tree.sanity_check()
    assert t.evict_host(2) == (2, _node((), (1, 2)))
