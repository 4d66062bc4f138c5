"""Deterministic requests and KV contents, and a bit-exact checker of served KV.

The KV of a token is :func:`asynccache.replay.kvgen.expected_kv`: a pure function of (token id,
position), with bit patterns that survive any copy, so a page served from the wrong slot, the
wrong position or a corrupt storage object is caught bit for bit. Keys in a namespace
(``extra_key`` / ``cache_salt``) get their own KV, so KV served across namespaces is caught too;
the default namespace's KV is exactly the replay driver's (``asynccache replay`` data verifies).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

if TYPE_CHECKING:
    import torch

    from asynccache.cache import HierarchicalCache
    from asynccache.requests import CacheRequest
    from asynccache.transfers.pools import KVShape
    from asynccache.tree import RadixKey

__all__ = ["KVFactory", "KVMismatchError", "Served"]


class KVMismatchError(AssertionError):
    """Served KV differs from the KV of its tokens (an ``AssertionError``: a test failure)."""


@dataclass(frozen=True)
class Served:
    """What :meth:`KVFactory.serve` did for one request (token counts)."""

    request: CacheRequest
    device_hit: int  # cached on device at admission
    fetched: int  # brought from storage (L3) into host memory
    loaded: int  # loaded back from host memory (L2) onto the device
    computed: int  # written by the "model" (not served by the cache)
    verified: int  # served tokens whose KV was checked bit for bit

    @property
    def cached(self) -> int:
        """Tokens whose KV the cache served (device hit plus loaded)."""
        return self.device_hit + self.loaded


def _split_key(tokens: Any, extra_key: str | None, cache_salt: str | None) -> RadixKey:
    from asynccache.tree import RadixKey

    if isinstance(tokens, RadixKey):
        if extra_key is not None or cache_salt is not None:
            raise ValueError("tokens is a RadixKey: its namespace is used, drop extra_key/cache_salt")
        return tokens
    return RadixKey(tokens, extra_key=extra_key, cache_salt=cache_salt)


def _salt(key: RadixKey) -> int:
    ns = key.namespace
    if ns.extra_key is None and ns.cache_salt is None:
        return 0
    digest = hashlib.blake2b(repr((ns.extra_key, ns.cache_salt)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF or 1


class KVFactory:
    """Seeded prompts and their KV; a checker; a reference request loop.

    ``prompt(n)`` draws fresh tokens (deterministic for the factory's ``seed``), ``prompt(n,
    prefix=p)`` continues ``p``, ``family(...)`` makes prompts that share a prefix. ``expected``
    / ``write`` / ``check`` give, store and verify the KV of tokens; ``serve`` runs one request
    through a cache the way a scheduler does and verifies every token the cache served.
    """

    def __init__(self, seed: int = 0, *, vocab_size: int = 32000) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.seed = seed
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng(seed)

    def __repr__(self) -> str:
        return f"KVFactory(seed={self.seed})"

    # ------------------------------------------------------------------ prompts
    def prompt(self, n: int, *, prefix: Sequence[int] = ()) -> list[int]:
        """``prefix`` followed by ``n`` fresh token ids (never 0)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        fresh = self._rng.integers(1, self.vocab_size, size=n)
        return [int(t) for t in prefix] + [int(t) for t in fresh]

    def family(self, prefix_len: int, suffix_lens: Sequence[int]) -> list[list[int]]:
        """One prompt per entry of ``suffix_lens``, all starting with the same ``prefix_len``
        tokens."""
        shared = self.prompt(prefix_len)
        return [self.prompt(n, prefix=shared) for n in suffix_lens]

    # ------------------------------------------------------------------ KV contents
    def expected(self, shape: HierarchicalCache | KVShape, tokens: Any, start: int = 0,
                 end: int | None = None, *, extra_key: str | None = None,
                 cache_salt: str | None = None) -> torch.Tensor:
        """KV of ``tokens[start:end]`` at their positions: (layers, 2, n, heads, head_dim)."""
        from asynccache.replay.kvgen import expected_kv

        key = _split_key(tokens, extra_key, cache_salt)
        kv_shape = cast("KVShape", getattr(shape, "shape", shape))
        ids = np.asarray(key.tokens, dtype=np.int64)
        end = len(ids) if end is None else end
        if not 0 <= start <= end <= len(ids):
            raise ValueError(f"bad token range [{start}, {end}) of {len(ids)} tokens")
        salted = ids[start:end] ^ _salt(key)
        return expected_kv(kv_shape, salted, np.arange(start, end, dtype=np.int64))

    def write(self, cache: HierarchicalCache, slots: Any, tokens: Any, start: int = 0, *,
              extra_key: str | None = None, cache_salt: str | None = None) -> None:
        """Write the KV of ``tokens[start:start + len(slots)]`` into device ``slots`` (what a
        model's forward pass would do)."""
        n = len(slots)
        cache.write_kv(slots, self.expected(cache, tokens, start, start + n,
                                            extra_key=extra_key, cache_salt=cache_salt))

    def check(self, cache: HierarchicalCache, tokens: Any, slots: Any, start: int = 0, *,
              extra_key: str | None = None, cache_salt: str | None = None,
              what: str = "served KV") -> int:
        """Assert that device ``slots`` hold, bit for bit, the KV of
        ``tokens[start:start + len(slots)]``; returns the number of tokens checked.

        Raises :class:`KVMismatchError` naming the first wrong positions and their slots.
        """
        from asynccache.replay.kvgen import mismatched_tokens

        arr = np.asarray(slots, dtype=np.int64)
        if len(arr) == 0:
            return 0
        got = cache.read_kv(arr)
        want = self.expected(cache, tokens, start, start + len(arr), extra_key=extra_key,
                             cache_salt=cache_salt)
        bad = mismatched_tokens(got, want)
        if len(bad):
            first = ", ".join(f"position {start + int(i)} (slot {int(arr[i])})" for i in bad[:5])
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise KVMismatchError(
                f"{what}: {len(bad)} of {len(arr)} tokens differ from the KV of their tokens: "
                f"{first}{more}"
            )
        return len(arr)

    def check_request(self, cache: HierarchicalCache, req: CacheRequest,
                      what: str = "request KV") -> int:
        """Check every computed token of ``req`` (``req.slots``) against its key."""
        return self.check(cache, req.key, req.slots, what=f"{what} ({req.rid})")

    # ------------------------------------------------------------------ a reference request
    async def serve(self, cache: HierarchicalCache, tokens: Any, *, extra_key: str | None = None,
                    cache_salt: str | None = None, rid: str | None = None,
                    prefetch: bool = False, load_back: bool = True, chunk: int | None = None,
                    finish: bool = True, check: bool = True) -> Served:
        """Serve one request as a scheduler would, verifying every token the cache served.

        admit -> (``prefetch``: L3 -> L2) -> load-back (L2 -> L1; or, with ``load_back=False``,
        only wait for load-backs of the prefix others started) -> check the cached prefix ->
        extend and write the KV of the rest (in ``chunk``-token steps with
        ``cache_unfinished_req`` between them) -> ``cache_finished_req`` (unless ``finish=False``:
        then the caller finishes or aborts ``Served.request``). Any exception, cancellation
        included, aborts the request (its locks and slots are released) and propagates.
        """
        key = _split_key(tokens, extra_key, cache_salt)
        n = len(key)
        req = cache.admit(key, rid=rid)
        device_hit = req.prefix_len
        fetched = verified = 0
        try:
            if prefetch:
                fetched = await cache.prefetch_request(req)
            if load_back:
                await cache.load_back_request(req)
            elif req.pending_loads:
                await cache.wait_loads(req.pending_loads)
            if check:
                verified = self.check(cache, key, req.slots[: req.prefix_len],
                                      what=f"cached prefix of {req.rid}")
            cached = req.prefix_len
            step = chunk or max(n - cached, 1)
            while req.computed < n:
                lo = req.computed
                hi = min(n, lo + step)
                new = await cache.extend(req, hi - lo)
                self.write(cache, new, key, lo)
                if hi < n:
                    cache.cache_unfinished_req(req)
            if check:
                self.check(cache, key, req.slots, what=f"KV of {req.rid}")
        except BaseException:
            if not req.finished and cache.state == "running":
                cache.abort_req(req)
            raise
        if finish:
            cache.cache_finished_req(req)
        return Served(request=req, device_hit=device_hit, fetched=fetched,
                      loaded=cached - device_hit, computed=n - cached, verified=verified)
