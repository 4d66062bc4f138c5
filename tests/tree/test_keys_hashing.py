"""Keys, namespaces and the SHA-256 page-hash chain (behavior.md 1.2, 1.14)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from asynccache.errors import InvalidInputError
from asynccache.tree import (
    DEFAULT_NAMESPACE,
    Namespace,
    RadixKey,
    RadixTree,
    chain_digests,
    chain_seed,
    event_hash,
    storage_key,
)
from asynccache.tree.hashing import event_hashes

PAGE_SIZES = (1, 4, 16, 64)
NAMESPACES = (
    (None, None),
    ("lora-a", None),
    (None, "lora-a"),
    ("lora-a", "salt-b"),
)


# ---------------------------------------------------------------- independent reference
def _u32le(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def _part(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + struct.pack("<Q", len(raw)) + raw


def _seed(extra_key: str | None, cache_salt: str | None) -> bytes:
    if extra_key is None and cache_salt is None:
        return b""
    return hashlib.sha256(
        b"sglang-cache-namespace-v1" + _part(extra_key) + _part(cache_salt)
    ).digest()


def _chain(tokens: list[int], page: int, seed: bytes = b"") -> list[bytes]:
    """Default namespace (empty seed): d_0 = H(page_0), d_i = H(d_{i-1} || page_i). Namespaced:
    d_i = H(seed || d_{i-1} || page_i) with d_{-1} = 32 zero bytes."""
    out = []
    prev = bytes(32) if seed else b""
    for off in range(0, len(tokens) - len(tokens) % page, page):
        prev = hashlib.sha256(seed + prev + _u32le(tokens[off : off + page])).digest()
        out.append(prev)
    return out


def _event_hash(digest: bytes, extra_key: str | None = None, cache_salt: str | None = None) -> int:
    if extra_key is None and cache_salt is None:
        return struct.unpack(">q", digest[:8])[0]
    seed = hashlib.sha256(
        b"sglang-kv-event-namespace-v1" + _part(extra_key) + _part(cache_salt)
    ).digest()
    return struct.unpack(">q", hashlib.sha256(seed + digest[:8]).digest()[:8])[0]


# ---------------------------------------------------------------- keys
def test_radix_key_encodes_tokens_and_namespace() -> None:
    key = RadixKey([1, 2, 2**32 - 1], extra_key="a", cache_salt="b")
    assert len(key) == 3
    assert key.tokens == [1, 2, 2**32 - 1]
    assert key.data == _u32le([1, 2, 2**32 - 1])
    assert key.namespace is Namespace("a", "b")
    assert key[1:].tokens == [2, 2**32 - 1]
    assert key[1:].namespace is key.namespace
    assert RadixKey(np.array([1, 2], dtype=np.int32)).data == _u32le([1, 2])
    assert RadixKey([1, 2]).namespace is DEFAULT_NAMESPACE


def test_namespaces_are_interned_and_distinct() -> None:
    assert Namespace("a", None) is Namespace("a", None)
    assert Namespace("a", None) is not Namespace(None, "a")
    assert Namespace("", None) is not DEFAULT_NAMESPACE
    assert RadixKey([1], extra_key="a") != RadixKey([1], cache_salt="a")
    assert RadixKey([1], extra_key="a") == RadixKey([1], namespace=Namespace("a"))
    assert RadixKey([1]) != RadixKey([1], extra_key="a")


def test_an_empty_cache_salt_is_no_salt_as_in_sglang() -> None:
    # SGLang's RadixKey keeps ``cache_salt or None``: an empty salt shares the default
    # namespace's nodes and page keys (an empty extra_key stays a namespace of its own, in both).
    assert Namespace(None, "") is DEFAULT_NAMESPACE
    assert Namespace("a", "") is Namespace("a", None)
    assert RadixKey([1, 2], cache_salt="").namespace is DEFAULT_NAMESPACE
    tree = RadixTree(page_size=2, enable_page_hashes=True)
    res = tree.insert([1, 2, 3, 4], np.arange(4, dtype=np.int64))
    m = tree.match_prefix(RadixKey([1, 2, 3, 4], cache_salt=""))
    assert m.device_prefix_len == 4 and m.last_device_node == res.last_node
    assert tree.page_hashes(res.last_node) == [d.hex() for d in _chain([1, 2, 3, 4], 2)]


def test_namespace_rejects_non_string() -> None:
    with pytest.raises(InvalidInputError, match="extra_key must be a str or None, got 7"):
        RadixKey([1], extra_key=7)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="not both"):
        RadixKey([1], extra_key="a", namespace=Namespace("a"))


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_namespaces_never_share_nodes(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps)
    tokens = list(range(100, 100 + 2 * ps))
    values = {}
    for i, (ek, salt) in enumerate(NAMESPACES):
        v = alloc.take(2 * ps)
        values[(ek, salt)] = v
        res = tree.insert(RadixKey(tokens, ek, salt), v)
        assert (res.prefix_len, res.cached_len, res.device_frees) == (0, 2 * ps, [])
        assert tree.node_count == i + 1
        assert tree.node_key(res.last_node) == RadixKey(tokens, ek, salt)
    assert tree.device_size == 4 * 2 * ps
    tree.sanity_check()
    for (ek, salt), v in values.items():
        m = tree.match_prefix(RadixKey(tokens, ek, salt))
        assert m.device_prefix_len == 2 * ps
        assert m.device_indices.tolist() == v.tolist()
    # A namespace that was never inserted matches nothing, even with identical tokens.
    m = tree.match_prefix(RadixKey(tokens, "other", None))
    assert (m.device_prefix_len, m.best_node, m.last_device_node) == (0, 0, 0)
    # A split inside one namespace leaves the others untouched.
    tree.insert(RadixKey([*tokens[:ps], *([7] * ps)], "lora-a", None), alloc.take(2 * ps))
    assert tree.node_count == 6
    for (ek, salt), v in values.items():
        assert tree.match_prefix(RadixKey(tokens, ek, salt)).device_indices.tolist() == v.tolist()
    tree.sanity_check()


# ---------------------------------------------------------------- page hashes
def test_chain_helpers_match_independent_sha256() -> None:
    assert chain_seed(DEFAULT_NAMESPACE) == b""
    assert chain_seed(Namespace("x", None)) == _seed("x", None)
    assert chain_seed(Namespace(None, "s")) == _seed(None, "s")
    assert chain_seed(Namespace("x", "s")) == _seed("x", "s")
    # The parts are length-prefixed, so ("ab", None) and ("a", "b") differ.
    assert _seed("ab", None) != _seed("a", "b")
    assert chain_seed(Namespace("ab", None)) != chain_seed(Namespace("a", "b"))
    digest = hashlib.sha256(_u32le([1, 2])).digest()
    assert storage_key(digest) == digest.hex()
    assert event_hash(digest, DEFAULT_NAMESPACE) == int.from_bytes(digest[:8], "big", signed=True)
    assert event_hash(digest, Namespace("x", None)) == _event_hash(digest, "x", None)
    assert event_hash(digest, Namespace("x", None)) != event_hash(digest, Namespace(None, "x"))


def test_event_hash_is_signed() -> None:
    # Find a digest whose first byte has the high bit set: its event hash must be negative.
    tok = next(t for t in range(1000) if hashlib.sha256(_u32le([t])).digest()[0] >= 0x80)
    digest = hashlib.sha256(_u32le([tok])).digest()
    h = event_hash(digest, DEFAULT_NAMESPACE)
    assert h < 0
    assert h == int.from_bytes(digest[:8], "big") - 2**64


def test_event_hashes_of_many_digests_match_one_by_one() -> None:
    """The batch form (one numpy pass in the default namespace) gives each page's own hash,
    signed, in order, in every namespace."""
    digests = [hashlib.sha256(_u32le([t])).digest() for t in range(64)]
    want = [int.from_bytes(d[:8], "big", signed=True) for d in digests]
    assert any(h < 0 for h in want) and any(h > 0 for h in want)
    got = event_hashes(digests, DEFAULT_NAMESPACE)
    assert got == want and all(type(h) is int for h in got)
    ns = Namespace("x", "s")
    assert event_hashes(digests, ns) == [_event_hash(d, "x", "s") for d in digests]
    assert event_hashes([], DEFAULT_NAMESPACE) == [] and event_hashes([], ns) == []


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_page_hash_chain_exact(ps: int, eager: bool, alloc) -> None:
    tree = RadixTree(page_size=ps, enable_page_hashes=eager)
    tokens = [(7 * i + 3) % 50_000 for i in range(3 * ps + ps // 2)]
    res = tree.insert(tokens, alloc.take(len(tokens)))
    want = [d.hex() for d in _chain(tokens, ps)]
    assert len(want) == 3
    assert tree.page_hashes(res.last_node) == want
    # Split after the first page: the prefix keeps the first hash, the suffix continues.
    branch = [*tokens[:ps], *([9] * ps)]
    res2 = tree.insert(branch, alloc.take(2 * ps))
    prefix_id = tree.match_prefix(tokens[:ps]).best_node
    assert tree.page_hashes(prefix_id) == want[:1]
    assert tree.page_hashes(res.last_node) == want
    assert tree.page_hashes(res2.last_node) == [d.hex() for d in _chain(branch, ps)]
    assert tree.page_hashes(tree.root_id) == []
    tree.sanity_check()


@pytest.mark.parametrize("ps", (1, 4))
def test_page_hashes_are_position_aware(ps: int, alloc) -> None:
    tree = RadixTree(page_size=ps, enable_page_hashes=True)
    tokens = [5] * (3 * ps)  # three identical pages
    res = tree.insert(tokens, alloc.take(3 * ps))
    hashes = tree.page_hashes(res.last_node)
    assert len(set(hashes)) == 3
    assert hashes == [d.hex() for d in _chain(tokens, ps)]


@pytest.mark.parametrize(("ek", "salt"), NAMESPACES[1:])
def test_page_hash_chain_namespaced_seed(ek, salt, alloc) -> None:
    ps = 4
    tree = RadixTree(page_size=ps, enable_page_hashes=True)
    tokens = list(range(2 * ps))
    plain = tree.insert(tokens, alloc.take(2 * ps))
    ns = tree.insert(RadixKey(tokens, ek, salt), alloc.take(2 * ps))
    assert tree.page_hashes(plain.last_node) == [d.hex() for d in _chain(tokens, ps)]
    assert tree.page_hashes(ns.last_node) == [
        d.hex() for d in _chain(tokens, ps, _seed(ek, salt))
    ]
    assert set(tree.page_hashes(plain.last_node)).isdisjoint(tree.page_hashes(ns.last_node))
    tree.sanity_check()


# ---------------------------------------------------------------- tenant isolation of keys
def _crafted_default_prefix(extra_key: str, ps: int) -> list[int]:
    """A first page whose uint32 bytes are exactly the namespace seed's preimage: under a chain
    seeded by plain concatenation its digest would equal the namespace's seed."""
    pre = b"sglang-cache-namespace-v1" + _part(extra_key) + _part(None)
    assert len(pre) == 4 * ps, "choose the extra key's length to fill one page"
    return list(struct.unpack(f"<{ps}I", pre))


