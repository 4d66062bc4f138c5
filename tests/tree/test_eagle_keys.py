"""EAGLE bigram keys (behavior.md §1.2, §1.3, §1.14): a key of N + 1 raw tokens is N bigrams;
the tree matches, inserts, splits, pages, namespaces, locks, evicts and hashes the bigram view."""

from __future__ import annotations

import hashlib
import itertools
import struct
from array import array

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynccache.errors import InvalidInputError
from asynccache.tree import (
    BigramKey,
    BlockRemoved,
    BlockStored,
    Medium,
    RadixKey,
    RadixTree,
    TreeConfig,
    as_bigram_key,
    event_hash,
)


def eagle(page_size: int = 1, **kw) -> RadixTree:
    return RadixTree(TreeConfig(page_size=page_size, eagle=True, **kw))


def flat(arrays) -> list[int]:
    return np.concatenate(arrays).tolist() if arrays else []


def bigram_chain(tokens: list[int], page_size: int, prev: bytes = b"") -> list[str]:
    """The reference's page keys of a bigram key, computed independently: each page hashes
    the previous digest, then u32le(t_i) u32le(t_i+1) for each of its bigrams."""
    out = []
    digest = prev
    pairs = list(itertools.pairwise(tokens))
    for p in range(len(pairs) // page_size):
        page = pairs[p * page_size : (p + 1) * page_size]
        body = b"".join(struct.pack("<II", a, b) for a, b in page)
        digest = hashlib.sha256(digest + body).digest()
        out.append(digest.hex())
    return out


# ---------------------------------------------------------------- the key
def test_bigram_key_views_raw_tokens_as_pairs() -> None:
    k = BigramKey([5, 6, 7, 8])
    assert len(k) == 3
    assert k.tokens == [5, 6, 7, 8]
    assert k.pairs == [(5, 6), (6, 7), (7, 8)]
    assert k.data == struct.pack("<6I", 5, 6, 6, 7, 7, 8)
    assert k[1:].tokens == [6, 7, 8] and k[1:].pairs == [(6, 7), (7, 8)]
    assert k[:2].tokens == [5, 6, 7]
    assert k[:0].tokens == [] and len(k[:0]) == 0
    assert len(BigramKey([9])) == 0 and len(BigramKey([])) == 0
    assert k.extended([9, 10]).pairs == [(5, 6), (6, 7), (7, 8), (8, 9), (9, 10)]
    assert k.extended([]) is k
    with pytest.raises(InvalidInputError, match="no last token"):
        BigramKey([]).extended([1])
    # Every form engines hold gives the same key; a token key's view too.
    for form in ([5, 6, 7, 8], array("q", [5, 6, 7, 8]), np.array([5, 6, 7, 8], np.int32),
                 torch.tensor([5, 6, 7, 8])):
        assert BigramKey(form) == k
    assert BigramKey.of(RadixKey([5, 6, 7, 8])) == k
    assert as_bigram_key([5, 6, 7, 8]) == k and as_bigram_key(k) is k
    # Never equal to a token key, even with the same bytes.
    assert RadixKey([5, 6, 6, 7, 7, 8]).data == k.data and RadixKey([5, 6, 6, 7, 7, 8]) != k
    ns = BigramKey([1, 2, 3], extra_key="lora")
    assert ns.namespace.extra_key == "lora" and ns[1:].namespace is ns.namespace
    with pytest.raises(InvalidInputError, match="multiple of 8"):
        BigramKey.from_bytes(b"\x00" * 12)
    with pytest.raises(InvalidInputError, match="outside"):
        BigramKey([1, -2])


def test_a_token_tree_refuses_a_bigram_key() -> None:
    tree = RadixTree(page_size=1)
    with pytest.raises(InvalidInputError, match="bigram key"):
        tree.match_prefix(BigramKey([1, 2, 3]))
    assert tree.node_count == 0


# ---------------------------------------------------------------- match / insert / split
def test_page_1_match_insert_split_on_bigrams(alloc) -> None:
    tree = eagle()
    r = tree.insert([1, 2, 3, 4, 5], np.arange(5))  # raw tokens: the last slot is the caller's
    assert (r.prefix_len, r.cached_len, flat(r.device_frees)) == (0, 4, [])
    assert sorted(tree.device_slots().tolist()) == [0, 1, 2, 3]
    assert tree.evictable_size == 4
    # Raw [1, 2, 3] is 2 bigrams; a plain tree would match 3 tokens.
    m = tree.match_prefix([1, 2, 3])
    assert (m.device_prefix_len, m.device_indices.tolist(), m.full_kv_hit_length) == (2, [0, 1], 2)
    assert tree.node_count == 2  # the match split (1,2)(2,3) | (3,4)(4,5)
    assert tree.node_key(m.last_device_node).tokens == [1, 2, 3]
    assert tree.match_prefix([1, 2]).device_prefix_len == 1
    assert tree.match_prefix([1]).device_prefix_len == 0
    assert tree.match_prefix([1, 2, 4]).device_prefix_len == 1  # (2,4) is not (2,3)
    assert tree.match_prefix([2, 3, 4]).device_prefix_len == 0  # no bigram starts with 2 at 0
    r = tree.insert(BigramKey([1, 2, 3, 9]), np.array([10, 11, 12]))
    assert (r.prefix_len, r.cached_len, flat(r.device_frees)) == (2, 3, [10, 11])
    tree.sanity_check()
    # (1,2) | (2,3) | (3,4)(4,5) and (3,9): the match of [1, 2] split at one bigram
    assert sorted(tree.node_key(n.id).tokens for n in tree.iter_nodes()) == [
        [1, 2], [1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 9]]


def test_page_16_floor_is_on_the_bigram_key() -> None:
    tree = eagle(16)
    raw = list(range(100, 132))  # 32 raw tokens: 31 bigrams: one whole page
    r = tree.insert(raw, np.arange(32))
    assert (r.prefix_len, r.cached_len) == (0, 16)
    assert sorted(tree.device_slots().tolist()) == list(range(16))
    assert tree.match_prefix(raw).device_prefix_len == 16
    raw33 = [*raw, 132]  # 33 raw tokens: 32 bigrams: two pages
    r = tree.insert(raw33, np.arange(50, 83))
    assert (r.prefix_len, r.cached_len, flat(r.device_frees)) == (16, 32, list(range(50, 66)))
    assert tree.match_prefix(raw33).device_indices.tolist() == [*range(16), *range(66, 82)]
    # Diverging inside the second page matches only the first (whole pages only).
    assert tree.match_prefix([*raw[:20], 7, 7]).device_prefix_len == 16
    tree.sanity_check()


def test_value_length_is_checked_against_the_bigram_count() -> None:
    tree = eagle()
    with pytest.raises(InvalidInputError, match="3 slots but the key has 2"):
        tree.insert(BigramKey([1, 2, 3]), np.arange(3))
    with pytest.raises(InvalidInputError, match="5 slots but the key has 2"):
        tree.insert([1, 2, 3], np.arange(5))
    assert tree.node_count == 0


def test_prev_prefix_len_and_duplicate_frees_are_bigram_positions() -> None:
    tree = eagle()
    raw = list(range(1, 10))  # 8 bigrams
    tree.insert(raw, np.arange(8))
    r = tree.insert(BigramKey(raw), np.arange(100, 108), prev_prefix_len=3)
    assert (r.prefix_len, r.cached_len, flat(r.device_frees)) == (8, 8, [103, 104, 105, 106, 107])
    # The tree's own slots handed back are never duplicates.
    r = tree.insert(BigramKey(raw), np.arange(8))
    assert flat(r.device_frees) == []
    with pytest.raises(InvalidInputError, match="prev_prefix_len 9 exceeds the key length 8"):
        tree.insert(BigramKey(raw), np.arange(8), prev_prefix_len=9)
    tree.sanity_check()


@pytest.mark.parametrize("page_size", [1, 16])
def test_namespaces_never_share_bigram_nodes(page_size: int) -> None:
    tree = eagle(page_size, enable_page_hashes=True)
    raw = list(range(2 * page_size + 1))
    tree.insert(BigramKey(raw, extra_key="a"), np.arange(2 * page_size))
    assert tree.match_prefix(raw).device_prefix_len == 0
    assert tree.match_prefix(BigramKey(raw, cache_salt="s")).device_prefix_len == 0
    assert tree.match_prefix(BigramKey(raw, extra_key="a")).device_prefix_len == 2 * page_size
    r = tree.insert(raw, np.arange(100, 100 + 2 * page_size))
    assert r.prefix_len == 0 and tree.node_count == 2
    a, b = sorted(tree.iter_nodes(), key=lambda n: n.id)
    assert tree.page_hashes(a.id) != tree.page_hashes(b.id)
    tree.sanity_check()


def test_locks_and_eviction_count_bigrams() -> None:
    tree = eagle(2)
    tree.insert(list(range(9)), np.arange(9))  # 8 bigrams: [0..8) cached, slot 8 the caller's
    tree.insert([0, 1, 2, 3, 4, 50, 51], np.arange(20, 27))  # shares 4 bigrams, then 2 of its own
    assert tree.evictable_size == 10
    m = tree.match_prefix([0, 1, 2, 3, 4, 50, 51])
    receipt = tree.lock(m.last_device_node)
    assert (tree.evictable_size, tree.protected_size) == (4, 6)
    r = tree.evict(100)
    assert (r.num_evicted, flat(r.device_frees)) == (4, [4, 5, 6, 7])
    assert tree.evict(100).num_evicted == 0
    tree.unlock(receipt)
    r = tree.evict(2)
    assert (r.num_evicted, sorted(flat(r.device_frees))) == (2, [24, 25])
    r = tree.evict(100)
    assert (r.num_evicted, sorted(flat(r.device_frees))) == (4, [0, 1, 2, 3])
    assert tree.node_count == 0
    tree.sanity_check()


# ---------------------------------------------------------------- hashes and events
@pytest.mark.parametrize("page_size", [1, 16])
def test_page_hashes_are_the_reference_chain_over_bigrams(page_size: int) -> None:
    rng = np.random.default_rng(page_size)
    raw = rng.integers(0, 2**32, 3 * page_size + 1, dtype=np.int64).tolist()
    tree = eagle(page_size, enable_page_hashes=True)
    r = tree.insert(raw, np.arange(len(raw)))
    assert r.cached_len == 3 * page_size
    want = bigram_chain(raw, page_size)
    assert tree.page_hashes(r.last_node) == want
    # A split divides the list; a branch continues from its parent's last digest.
    branch = [*raw[: page_size + 1], 7, *range(page_size)]
    r2 = tree.insert(branch, np.arange(100, 100 + len(branch)))
    assert r2.prefix_len == page_size
    assert tree.page_hashes(r2.last_node) == bigram_chain(branch, page_size)
    assert tree.page_hashes(r2.last_node)[0] == want[0]
    # The storage keys of a prompt's uncached pages continue the anchor's chain.
    m = tree.match_prefix(raw[: page_size + 1])
    assert tree.chain_keys(m.best_node, raw, page_size) == want[1:]
    tree.sanity_check()


def test_page_hashes_match_sglangs_own_hash_function() -> None:
    """SGLang 0.5.23's native page hash (a C++ extension it compiles on first use), given the
    attributes it reads off its bigram RadixKey. (Its radix_cache module itself is not
    imported: it reaches torchvision, which is not installed here.)"""
    pytest.importorskip("sglang")
    try:
        from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash
    except ImportError as exc:
        pytest.skip(f"SGLang's hash is not importable: {exc}")
    raw = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 2**32 - 1]
    for ps in (1, 2, 4):
        tree = eagle(ps, enable_page_hashes=True)
        r = tree.insert(raw, np.arange(len(raw)))

        class _Bigrams:  # SGLang's RadixKey(token_ids, is_bigram=True), as its hash reads it
            token_ids = array("q", raw[: r.cached_len + 1])
            is_bigram = True
            n = r.cached_len

            def __len__(self) -> int:
                return self.n

        try:
            theirs = get_native_hash(_Bigrams(), None, ps)
        except RuntimeError as exc:  # the extension could not be built on this machine
            pytest.skip(f"SGLang's native hash extension is unavailable: {exc}")
        assert tree.page_hashes(r.last_node) == theirs
        assert theirs == bigram_chain(raw[: r.cached_len + 1], ps)


