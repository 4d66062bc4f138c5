"""Storage keys computed the documented way, and the crafted-namespace probe.

:func:`storage_keys` derives the storage keys of a prompt's pages independently of the engine
(docs/storage.md, "Page keys and what they guarantee"): to aim faults (``stuck_pages``,
``faults(..., keys=...)``) at chosen pages, or to check what a store holds.

``crafted_namespace(page_size)`` is the probe of issue 23 item 1, for your own deployment.

A namespace's storage keys are seeded with ``S = SHA-256(preimage)`` where ``preimage =
b"sglang-cache-namespace-v1" + part(extra_key) + part(cache_salt)`` (``part(None) = b"\\x00"``,
``part(s) = b"\\x01" + len(s) as 8 bytes LE + s``). A default-namespace prompt whose first page
*is* that preimage, read as little-endian uint32 token ids, gets ``d_0 = SHA-256(page_0) = S``:
with a chain that started namespaced pages from ``S`` alone, its next pages had the namespace's
storage keys, and a prefetch served another tenant's KV. asynccache's derivation puts namespaced
pages on inputs of another length (docs/storage.md, "Page keys"), so the probe must find only
misses; run it against whatever serves your pages (another engine sharing the store included).

The preimage must fill the first page exactly (``4 * page_size`` bytes), so the extra key is
picked (or checked) to have the right length; the token ids are large (around 1.6e9), which a
vocabulary bound (``CacheConfig(max_token_id=...)``) rejects before anything is cached.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "NAMESPACE_TAG",
    "CraftedNamespace",
    "crafted_namespace",
    "namespace_preimage",
    "storage_keys",
]

NAMESPACE_TAG = b"sglang-cache-namespace-v1"


def _part(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode()
    return b"\x01" + len(raw).to_bytes(8, "little") + raw


def namespace_preimage(extra_key: str | None, cache_salt: str | None) -> bytes:
    """The bytes a namespace's storage-key seed is the SHA-256 of."""
    return NAMESPACE_TAG + _part(extra_key) + _part(cache_salt)


def storage_keys(
    tokens: Sequence[int],
    page_size: int,
    *,
    extra_key: str | None = None,
    cache_salt: str | None = None,
) -> list[str]:
    """The storage keys of the whole pages of ``tokens`` (the unaligned tail has none).

    Default namespace: ``d_0 = SHA-256(P_0)``, ``d_i = SHA-256(d_{i-1} || P_i)``; with an extra
    key or salt, ``d_i = SHA-256(S || d_{i-1} || P_i)`` with ``d_{-1}`` = 32 zero bytes and
    ``S = SHA-256(preimage)``. ``P_i``: the page's token ids as uint32 little-endian.
    """
    if extra_key is None and cache_salt is None:
        seed, prev = b"", b""
    else:
        seed = hashlib.sha256(namespace_preimage(extra_key, cache_salt)).digest()
        prev = bytes(32)
    out: list[str] = []
    whole = len(tokens) - len(tokens) % page_size
    for i in range(0, whole, page_size):
        page = struct.pack(f"<{page_size}I", *(int(t) for t in tokens[i : i + page_size]))
        prev = hashlib.sha256(seed + prev + page).digest()
        out.append(prev.hex())
    return out


@dataclass(frozen=True)
class CraftedNamespace:
    """A namespace and a default-namespace first page that spells its seed's preimage."""

    page_size: int
    extra_key: str | None
    cache_salt: str | None
    first_page: tuple[int, ...]  # page_size token ids (uint32)

    @property
    def seed(self) -> bytes:
        """The namespace's seed: ``SHA-256`` of the preimage, the crafted page's digest."""
        return hashlib.sha256(namespace_preimage(self.extra_key, self.cache_salt)).digest()

    def prompt(self, body: Sequence[int]) -> list[int]:
        """The crafted default-namespace prompt: the first page, then ``body`` (serve the
        tenant's prompt ``body`` in the namespace first; the crafted one must not get it)."""
        return [*self.first_page, *(int(t) for t in body)]


def crafted_namespace(
    page_size: int,
    *,
    cache_salt: str | None = None,
    extra_key: str | None = None,
    fill: str = "t",
) -> CraftedNamespace:
    """A namespace (``extra_key``, ``cache_salt``) whose seed preimage is exactly one page of
    ``page_size`` uint32 tokens, and that page's token ids.

    Without ``extra_key``, one of ``fill`` characters of the length needed is made; a given
    ``extra_key`` (with ``cache_salt``) must have that length (``ValueError`` names it). Pages
    of fewer than 9 tokens cannot hold a preimage (``ValueError``).
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    room = 4 * page_size - len(NAMESPACE_TAG) - 9 - len(_part(cache_salt))
    if extra_key is None:
        if room < 0 or len(fill.encode()) != 1:
            raise ValueError(
                f"a page of {page_size} tokens ({4 * page_size} bytes) cannot hold the preimage "
                f"(the tag and the parts need {4 * page_size - room} bytes)"
                if room < 0
                else f"fill must be one ASCII character, got {fill!r}"
            )
        extra_key = fill * room
    elif len(extra_key.encode()) != room:
        raise ValueError(
            f"extra_key must be {room} bytes (utf-8) to fill a page of {page_size} tokens "
            f"with cache_salt={cache_salt!r}, got {len(extra_key.encode())}"
        )
    pre = namespace_preimage(extra_key, cache_salt)
    assert len(pre) == 4 * page_size
    return CraftedNamespace(
        page_size, extra_key, cache_salt, struct.unpack(f"<{page_size}I", pre)
    )
