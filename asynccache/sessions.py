"""Sessions: radix session references and streaming (multi-turn) sessions.

Radix sessions (as the reference system has them). A session has *generations*: ``open`` starts a new one. When a
request of the session finishes and is cached, the node it inserted gets a session reference
(:meth:`asynccache.tree.RadixTree.add_session_ref`): eviction takes the session's paths after
everything else. ``release`` closes the session and drops its references. Closed ids are kept
in a bounded list so a request that finishes after its session closed does not re-tag nodes.

Streaming sessions keep one request alive across turns: its KV stays pinned (the matched
prefix locked, its own slots held), each turn appends tokens without a new match, and closing
the session caches or frees the KV.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from asynccache.errors import InvalidInputError
from asynccache.request import CacheRequest
from asynccache.tree import BigramKey, RadixKey, RadixTree, SessionRef


class RequestCalls(Protocol):
    """What a streaming session needs of its cache."""

    def admit(self, tokens: RadixKey | Any, rid: str | None = None) -> CacheRequest: ...

    def cache_finished_req(self, req: CacheRequest, *, insert: bool = True) -> None: ...


CLOSED_IDS_LIMIT = 8192


def _check_id(session_id: Any) -> str:
    if not isinstance(session_id, str) or not session_id:
        raise InvalidInputError(f"session_id must be a non-empty string, got {session_id!r}")
    return session_id


class SessionTracker:
    """Open radix sessions, their generation and the references their requests registered."""

    def __init__(self, tree: RadixTree, *, closed_limit: int = CLOSED_IDS_LIMIT) -> None:
        self._tree = tree
        self._gens = itertools.count(1)
        self._open: dict[str, int] = {}
        self._refs: dict[str, list[SessionRef]] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._closed_limit = closed_limit

    def open(self, session_id: str) -> int:
        """Start a new generation of ``session_id`` (an older one's references are dropped)."""
        sid = _check_id(session_id)
        if sid in self._open:
            self._drop_refs(sid)
        self._closed.pop(sid, None)
        gen = next(self._gens)
        self._open[sid] = gen
        return gen

    def ensure(self, session_id: str) -> int | None:
        """The current generation, opening one if the id is new; None if the id was closed."""
        sid = _check_id(session_id)
        gen = self._open.get(sid)
        if gen is None and sid not in self._closed:
            gen = self.open(sid)
        return gen

    def generation(self, session_id: str) -> int | None:
        return self._open.get(_check_id(session_id))

    def register(self, session_id: str, generation: int | None, node_id: int) -> bool:
        """Reference ``node_id`` for the session if ``generation`` is still its current one."""
        if generation is None or self._open.get(session_id) != generation:
            return False
        self._refs.setdefault(session_id, []).append(self._tree.add_session_ref(node_id))
        return True

    def release(self, session_id: str) -> int:
        """Close the session and drop its references; returns how many were dropped."""
        sid = _check_id(session_id)
        if sid not in self._open:
            if sid in self._closed:
                return 0
            raise InvalidInputError(f"session {sid!r} is not open")
        del self._open[sid]
        self._closed[sid] = None
        while len(self._closed) > self._closed_limit:
            self._closed.popitem(last=False)
        return self._drop_refs(sid)

    def _drop_refs(self, sid: str) -> int:
        refs = self._refs.pop(sid, [])
        for ref in refs:
            self._tree.release_session_ref(ref)
        return len(refs)

    def references(self, session_id: str) -> int:
        return len(self._refs.get(session_id, ()))

    def is_closed(self, session_id: str) -> bool:
        return session_id in self._closed

    @property
    def open_sessions(self) -> int:
        return len(self._open)


class StreamingSession:
    """A multi-turn session whose KV stays pinned between turns.

    ``req = session.turn(tokens)`` starts a turn: the first turn matches the cache like any
    request; later turns append ``tokens`` after everything computed so far, without a match.
    Compute the turn with the usual calls (``load_back_request`` on the first turn,
    ``extend``), then ``end_turn()``. ``close(cache=True)`` inserts the whole conversation into
    the tree; ``close(cache=False)`` frees it.
    """

    def __init__(self, cache: RequestCalls, session_id: str,
                 on_close: Callable[[StreamingSession], None],
                 key_of: Callable[[Any], RadixKey]) -> None:
        self.session_id = _check_id(session_id)
        self._cache = cache
        self._key_of = key_of  # the cache's checked key (admit's check: max_token_id)
        self._on_close = on_close
        self._req: CacheRequest | None = None
        self._in_turn = False
        self.turns = 0
        self.closed = False

    @property
    def request(self) -> CacheRequest | None:
        return self._req

    @property
    def held_tokens(self) -> int:
        """Device slots this session keeps alive: its computed tokens plus reserved spares."""
        req = self._req
        return 0 if req is None or req.finished else req.computed + len(req.spare)

    def turn(self, tokens: RadixKey | Any) -> CacheRequest:
        """Start the next turn with ``tokens``. Refused tokens (an id past ``max_token_id``,
        another namespace than the session's) raise before anything of the session changes."""
        if self.closed:
            raise InvalidInputError(f"streaming session {self.session_id!r} is closed")
        if self._in_turn:
            raise InvalidInputError(
                f"streaming session {self.session_id!r}: end turn {self.turns} first"
            )
        number = self.turns + 1
        rid = f"{self.session_id}/turn-{number}"
        req = self._req
        if req is None:
            req = self._cache.admit(tokens, rid)  # (admit checks the tokens)
        else:
            key = self._key_of(tokens)  # a later turn does not go through admit
            if key.namespace is not req.key.namespace:
                raise InvalidInputError(
                    f"turn {number} of {self.session_id!r} has namespace {key.namespace!r}, "
                    f"the session {req.key.namespace!r}"
                )
            old = req.key
            if isinstance(old, BigramKey):  # EAGLE: raw tokens computed so far, then the turn's
                req.key = BigramKey(old.tokens[: req.computed] + key.tokens,
                                    namespace=old.namespace)
            else:
                req.key = RadixKey.from_bytes(old.data[: req.computed * 4] + key.data,
                                              old.namespace)
            req.rid = rid
        self._req = req
        self.turns = number
        self._in_turn = True
        return req

    def end_turn(self) -> None:
        if not self._in_turn:
            raise InvalidInputError(f"streaming session {self.session_id!r} has no turn open")
        self._in_turn = False

    def close(self, *, cache: bool = True) -> None:
        """End the session: cache its KV in the tree (``cache=True``) or free it.

        The session is closed only once its request is finished: if finishing raises, the
        session still holds its request (nothing is dropped or leaked) and ``close()`` can
        be called again."""
        if self.closed:
            return
        req = self._req
        if req is not None and not req.finished:
            self._cache.cache_finished_req(req, insert=cache)
        self.closed = True
        self._req = None
        self._in_turn = False
        self._on_close(self)