def test_namespaced_bigram_chain_seeds_every_page() -> None:
    tree = eagle(2, enable_page_hashes=True)
    key = BigramKey([1, 2, 3, 4, 5], cache_salt="s")
    r = tree.insert(key, np.arange(4))
    part = b"\x00" + b"\x01" + (1).to_bytes(8, "little") + b"s"
    seed = hashlib.sha256(b"sglang-cache-namespace-v1" + part).digest()
    d = bytes(32)
    want = []
    for page in ((1, 2, 2, 3), (3, 4, 4, 5)):
        d = hashlib.sha256(seed + d + struct.pack("<4I", *page)).digest()
        want.append(d.hex())
    assert tree.page_hashes(r.last_node) == want


def test_kv_events_carry_bigram_pages() -> None:
    tree = eagle(2, enable_kv_events=True)
    tree.insert([1, 2, 3, 4, 5], np.arange(5))
    tree.insert([1, 2, 3, 6, 7], np.arange(10, 15))
    d = [bytes.fromhex(h) for h in bigram_chain([1, 2, 3, 4, 5], 2)]
    e = [bytes.fromhex(h) for h in bigram_chain([1, 2, 3, 6, 7], 2)]
    h = [event_hash(x, tree.key_of([1]).namespace) for x in (*d, e[1])]
    assert tree.take_events() == [
        BlockStored(block_hashes=[h[0], h[1]], parent_block_hash=None,
                    token_ids=[(1, 2), (2, 3), (3, 4), (4, 5)], block_size=2, medium=Medium.GPU),
        BlockStored(block_hashes=[h[2]], parent_block_hash=h[0],
                    token_ids=[(3, 6), (6, 7)], block_size=2, medium=Medium.GPU),
    ]
    tree.evict(100)
    removed = tree.take_events()
    assert all(isinstance(ev, BlockRemoved) for ev in removed)
    assert sorted(x for ev in removed for x in ev.block_hashes) == sorted(h)


