"""StorageExistenceCache: the bounded LRU of page keys believed stored, with in-flight writes."""

from __future__ import annotations

import pytest

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.l3 import DEFAULT_MAX_ENTRIES, StorageExistenceCache


def test_observed_scenario_st05() -> None:
    """behavior.md §1.11 (ST05): LRU max 3 -> add a, b, c; touch a; add d => b dropped;
    covered([d, e_inflight]) is true."""
    c = StorageExistenceCache(max_entries=3)
    c.add(["a", "b", "c"])
    assert c.touch("a") is True
    c.add(["d"])
    assert "b" not in c
    assert [k for k in ("a", "b", "c", "d") if k in c] == ["a", "c", "d"]
    assert c.dropped == 1
    c.begin_write(["e"])
    assert c.covered(["d", "e"]) is True
    assert c.covered(["b"]) is False
    assert c.covered(["d", "b"]) is False


def test_default_bound_is_512_ki() -> None:
    assert DEFAULT_MAX_ENTRIES == 512 * 1024
    assert StorageExistenceCache().max_entries == 512 * 1024


def test_in_flight_keys_are_refcounted_and_join_the_lru_when_stored() -> None:
    c = StorageExistenceCache(max_entries=2)
    c.begin_write(["x", "y"])
    c.begin_write(["x"])
    c.add(["p", "q", "r"])  # the bound never drops keys being written: they are not in the LRU
    assert c.covered(["x", "y"]) and c.inflight == 2 and len(c) == 2
    c.end_write(["x", "y"], [True, False])  # y failed; x still has a second writer
    assert c.covered(["x"]) and not c.covered(["y"])
    assert "x" in c and c.inflight == 1
    c.end_write(["x"], [False])  # the LRU entry from the first write stays
    assert c.inflight == 0 and c.covered(["x"])
    assert c.missing(["x", "y", "q", "r"]) == [1, 2]  # "q" was pushed out by "x"


def test_invalidate_beyond_forgets_past_the_short_hit() -> None:
    c = StorageExistenceCache()
    chain = ["k0", "k1", "k2", "k3", "k4"]
    c.add(chain)
    c.begin_write(["k4"])
    assert c.invalidate_beyond(chain, 2) == 3
    assert [k in c for k in chain] == [True, True, False, False, False]
    assert c.covered(chain[:2]) and c.covered(["k4"])  # the write in flight decides for k4
    assert c.invalidated == 3
    assert c.invalidate_beyond(chain, 5) == 0
    assert c.invalidate_beyond(chain, 0) == 2  # k0, k1


def test_clear_forgets_beliefs_but_not_writes_in_flight() -> None:
    c = StorageExistenceCache()
    c.add(["a", "b"])
    c.begin_write(["w"])
    c.clear()
    assert len(c) == 0 and not c.covered(["a"]) and c.covered(["w"])


def test_bad_input_names_the_value() -> None:
    with pytest.raises(ConfigError, match=r"max_entries.*0"):
        StorageExistenceCache(0)
    with pytest.raises(ConfigError, match="True"):
        StorageExistenceCache(True)
    c = StorageExistenceCache()
    with pytest.raises(InvalidInputError, match=r"keep_pages.*\[0, 2\].*3"):
        c.invalidate_beyond(["a", "b"], 3)
    with pytest.raises(InvalidInputError, match="no write of 'zz'"):
        c.end_write(["zz"], [True])
    with pytest.raises(InvalidInputError, match="1 keys but 2 outcomes"):
        c.end_write(["a"], [True, False])