@pytest.mark.parametrize("ps", (16, 64))
def test_crafted_default_prompt_shares_no_key_with_a_namespace(ps: int, alloc) -> None:
    """A default-namespace prompt that starts with a namespace's seed preimage must not reach
    that namespace's storage keys (issue: 4 of 4 crafted cases served another tenant's KV)."""
    extra = "k" * (4 * ps - len(b"sglang-cache-namespace-v1") - 10)
    prefix = _crafted_default_prefix(extra, ps)
    assert max(prefix) > 10**9  # token ids the API accepts
    body = list(range(1, 3 * ps + 1))
    tree = RadixTree(page_size=ps, enable_page_hashes=True)
    default = tree.chain_keys(tree.root_id, [*prefix, *body], 0)
    tenant = tree.chain_keys(tree.root_id, RadixKey(body, extra, None), 0)
    assert len(default) == 4 and len(tenant) == 3
    assert not set(default) & set(tenant)
    # The same through the tree's stored nodes.
    a = tree.insert([*prefix, *body], alloc.take(4 * ps)).last_node
    b = tree.insert(RadixKey(body, extra, None), alloc.take(3 * ps)).last_node
    assert not set(tree.page_hashes(a)) & set(tree.page_hashes(b))
    tree.sanity_check()


def test_namespaced_chain_is_structurally_distinct() -> None:
    """Namespaced pages hash ``seed || prev || page`` with a fixed-width ``prev`` (zeros for the
    first page); default pages keep the reference's ``prev || page`` (empty prev first)."""
    ns = Namespace("x", "s")
    seed = _seed("x", "s")
    p0, p1 = _u32le([5, 6]), _u32le([7, 8])
    d0 = hashlib.sha256(seed + bytes(32) + p0).digest()
    d1 = hashlib.sha256(seed + d0 + p1).digest()
    assert chain_digests(ns, None, p0 + p1, 8) == [d0, d1]
    assert chain_digests(ns, d0, p1, 8) == [d1]
    e0 = hashlib.sha256(p0).digest()
    assert chain_digests(DEFAULT_NAMESPACE, None, p0 + p1, 8) == [e0, hashlib.sha256(e0 + p1).digest()]