# ---------------------------------------------------------------- hybrid trees
def test_swa_tree_on_bigrams() -> None:
    tree = eagle(1, sliding_window=4)
    raw = list(range(10))  # 9 bigrams
    r = tree.insert(raw, np.arange(10), component_evicted_seqlens={"swa": 4})
    assert (r.prefix_len, r.cached_len) == (0, 9)
    assert tree.component_sizes("swa") == (5, 0)  # bigram positions 4..8 keep their SWA KV
    m = tree.match_prefix(raw)
    assert m.device_prefix_len == 9
    # 6 bigrams: the window of 4 holds SWA-live bigrams only from position 4 on: not enough.
    m = tree.match_prefix(raw[:7])
    assert (m.device_prefix_len, m.full_kv_hit_length, m.swa_branching_seqlen) == (0, 6, 6)
    tree.sanity_check()


def test_mamba_tree_on_bigrams() -> None:
    tree = eagle(1, mamba=True)
    raw = list(range(10))
    r = tree.insert(raw, np.arange(10), mamba_value=7)
    assert r.cached_len == 9
    m = tree.match_prefix(raw, cow_mamba=True)
    assert (m.device_prefix_len, m.mamba_cow_slot) == (9, 7)
    m = tree.match_prefix(raw[:6])  # 5 bigrams: no state there
    assert (m.device_prefix_len, m.mamba_branching_seqlen) == (0, 5)
    tree.sanity_check()


