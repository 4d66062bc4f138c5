"""Bad input, bad config and the owner check: the right asynccache error, a message naming the
bad value, and a tree left exactly as it was."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from asynccache.errors import (
    AsyncCacheError,
    ConfigError,
    InvalidInputError,
    LockError,
    OwnerError,
    UnknownNodeError,
)
from asynccache.tree import LockReceipt, RadixTree, TreeConfig


class Populated:
    """A page-2 host-enabled tree with a host-only node, a device lock, a backup in flight and a
    load-back in flight."""

    def __init__(self, alloc) -> None:
        t = RadixTree(page_size=2, host_enabled=True, write_policy="write_through",
                      enable_kv_events=True)
        self.tree = t
        for key in ([1, 2, 3, 4], [9, 10]):
            (r,) = t.insert(key, alloc.take(len(key))).backups
            t.commit_backup(r.op_id, alloc.take(len(key)))
        t.evict(100)
        self.host_only = t.match_prefix([1, 2, 3, 4]).best_node
        (self.backup,) = t.insert([5, 6], alloc.take(2)).backups
        (r,) = t.insert([7, 8], alloc.take(2)).backups
        t.commit_backup(r.op_id, alloc.take(2))
        self.locked = t.match_prefix([7, 8]).last_device_node
        self.receipt = t.lock(self.locked)
        self.load = t.start_load_back(t.match_prefix([9, 10]).best_node, alloc.take(2))
        t.take_events()
        t.sanity_check()
        assert (t.pending_ops, t.held_locks, t.node_count) == (2, 1, 4)


@pytest.fixture
def pop(alloc) -> Populated:
    return Populated(alloc)


BAD_CALLS: list[tuple[str, type[AsyncCacheError], str, Callable[[Populated], Any]]] = [
    ("float token", InvalidInputError, "token at position 1 is not an int: 2.5",
     lambda p: p.tree.insert([1, 2.5], [1, 2])),
    ("str token", InvalidInputError, "token at position 0 is not an int: 'a'",
     lambda p: p.tree.insert(["a", "b"], [1, 2])),
    ("None token", InvalidInputError, "token at position 2 is not an int: None",
     lambda p: p.tree.match_prefix([1, 2, None])),
    ("negative token", InvalidInputError, "token id -3 at position 1 is outside",
     lambda p: p.tree.insert([1, -3], [1, 2])),
    ("token too large", InvalidInputError, "token id 4294967296 at position 0",
     lambda p: p.tree.insert([2**32, 1], [1, 2])),
    ("negative numpy token", InvalidInputError, "token id -7 at position 1 is outside",
     lambda p: p.tree.match_prefix(np.array([1, -7]))),
    ("float numpy tokens", InvalidInputError, "tokens must be integers, got dtype float64",
     lambda p: p.tree.match_prefix(np.array([1.0, 2.0]))),
    ("2-D tokens", InvalidInputError, "tokens must be one-dimensional, got shape (1, 2)",
     lambda p: p.tree.match_prefix(np.array([[1, 2]]))),
    ("bytes tokens", InvalidInputError, "got a bytes-like object",
     lambda p: p.tree.match_prefix(b"\x01\x00\x00\x00")),
    ("int as tokens", InvalidInputError, "tokens must be a sequence of ints, got int",
     lambda p: p.tree.match_prefix(5)),
    ("value too short", InvalidInputError, "value has 3 slots but the key has 4 tokens",
     lambda p: p.tree.insert([1, 2, 3, 4], [1, 2, 3])),
    ("value too long", InvalidInputError, "value has 5 slots but the key has 4 tokens",
     lambda p: p.tree.insert([1, 2, 11, 12], [1, 2, 3, 4, 5])),
    ("float value", InvalidInputError, "value must hold integer slot indices, got dtype float64",
     lambda p: p.tree.insert([1, 2], [1.5, 2.0])),
    ("None value", InvalidInputError, "value must be one-dimensional, got shape ()",
     lambda p: p.tree.insert([1, 2], None)),
    ("prev_prefix_len too large", InvalidInputError, "prev_prefix_len 5 exceeds the key length 4",
     lambda p: p.tree.insert([1, 2, 3, 4], [1, 2, 3, 4], prev_prefix_len=5)),
    ("negative prev_prefix_len", InvalidInputError, "prev_prefix_len must be >= 0, got -1",
     lambda p: p.tree.insert([1, 2], [1, 2], prev_prefix_len=-1)),
    ("float prev_prefix_len", InvalidInputError, "prev_prefix_len must be an int, got 1.0",
     lambda p: p.tree.insert([1, 2], [1, 2], prev_prefix_len=1.0)),
    ("negative inserted_len", InvalidInputError, "inserted_len must be >= 0, got -2",
     lambda p: p.tree.insert([1, 2], [1, 2], inserted_len=-2)),
    ("str priority", InvalidInputError, "priority must be an int, got 'high'",
     lambda p: p.tree.insert([1, 2], [1, 2], priority="high")),
    ("negative evict", InvalidInputError, "num_tokens must be >= 0, got -1",
     lambda p: p.tree.evict(-1)),
    ("float evict", InvalidInputError, "num_tokens must be an int, got 2.0",
     lambda p: p.tree.evict(2.0)),
    ("bool evict", InvalidInputError, "num_tokens must be an int, got True",
     lambda p: p.tree.evict(True)),
    ("negative evict_host", InvalidInputError, "num_tokens must be >= 0, got -5",
     lambda p: p.tree.evict_host(-5)),
    ("lock unknown", UnknownNodeError, "no node with id 999 in the tree",
     lambda p: p.tree.lock(999)),
    ("lock str id", UnknownNodeError, "no node with id 'x' in the tree",
     lambda p: p.tree.lock("x")),
    ("lock_host unknown", UnknownNodeError, "no node with id 999",
     lambda p: p.tree.lock_host(999)),
    ("host_chain unknown", UnknownNodeError, "no node with id 999",
     lambda p: p.tree.host_chain(999)),
    ("start_load_back unknown", UnknownNodeError, "no node with id 999",
     lambda p: p.tree.start_load_back(999, [])),
    ("page_hashes unknown", UnknownNodeError, "no node with id 999",
     lambda p: p.tree.page_hashes(999)),
    ("node_key unknown", UnknownNodeError, "no node with id 999",
     lambda p: p.tree.node_key(999)),
    ("lock_ref unknown", UnknownNodeError, "no node with id -1",
     lambda p: p.tree.lock_ref(-1)),
    ("lock host-only", LockError, "is not on device",
     lambda p: p.tree.lock(p.host_only)),
    ("unlock never issued", LockError, "lock receipt 12345 is not held",
     lambda p: p.tree.unlock(LockReceipt(token=12345, node_id=p.locked, delta=0))),
    ("unlock None", LockError, "expected a LockReceipt, got None",
     lambda p: p.tree.unlock(None)),
    ("unlock_host of device lock", LockError, "is a device lock",
     lambda p: p.tree.unlock_host(p.receipt)),
    ("commit unknown backup", InvalidInputError, "no backup in flight with id 999",
     lambda p: p.tree.commit_backup(999, [])),
    ("abort unknown backup", InvalidInputError, "no backup in flight with id 999",
     lambda p: p.tree.abort_backup(999)),
    ("commit unknown load", InvalidInputError, "no load in flight with id 999",
     lambda p: p.tree.commit_load_back(999)),
    ("abort unknown load", InvalidInputError, "no load in flight with id 999",
     lambda p: p.tree.abort_load_back(999)),
    ("commit_load_back of a backup", InvalidInputError, "no load in flight with id",
     lambda p: p.tree.commit_load_back(p.backup.op_id)),
    ("abort_backup of a load", InvalidInputError, "no backup in flight with id",
     lambda p: p.tree.abort_backup(p.load.op_id)),
    ("commit_backup wrong size", InvalidInputError, "needs 2 host slots, got 3",
     lambda p: p.tree.commit_backup(p.backup.op_id, [1, 2, 3])),
    ("load-back of a loading node", InvalidInputError, "has nothing to load",
     lambda p: p.tree.start_load_back(p.load.node_ids[-1], [1, 2])),
    ("reset with copies in flight", InvalidInputError, "cannot reset with 2 copies in flight",
     lambda p: p.tree.reset()),
]


@pytest.mark.parametrize(
    ("exc", "message", "call"),
    [pytest.param(e, m, c, id=name) for name, e, m, c in BAD_CALLS],
)
def test_bad_input_raises_and_leaves_tree_unchanged(pop, snapshot, exc, message, call) -> None:
    before = snapshot(pop.tree)
    with pytest.raises(exc, match=re.escape(message)):
        call(pop)
    pop.tree.sanity_check()
    assert snapshot(pop.tree) == before
    assert pop.tree.take_events() == []
    # The tree still works.
    pop.tree.commit_backup(pop.backup.op_id, [500, 501])
    pop.tree.commit_load_back(pop.load.op_id)
    assert pop.tree.unlock(pop.receipt) == 2
    pop.tree.sanity_check()


def test_errors_share_one_hierarchy() -> None:
    for exc in (ConfigError, InvalidInputError, LockError, OwnerError, UnknownNodeError):
        assert issubclass(exc, AsyncCacheError)


def test_bool_tokens(alloc) -> None:
    """A Python bool is an int (read as 0 / 1, as numpy and array do); bool arrays are refused."""
    tree = RadixTree(page_size=1)
    tree.insert([True, 2], alloc.take(2))
    assert tree.match_prefix([1, 2]).device_prefix_len == 2
    with pytest.raises(InvalidInputError, match="dtype bool"):
        tree.insert(np.array([True, False]), alloc.take(2))


# ---------------------------------------------------------------- config
BAD_CONFIGS = [
    ({"page_size": 0}, "page_size must be >= 1, got 0"),
    ({"page_size": -4}, "page_size must be >= 1, got -4"),
    ({"page_size": True}, "page_size must be an int, got True"),
    ({"page_size": "4"}, "page_size must be an int, got '4'"),
    ({"page_size": 1.5}, "page_size must be an int, got 1.5"),
    ({"page_size": None}, "page_size must be an int, got None"),
    ({"eviction_policy": "lr"}, "unknown eviction policy 'lr'"),
    ({"eviction_policy": "LRU"}, "unknown eviction policy 'LRU'"),
    ({"write_policy": "wb"}, "unknown write_policy 'wb'"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_CONFIGS)
def test_bad_config_raises(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        RadixTree(**kwargs)
    with pytest.raises(ConfigError, match=re.escape(message)):
        TreeConfig(**kwargs)


def test_config_and_keywords_together_raise() -> None:
    with pytest.raises(ConfigError, match="not both"):
        RadixTree(TreeConfig(page_size=2), page_size=4)


def test_good_config_round_trips() -> None:
    cfg = TreeConfig(page_size=16, eviction_policy="priority", host_enabled=True,
                     write_policy="write_back", enable_kv_events=True, enable_page_hashes=True)
    tree = RadixTree(cfg)
    assert tree.config is cfg
    assert tree.page_size == 16
    assert cfg.write_through_threshold == 2
    assert TreeConfig(write_policy="write_through").write_through_threshold == 1
    assert TreeConfig(write_policy="write_through_selective").write_through_threshold == 2


@pytest.mark.parametrize("field", ["host_enabled", "enable_kv_events", "enable_page_hashes"])
@pytest.mark.parametrize("bad", ["no", 1, None])
def test_non_bool_flag_raises(field: str, bad: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{field} must be a bool, got {bad!r}")):
        RadixTree(**{field: bad})


# ---------------------------------------------------------------- owner check
OWNER_CALLS: list[tuple[str, Callable[[Populated], Any]]] = [
    ("match_prefix", lambda p: p.tree.match_prefix([7, 8])),
    ("insert", lambda p: p.tree.insert([40, 41], [40, 41])),
    ("evict", lambda p: p.tree.evict(100)),
    ("evict_host", lambda p: p.tree.evict_host(100)),
    ("lock", lambda p: p.tree.lock(p.locked)),
    ("unlock", lambda p: p.tree.unlock(p.receipt)),
    ("lock_host", lambda p: p.tree.lock_host(p.host_only)),
    ("commit_backup", lambda p: p.tree.commit_backup(p.backup.op_id, [1, 2])),
    ("abort_backup", lambda p: p.tree.abort_backup(p.backup.op_id)),
    ("start_load_back", lambda p: p.tree.start_load_back(p.host_only, [1, 2, 3, 4])),
    ("commit_load_back", lambda p: p.tree.commit_load_back(p.load.op_id)),
    ("abort_load_back", lambda p: p.tree.abort_load_back(p.load.op_id)),
    ("reset", lambda p: p.tree.reset()),
]


def _run_in_thread(fn: Callable[[], Any]) -> BaseException | None:
    caught: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # handed back to the test
            caught.append(exc)

    th = threading.Thread(target=target)
    th.start()
    th.join()
    return caught[0] if caught else None


@pytest.mark.parametrize("call", [pytest.param(c, id=n) for n, c in OWNER_CALLS])
def test_mutating_call_from_other_thread_raises(pop, snapshot, call) -> None:
    before = snapshot(pop.tree)
    exc = _run_in_thread(lambda: call(pop))
    assert isinstance(exc, OwnerError)
    assert f"owned by thread {threading.get_ident()}" in str(exc)
    assert snapshot(pop.tree) == before
    pop.tree.sanity_check()


def test_take_events_from_other_thread_raises(pop, alloc) -> None:
    """Draining events mutates the recorder: owner only."""
    pop.tree.insert([60, 61], alloc.take(2))
    exc = _run_in_thread(pop.tree.take_events)
    assert isinstance(exc, OwnerError)
    assert len(pop.tree.take_events()) == 1  # nothing was lost


def test_bind_owner_moves_ownership(alloc) -> None:
    tree = RadixTree(page_size=1)
    tree.insert([1], alloc.take(1))
    results: list[Any] = []

    def worker() -> None:
        tree.bind_owner()
        results.append(tree.insert([2], [77]).cached_len)

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert results == [1]
    with pytest.raises(OwnerError):
        tree.insert([3], [78])
    with pytest.raises(OwnerError):
        tree.match_prefix([1])
    tree.bind_owner(threading.get_ident())
    assert tree.match_prefix([2]).device_indices.tolist() == [77]
    tree.sanity_check()