def test_namespace_intern_table_drops_unused_namespaces(alloc) -> None:
    """Per-request salts must not accumulate forever (issue: 46.6 MB after 200k salts); a
    namespace stays interned (identity-exact) while anything uses it."""
    import gc

    from asynccache.tree.keys import interned_namespaces

    base = interned_namespaces()
    tree = RadixTree(page_size=1)
    kept = RadixKey([1, 2], None, "kept-salt")
    tree.insert(RadixKey([5, 6], None, "in-tree-salt"), alloc.take(2))
    for i in range(5000):
        RadixKey([1, 2, 3], None, f"salt-{i}")
    gc.collect()
    assert interned_namespaces() <= base + 2
    assert Namespace(None, "kept-salt") is kept.namespace
    m = tree.match_prefix(RadixKey([5, 6], None, "in-tree-salt"))
    assert m.device_prefix_len == 2  # the tree's namespace is still the interned one
    assert Namespace() is DEFAULT_NAMESPACE


# ---------------------------------------------------------------- key input forms
def _forms(tokens: list[int]) -> dict[str, object]:
    from array import array

    import torch

    return {
        "list": tokens, "tuple": tuple(tokens), "array_q": array("q", tokens),
        "array_I": array("I", tokens), "array_h": array("h", [t % 30000 for t in tokens]),
        "np_int32": np.array(tokens, dtype=np.int32), "np_uint32": np.array(tokens, np.uint32),
        "np_int64": np.array(tokens, dtype=np.int64), "torch_int64": torch.tensor(tokens),
        "torch_int32": torch.tensor(tokens, dtype=torch.int32),
        "np_strided": np.array([x for t in tokens for x in (t, -1)], dtype=np.int64)[::2],
    }


