"""Page hashes: the SHA-256 chain used for storage keys and KV-event block hashes.

A page is its tokens as little-endian uint32 bytes. In the default namespace
``d_0 = sha256(page_0)`` and ``d_i = sha256(d_{i-1} || page_i)``: the reference system's keys,
so storage and routers interoperate. In a namespace (extra key, cache salt) every page hashes
``seed || d_{i-1} || page_i``, with ``seed`` the namespace's digest and ``d_{-1}`` 32 zero bytes.
Storage keys are ``hex(d_i)``; they are position-aware because every page continues from the
previous digest. Namespaced keys are a deliberate difference from the reference, which seeds
only the first page (docs/differences.md, "Namespaced page keys").

Why namespaced pages carry the seed at every step: with the seed only as the first page's
prefix (``sha256(seed || page_0)``), a default-namespace prompt whose first page *is* the seed's
preimage read as uint32 tokens gets ``d_0 == seed``, and from then on its page i+1 has the key
of the namespace's page i (another tenant's KV served from shared storage). Now the digest
inputs differ in length: ``4 * page_size`` bytes (default, first page), ``32 + 4 * page_size``
(default, later pages) and ``64 + 4 * page_size`` (namespaced), and two namespaces' inputs differ
in their first 32 bytes, so a key is shared across namespaces only through a real SHA-256
collision. (A store shared between caches of different page sizes holds pages of different
sizes, which the page format's header tells apart.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Final

import numpy as np

from asynccache.tree.keys import Namespace

_STORAGE_NS_TAG: Final = b"sglang-cache-namespace-v1"
_EVENT_NS_TAG: Final = b"sglang-kv-event-namespace-v1"


def _part(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + len(raw).to_bytes(8, "little") + raw


@lru_cache(maxsize=4096)
def chain_seed(namespace: Namespace) -> bytes:
    """The digest that prefixes every page of a namespace's chain (empty for the default
    namespace)."""
    if namespace.is_default:
        return b""
    return hashlib.sha256(
        _STORAGE_NS_TAG + _part(namespace.extra_key) + _part(namespace.cache_salt)
    ).digest()


@lru_cache(maxsize=4096)
def _event_seed(namespace: Namespace) -> bytes:
    return hashlib.sha256(
        _EVENT_NS_TAG + _part(namespace.extra_key) + _part(namespace.cache_salt)
    ).digest()


_NO_PREV: Final = bytes(32)  # a namespaced chain's "previous digest" before its first page


def chain_digests(
    namespace: Namespace, prev: bytes | None, data: bytes, page_bytes: int
) -> list[bytes]:
    """Digests of each page of ``data`` in ``namespace``, continuing the chain from digest
    ``prev`` (None: ``data`` starts at the first page)."""
    out: list[bytes] = []
    sha = hashlib.sha256
    seed = chain_seed(namespace)
    # Before the first page a namespaced chain's fixed-width "previous digest" is zeros.
    first = _NO_PREV if seed else b""
    digest = first if prev is None else prev
    for off in range(0, len(data), page_bytes):
        digest = sha(seed + digest + data[off : off + page_bytes]).digest()
        out.append(digest)
    return out


def storage_key(digest: bytes) -> str:
    """The storage object key of a page digest."""
    return digest.hex()


def event_hash(digest: bytes, namespace: Namespace) -> int:
    """The signed int64 block hash of a page for KV events.

    The first 8 bytes of the page digest read big-endian (the first 16 hex characters), as a
    signed integer; for a namespaced key it is re-hashed with the namespace's event seed.
    """
    if namespace.is_default:
        return int.from_bytes(digest[:8], "big", signed=True)
    return int.from_bytes(
        hashlib.sha256(_event_seed(namespace) + digest[:8]).digest()[:8], "big", signed=True
    )


_BIG_INT64 = np.dtype(">i8")
_PER_DIGEST = hashlib.sha256().digest_size // 8  # big-endian int64s per digest


def event_hashes(digests: Sequence[bytes], namespace: Namespace) -> list[int]:
    """:func:`event_hash` of each of ``digests`` (32-byte SHA-256 digests). In the default
    namespace the first 8 bytes of every digest are read in one numpy pass: a node's removal
    event at page size 1 has a hash per token."""
    if namespace.is_default:
        firsts: list[int] = np.frombuffer(b"".join(digests), _BIG_INT64)[::_PER_DIGEST].tolist()
        return firsts
    return [event_hash(d, namespace) for d in digests]
