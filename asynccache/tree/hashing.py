"""Page hashes: the SHA-256 chain used for storage keys and KV-event block hashes.

``d_0 = sha256(seed || page_0)``, ``d_i = sha256(d_{i-1} || page_i)`` where a page is its tokens
as little-endian uint32 and ``seed`` is empty for the default namespace, else a digest of the
namespace. Storage keys are ``hex(d_i)``; they are position-aware because every page continues
from the previous digest. This matches the reference system's keys, so storage and routers
interoperate.
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
    """The digest a namespace's chain starts from (empty for the default namespace)."""
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


def chain_digests(prev: bytes, data: bytes, page_bytes: int) -> list[bytes]:
    """Digests of each page of ``data`` continuing the chain from digest ``prev``."""
    out: list[bytes] = []
    sha = hashlib.sha256
    digest = prev
    for off in range(0, len(data), page_bytes):
        digest = sha(digest + data[off : off + page_bytes]).digest()
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