def test_every_input_form_gives_the_same_key() -> None:
    tokens = [0, 1, 7, 31999, 65535, 2**31 - 1]
    want = RadixKey(tokens).data
    assert want == struct.pack(f"<{len(tokens)}I", *tokens)
    for name, form in _forms(tokens).items():
        expect = RadixKey([t % 30000 for t in tokens]).data if name == "array_h" else want
        assert RadixKey(form).data == expect, name


@pytest.mark.parametrize(("tokens", "needle"), [
    ([1, 2**32, 3], "4294967296 at position 1"),
    ([1, -5], "-5 at position 1"),
    ([1, 2.0], "position 1 is not an int: 2.0"),
    ([1, "2"], "position 1 is not an int: '2'"),
])
def test_bad_list_tokens_are_named(tokens, needle) -> None:
    with pytest.raises(InvalidInputError, match=needle):
        RadixKey(tokens)


def test_bad_array_tokens_are_named() -> None:
    from array import array

    with pytest.raises(InvalidInputError, match="-3 at position 2"):
        RadixKey(array("q", [1, 2, -3]))
    with pytest.raises(InvalidInputError, match="4294967296 at position 0"):
        RadixKey(np.array([2**32], dtype=np.int64))
    with pytest.raises(InvalidInputError, match="typecode 'd'"):
        RadixKey(array("d", [1.0]))
    with pytest.raises(InvalidInputError, match="dtype float64"):
        RadixKey(np.array([1.0]))
    with pytest.raises(InvalidInputError, match="one-dimensional"):
        RadixKey(np.zeros((2, 2), dtype=np.int64))
