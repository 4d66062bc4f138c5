"""Host inserts (the last step of a storage prefetch, behavior.md 1.16) against SGLang 0.5.23's
own tree, under each write policy (1.17).

Each scenario runs on our ``RadixTree`` and, when SGLang is installed, on SGLang's
``UnifiedTreeCore`` (its Python and Rust cores), driven as its cache drives them
(``tests/tree/sglang_write_back.py``): the fetched pages after a match go into the host tier
under the match's anchor, maybe after another request cached some of them on device meanwhile.
Every scenario states the exact result: which fetched pages the tree gives back (their host
slots are freed), which pages each tier holds, and what a later eviction or host eviction takes
(pages named by their token paths; page ``p`` holds tokens ``10p, 10p+1, ...``).

What SGLang does (``UnifiedTreeCore.insert_host``):

* It touches the anchor and every node it walks (their access stamps, so LRU victims change).
* Write-back: every page the tree already has, on device or on host, is given back; a device
  node without a host copy does not take the fetched slots (it is backed up when it is
  evicted). The rest becomes a host-only node below the last matched node.
* Write-through (and selective): pages already on host are given back; a device node without a
  host copy takes the fetched slots as its backup (a refill). A remainder that would hang below
  a node that is neither the root nor backed up is dropped (all its slots given back), so the
  host copies stay prefix-closed.
* The new host-only node has no hits and the priority of its parent (the root's priority is
  the highest any insert gave).

Before the fix ours let a device node adopt the slots under write-back too, kept a remainder
below an un-backed node, touched nothing, and gave the new node one hit and priority 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.tree.sglang_write_back import (
    SGLANG_PROBLEM,
    OursWriteBack,
    SGLangWriteBack,
    rust_core_problem,
)

Make = Callable[..., Any]


def _drivers() -> list[Any]:
    sg = pytest.mark.skipif(SGLANG_PROBLEM is not None, reason=SGLANG_PROBLEM or "")
    rust = rust_core_problem()
    return [
        pytest.param(OursWriteBack, id="ours"),
        pytest.param(lambda **kw: SGLangWriteBack(backend="python", **kw), id="sglang-python",
                     marks=sg),
        pytest.param(lambda **kw: SGLangWriteBack(backend="rust", **kw), id="sglang-rust",
                     marks=pytest.mark.skipif(rust is not None, reason=rust or "")),
    ]


DRIVERS = pytest.mark.parametrize("make", _drivers())
PAGES = pytest.mark.parametrize("ps", [1, 2])


def toks(ps: int, *pages: int) -> list[int]:
    """The tokens of ``pages`` (page symbols)."""
    return [10 * p + j for p in pages for j in range(ps)]


def paths(ps: int, medium: str, *pages: int) -> set[tuple[str, tuple[int, ...]]]:
    """The pages of the path ``pages``, each named by its token path, on ``medium``."""
    return {(medium, tuple(toks(ps, *pages[: i + 1]))) for i in range(len(pages))}


def offsets(ps: int, n_pages: int) -> list[int]:
    return list(range(n_pages * ps))


@DRIVERS
@PAGES
def test_write_back_gives_back_what_a_device_node_holds(make: Make, ps: int) -> None:
    """[1,2] cached on device while [1,2,3] was read: under write-back [1,2] takes no host
    copy; both its fetched pages come back and [3] becomes a host-only node below it. So host
    eviction finds no duplicate and takes [3], and a device eviction backs [1,2] up."""
    t = make(page_size=ps, write_policy="write_back")
    t.insert(toks(ps, 9))
    assert t.prefetch(toks(ps, 1, 2, 3), meanwhile=[toks(ps, 1, 2)]) == offsets(ps, 2)
    assert t.pages() == paths(ps, "gpu", 9) | paths(ps, "gpu", 1, 2) | {
        ("cpu", tuple(toks(ps, 1, 2, 3)))}
    assert t.evict_host(ps) == (ps, [tuple(toks(ps, 1, 2, 3))])
    assert t.evict(100) == 3 * ps
    assert t.pages() == paths(ps, "cpu", 9) | paths(ps, "cpu", 1, 2)


@DRIVERS
@PAGES
@pytest.mark.parametrize(
    ("write_policy", "back", "host"),
    [
        # [1,2] was backed up by its insert: its pages are on host already
        ("write_through", 2, [(9,), (1, 2, 3)]),
        # [1,2] has no host copy yet (one hit): it takes the fetched slots
        ("write_through_selective", 0, [(1, 2, 3)]),
    ],
)
def test_write_through_gives_back_pages_on_host_and_refills_the_rest(
    make: Make, ps: int, write_policy: str, back: int, host: list[tuple[int, ...]]
) -> None:
    t = make(page_size=ps, write_policy=write_policy)
    t.insert(toks(ps, 9))
    assert t.prefetch(toks(ps, 1, 2, 3), meanwhile=[toks(ps, 1, 2)]) == offsets(ps, back)
    want = paths(ps, "gpu", 9) | paths(ps, "gpu", 1, 2)
    for p in host:
        want |= paths(ps, "cpu", *p)
    assert t.pages() == want
    # Nothing on device is a host-only node's only copy: all of it goes to host or away.
    assert t.evict(100) == 3 * ps
    assert {p for p in t.pages() if p[0] == "gpu"} == set()


@DRIVERS
@PAGES
@pytest.mark.parametrize(
    ("write_policy", "back", "host"),
    [
        ("write_back", 0, [(1, 2, 3)]),  # below a device node: kept (no prefix closure)
        ("write_through", 0, [(1, 2, 3)]),  # the anchor is backed up
        ("write_through_selective", 1, []),  # the anchor is not: the refill is dropped
    ],
)
def test_a_refill_below_an_unbacked_anchor_is_dropped_under_write_through(
    make: Make, ps: int, write_policy: str, back: int, host: list[tuple[int, ...]]
) -> None:
    t = make(page_size=ps, write_policy=write_policy)
    t.insert(toks(ps, 1, 2))
    assert t.prefetch(toks(ps, 1, 2, 3)) == offsets(ps, back)
    have = {p for p in t.pages() if p[0] == "cpu"}
    want = set()
    for p in host:
        want |= {("cpu", tuple(toks(ps, *p)))}
    if write_policy == "write_through":
        want |= paths(ps, "cpu", 1, 2)
    assert have == want
    assert t.match(toks(ps, 1, 2, 3))[:2] == (2 * ps, len(host) * ps)


@DRIVERS
@PAGES
@pytest.mark.parametrize("write_policy", ["write_back", "write_through",
                                          "write_through_selective"])
def test_the_host_insert_touches_its_anchor(make: Make, ps: int, write_policy: str) -> None:
    """[5] is cached while [1,2,3] is read; the host insert then touches the anchor [1,2],
    so LRU evicts [5] first (without the touch [1,2] was older)."""
    t = make(page_size=ps, write_policy=write_policy)
    t.insert(toks(ps, 1, 2))
    if write_policy == "write_through_selective":
        t.insert(toks(ps, 1, 2))  # its second hit: backed up, so the refill is kept
    t.prefetch(toks(ps, 1, 2, 3), meanwhile=[toks(ps, 5)])
    t.removed()
    assert t.evict(ps) == ps
    assert t.removed() == [("gpu", tuple(toks(ps, 5)))]


@DRIVERS
@PAGES
def test_the_host_insert_touches_the_nodes_it_walks(make: Make, ps: int) -> None:
    """[1,2] and then [5] are cached while [1,2,3] is read from the root; the host insert
    walks [1,2] (touching it), so LRU evicts [5] first."""
    t = make(page_size=ps, write_policy="write_back")
    t.prefetch(toks(ps, 1, 2, 3), meanwhile=[toks(ps, 1, 2), toks(ps, 5)])
    t.removed()
    assert t.evict(ps) == ps
    assert t.removed() == [("gpu", tuple(toks(ps, 5)))]


@DRIVERS
@PAGES
def test_a_new_host_node_has_no_hits(make: Make, ps: int) -> None:
    """LFU under write-through: [5] was inserted (one hit) and demoted; [1,2] came from
    storage (no hit), so host eviction takes [1,2] first although it is newer."""
    t = make(page_size=ps, policy="lfu", write_policy="write_through")
    t.insert(toks(ps, 5))
    t.prefetch(toks(ps, 1, 2))
    assert t.evict(100) == ps
    assert t.evict_host(ps) == (2 * ps, [tuple(toks(ps, 1)), tuple(toks(ps, 1, 2))])
    assert t.evict_host(ps) == (ps, [tuple(toks(ps, 5))])


@DRIVERS
@PAGES
def test_a_new_host_node_takes_its_parents_priority(make: Make, ps: int) -> None:
    """The priority policy under write-through: a node fetched below the root takes the
    highest priority any insert gave (the root's; before any insert, the lowest there is), one
    fetched below [4] takes [4]'s. Host eviction takes the lowest priority first, then the
    least recently used."""
    t = make(page_size=ps, policy="priority", write_policy="write_through")
    t.prefetch(toks(ps, 8))  # before any insert
    t.insert(toks(ps, 5), priority=3)
    t.insert(toks(ps, 7), priority=1)
    t.insert(toks(ps, 4), priority=2)
    t.prefetch(toks(ps, 1))  # priority 3 (the root's)
    t.prefetch(toks(ps, 4, 6))  # priority 2 (its parent's)
    assert t.evict(100) == 3 * ps
    got = [t.evict_host(ps)[1] for _ in range(5)]
    assert got == [[tuple(toks(ps, 8))], [tuple(toks(ps, 7))], [tuple(toks(ps, 4, 6))],
                   [tuple(toks(ps, 4))], [tuple(toks(ps, 5))]]
    assert t.evict_host(ps) == (ps, [tuple(toks(ps, 1))])
