"""KV events for routers: BlockStored / BlockRemoved / AllBlocksCleared (behavior.md 1.19)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from asynccache.tree import AllBlocksCleared, BlockRemoved, BlockStored, Medium, RadixKey, RadixTree


def _digests(tokens: list[int], page: int, seed: bytes = b"") -> list[bytes]:
    out, prev = [], bytes(32) if seed else b""  # namespaced: H(seed || prev || page)
    for off in range(0, len(tokens) - len(tokens) % page, page):
        page_bytes = struct.pack(f"<{page}I", *tokens[off : off + page])
        prev = hashlib.sha256(seed + prev + page_bytes).digest()
        out.append(prev)
    return out


def _h(tokens: list[int], page: int) -> list[int]:
    """Event hashes: the first 8 digest bytes, big-endian, signed."""
    return [struct.unpack(">q", d[:8])[0] for d in _digests(tokens, page)]


def _part(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode()
    return b"\x01" + struct.pack("<Q", len(raw)) + raw


def _ns_h(tokens: list[int], page: int, extra_key: str | None, salt: str | None) -> list[int]:
    storage_seed = hashlib.sha256(b"sglang-cache-namespace-v1" + _part(extra_key) + _part(salt))
    event_seed = hashlib.sha256(b"sglang-kv-event-namespace-v1" + _part(extra_key) + _part(salt))
    return [
        struct.unpack(">q", hashlib.sha256(event_seed.digest() + d[:8]).digest()[:8])[0]
        for d in _digests(tokens, page, storage_seed.digest())
    ]


def _stored(hashes, parent, tokens, page, medium=Medium.GPU, **kw) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=page,
        medium=medium, **kw,
    )


def test_s11_exact(alloc) -> None:
    tree = RadixTree(page_size=2, enable_kv_events=True)
    h1234 = _h([1, 2, 3, 4], 2)
    h1256 = _h([1, 2, 5, 6], 2)
    assert h1234[0] == h1256[0]
    tree.insert([1, 2, 3, 4], alloc.take(4))
    assert tree.take_events() == [_stored(h1234, None, [1, 2, 3, 4], 2)]
    tree.insert([1, 2, 5, 6], alloc.take(4))
    assert tree.take_events() == [_stored([h1256[1]], h1234[0], [5, 6], 2)]
    tree.evict(100)
    # LRU: [3,4] (oldest leaf), then [5,6], then the shared [1,2]; one coalesced removal.
    assert tree.take_events() == [
        BlockRemoved(block_hashes=[h1234[1], h1256[1], h1234[0]], medium=Medium.GPU)
    ]
    assert tree.take_events() == []
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 4, 16))
def test_consecutive_stores_coalesce(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, enable_kv_events=True)
    k = list(range(1, 3 * ps + 1))
    tree.insert(k[:ps], alloc.take(ps))
    tree.insert(k[: 2 * ps], alloc.take(2 * ps))
    tree.insert(k, alloc.take(3 * ps))
    assert tree.take_events() == [_stored(_h(k, ps), None, k, ps)]


def test_stores_that_do_not_chain_are_separate(alloc) -> None:
    tree = RadixTree(page_size=2, enable_kv_events=True)
    tree.insert([1, 2], alloc.take(2))
    tree.insert([3, 4], alloc.take(2))  # parent None != previous tail
    tree.insert(RadixKey([3, 4, 5, 6], extra_key="a"), alloc.take(4))  # other namespace
    events = tree.take_events()
    assert events == [
        _stored(_h([1, 2], 2), None, [1, 2], 2),
        _stored(_h([3, 4], 2), None, [3, 4], 2),
        _stored(_ns_h([3, 4, 5, 6], 2, "a", None), None, [3, 4, 5, 6], 2, lora_name="a"),
    ]


def test_namespaced_events_carry_namespace_and_distinct_hashes(alloc) -> None:
    tree = RadixTree(page_size=2, enable_kv_events=True)
    tree.insert(RadixKey([1, 2, 3, 4], "lora", "salt"), alloc.take(4))
    tree.insert(RadixKey([1, 2, 3, 4], None, "salt"), alloc.take(4))
    tree.insert([1, 2, 3, 4], alloc.take(4))
    a, b, c = tree.take_events()
    assert a == _stored(
        _ns_h([1, 2, 3, 4], 2, "lora", "salt"), None, [1, 2, 3, 4], 2,
        lora_name="lora", cache_salt="salt",
    )
    assert b == _stored(_ns_h([1, 2, 3, 4], 2, None, "salt"), None, [1, 2, 3, 4], 2,
                        cache_salt="salt")
    assert c == _stored(_h([1, 2, 3, 4], 2), None, [1, 2, 3, 4], 2)
    assert len({*a.block_hashes, *b.block_hashes, *c.block_hashes}) == 6
    # A leaf below a namespaced node links to its namespaced parent hash.
    tree.insert(RadixKey([1, 2, 9, 9], "lora", "salt"), alloc.take(4))
    (d,) = tree.take_events()
    assert d.parent_block_hash == a.block_hashes[0]
    assert d.block_hashes == _ns_h([1, 2, 9, 9], 2, "lora", "salt")[1:]


def test_split_emits_nothing(alloc) -> None:
    tree = RadixTree(page_size=2, enable_kv_events=True)
    tree.insert([1, 2, 3, 4, 5, 6], alloc.take(6))
    tree.take_events()
    tree.match_prefix([1, 2, 3, 4, 7, 7])
    assert tree.take_events() == []
    assert tree.node_count == 2


def test_removal_media_for_host_eviction_and_drops(alloc) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through",
                     enable_kv_events=True)
    for key in ([1], [2]):
        (req,) = tree.insert(key, alloc.take(1)).backups
        tree.commit_backup(req.op_id, alloc.take(1))
    tree.match_prefix([2])
    tree.take_events()
    tree.evict(1)  # [1] demoted
    assert tree.take_events() == [BlockRemoved(_h([1], 1), Medium.GPU)]
    tree.evict_host(1)  # host-only leaf [1]
    assert tree.take_events() == [BlockRemoved(_h([1], 1), Medium.CPU_PINNED)]
    tree.evict_host(1, reclaim_duplicates=True)  # duplicate of [2] (asked for: write-through)
    assert tree.take_events() == [BlockRemoved(_h([2], 1), Medium.CPU_PINNED)]
    tree.evict(1)  # [2] no longer backed up: deleted
    assert tree.take_events() == [BlockRemoved(_h([2], 1), Medium.GPU)]
    tree.sanity_check()


def test_delete_with_host_subtree_removes_both_media(alloc) -> None:
    tree = RadixTree(page_size=1, host_enabled=True, write_policy="write_through",
                     enable_kv_events=True)
    (ra,) = tree.insert([1], alloc.take(1)).backups
    tree.abort_backup(ra.op_id)
    res = tree.insert([1, 2], alloc.take(2), inserted_len=1)
    assert [r.node_id for r in res.backups] == [1, 2]
    tree.abort_backup(res.backups[0].op_id)
    tree.commit_backup(res.backups[1].op_id, alloc.take(1))
    tree.evict(1)  # [2] demoted
    tree.take_events()
    tree.evict(1)  # [1] deleted with its host-only child
    assert tree.take_events() == [
        BlockRemoved(_h([1], 1), Medium.GPU),
        BlockRemoved([_h([1, 2], 1)[1]], Medium.CPU_PINNED),
    ]


def test_reset_emits_all_blocks_cleared(alloc) -> None:
    tree = RadixTree(page_size=2, enable_kv_events=True)
    tree.insert([1, 2], alloc.take(2))
    tree.take_events()
    tree.reset()
    assert tree.take_events() == [AllBlocksCleared()]
    tree.insert([1, 2], alloc.take(2))
    tree.reset()
    assert tree.take_events() == [_stored(_h([1, 2], 2), None, [1, 2], 2), AllBlocksCleared()]
    # After a reset the chain restarts: the same key is stored again with a null parent.
    tree.insert([1, 2, 3, 4], alloc.take(4))
    assert tree.take_events() == [_stored(_h([1, 2, 3, 4], 2), None, [1, 2, 3, 4], 2)]


def test_events_disabled_records_nothing(alloc) -> None:
    tree = RadixTree(page_size=2)
    tree.insert([1, 2], alloc.take(2))
    tree.evict(2)
    tree.reset()
    assert tree.take_events() == []