def test_host_tier_on_bigrams() -> None:
    tree = eagle(2, host_enabled=True, write_policy="write_through")
    r = tree.insert(list(range(9)), np.arange(9))
    assert [b.device_slots.tolist() for b in r.backups] == [list(range(8))]
    tree.commit_backup(r.backups[0].op_id, np.arange(500, 508))
    assert tree.host_size == 8
    ev = tree.evict(100)
    assert ev.num_evicted == 8
    m = tree.match_prefix(list(range(6)))  # 5 bigrams: 2 pages on host
    assert (m.device_prefix_len, m.host_hit_length) == (0, 4)
    assert tree.host_slots_of(m.best_node).tolist() == [500, 501, 502, 503]
    # A prefetched span lands in bigram positions.
    r = tree.insert_host(list(range(13)), 8, np.arange(600, 604))
    assert (r.prefix_len, r.cached_len) == (8, 12)
    assert tree.host_size == 12
    tree.sanity_check()


# ---------------------------------------------------------------- against a plain model
class BigramIds:
    """The model: each distinct bigram gets its own token id; a plain tree over those ids is
    what an EAGLE tree over the raw tokens must be."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, int], int] = {}

    def __call__(self, raw: list[int]) -> list[int]:
        return [self.ids.setdefault(p, len(self.ids)) for p in itertools.pairwise(raw)]


# Keys that share prefixes: a prefix of one of a few sequences (which share their starts and
# repeat bigrams), or a short random one.
_BASES = ([0, 1, 2, 3, 0, 1, 2, 3, 1, 0, 2, 2, 3, 0],
          [0, 1, 2, 3, 0, 1, 3, 3, 2, 1, 0, 1, 2, 3],
          [0, 1, 0, 1, 0, 1, 2, 0, 1, 2, 3, 3, 0, 2])
tokens = st.one_of(
    st.tuples(st.sampled_from(_BASES), st.integers(0, 14)).map(lambda t: t[0][: t[1]]),
    st.lists(st.integers(0, 3), max_size=14),
)
op = st.one_of(
    # k: SWA trees keep SWA KV for only the last k units (6: all of them)
    st.tuples(st.just("insert"), tokens, st.integers(0, 6)),
    st.tuples(st.just("match"), tokens, st.just(0)),
    st.tuples(st.just("evict"), st.integers(1, 6), st.integers(0, 1)),  # k: components too
    st.tuples(st.just("lock"), tokens, st.just(0)),
    st.tuples(st.just("unlock"), st.integers(0, 3), st.just(0)),
)


CONFIGS = {
    "full": {},
    "swa": {"sliding_window": 3},
    "mamba": {"mamba": True},
    "swa+mamba": {"sliding_window": 2, "mamba": True},
    "host": {"host_enabled": True, "write_policy": "write_through"},
    "swa+mamba+host": {"sliding_window": 3, "mamba": True, "host_enabled": True,
                       "write_policy": "write_through"},
}


def frees_of(res) -> dict[str, list[int]]:
    out = {"device": flat(res.device_frees)}
    for name, arrays in sorted(res.component_frees.items()):
        out[name] = flat(arrays)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 2, 4]), config=st.sampled_from(sorted(CONFIGS)),
       ops=st.lists(op, max_size=30))
def test_eagle_tree_is_a_plain_tree_over_bigram_ids(page_size: int, config: str, ops) -> None:
    kw = CONFIGS[config]
    ours = eagle(page_size, **kw)
    model = RadixTree(TreeConfig(page_size=page_size, **kw))
    mamba = bool(kw.get("mamba"))
    ids = BigramIds()
    locks: list[tuple] = []
    slot = 0
    host = 10_000
    swa = bool(kw.get("sliding_window"))
    inserted: list[list[int]] = []
    for step, (kind, arg, k) in enumerate(ops):
        if kind == "insert":
            n = max(len(arg) - 1, 0)
            vals = np.arange(slot, slot + n)
            slot += n
            extra: dict = {"mamba_value": 5000 + step} if mamba and n else {}
            if swa:
                extra["component_evicted_seqlens"] = {"swa": max(0, n - k) if k < 6 else 0}
            a = ours.insert(arg, np.arange(slot - n, slot + 1) if arg else vals, **extra)
            b = model.insert(ids(arg), vals, **extra)
            inserted.append(arg)
            assert (a.prefix_len, a.cached_len, frees_of(a)) == (
                b.prefix_len, b.cached_len, frees_of(b))
            assert [x.device_slots.tolist() for x in a.backups] == [
                x.device_slots.tolist() for x in b.backups]
            for x, y in zip(a.backups, b.backups, strict=True):
                assert sorted(x.component_slots) == sorted(y.component_slots)
                landed = np.arange(host, host + len(x.device_slots))
                host += len(landed)
                parts = {}
                for name, v in sorted(x.component_slots.items()):
                    parts[name] = np.arange(host, host + len(v))
                    host += len(v)
                assert ours.commit_backup(x.op_id, landed, parts)
                assert model.commit_backup(y.op_id, landed, parts)
        elif kind in ("match", "lock"):
            a, b = same_match(ours, model, ids, arg, mamba)
            if kind == "lock":
                locks.append((ours.lock(a.last_device_node), model.lock(b.last_device_node)))
        elif kind == "evict":
            aux = {"swa_num_tokens": arg if swa else 0, "mamba_num": 1 if mamba else 0}
            if not k:
                aux = {}
            a = ours.evict(0 if aux else arg, **aux)
            b = model.evict(0 if aux else arg, **aux)
            assert (a.num_evicted, {k: sorted(v) for k, v in frees_of(a).items()}) == (
                b.num_evicted, {k: sorted(v) for k, v in frees_of(b).items()})
        elif locks:
            ra, rb = locks.pop(arg % len(locks))
            ours.unlock(ra)
            model.unlock(rb)
        assert (ours.evictable_size, ours.protected_size, ours.node_count, ours.host_size) == (
            model.evictable_size, model.protected_size, model.node_count, model.host_size)
        for name in ours.components[1:]:
            assert ours.component_sizes(name) == model.component_sizes(name)
    for key in inserted:  # every key inserted, matched again at the end
        same_match(ours, model, ids, key, mamba)
    ours.sanity_check()


def same_match(ours: RadixTree, model: RadixTree, ids: BigramIds, raw: list[int],
               mamba: bool) -> tuple:
    a = ours.match_prefix(raw, cow_mamba=mamba)
    b = model.match_prefix(ids(raw), cow_mamba=mamba)
    assert a.device_indices.tolist() == b.device_indices.tolist()
    assert (a.full_kv_hit_length, a.host_hit_length, a.swa_branching_seqlen,
            a.mamba_branching_seqlen, a.mamba_cow_slot) == (
        b.full_kv_hit_length, b.host_hit_length, b.swa_branching_seqlen,
        b.mamba_branching_seqlen, b.mamba_cow_slot)
    return a, b
