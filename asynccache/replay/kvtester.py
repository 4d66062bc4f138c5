"""kv-cache-tester conversations, merged by arrival time without expanding them up front.

A conversation file is one JSON object (``id``, ``block_size: 64``, ``requests``); sub-agent
requests (``type: "subagent"`` with nested ``requests``) are flattened, their times taken
relative to the sub-agent's start, and every conversation gets its own namespace (its ``id``,
or the file name). Conversation ``k`` (in the order given, archive members in archive order)
starts at ``k * gap_s``.

Memory: a conversation is parsed when the merge's clock reaches its start, and kept in a
compact form — per request its block ids past the prefix it shares with the conversation's
previous request (consecutive agentic turns share nearly all of it), as uint32 — until its
last request is out. Tokens are expanded for one request at a time, as it is yielded. With
``gap_s = 0`` every conversation starts at once, so all of them are parsed before the first
request; the whole public set (710 conversations, 6.0 billion prompt tokens) holds 3.5M ids
then.
"""

from __future__ import annotations

import heapq
import json
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from asynccache.replay.formats import (
    KVTESTER_BLOCK,
    OnError,
    TraceFormatError,
    TraceRequest,
    block_ids,
    expand_blocks,
    field,
    report,
    tail_tokens,
)
from asynccache.replay.sources import archive_members, is_archive, read_all

_EMPTY = np.empty(0, dtype=np.uint32)


@dataclass(slots=True)
class _Request:
    t: float  # absolute arrival (s)
    where: str  # "requests[3].requests[0]"
    n: int
    out: int
    shared: int  # leading ids equal to the previous request's (in arrival order)
    new: np.ndarray  # the ids after those


class Conversation:
    """One parsed conversation: its requests in arrival order, compactly."""

    def __init__(self, namespace: str, requests: list[_Request]) -> None:
        self.namespace = namespace
        self.requests = requests
        self._prev = _EMPTY

    def __len__(self) -> int:
        return len(self.requests)

    def expand(self, i: int) -> TraceRequest:
        """Request ``i`` with its tokens (call in order: each builds on the previous one)."""
        r = self.requests[i]
        ids = np.concatenate([self._prev[: r.shared], r.new]) if r.shared else r.new
        self._prev = ids
        toks = expand_blocks(ids, KVTESTER_BLOCK, len(ids) * KVTESTER_BLOCK)
        rid = f"{self.namespace}/{r.where}"
        tail = r.n - len(toks)
        if tail:
            toks = np.concatenate([toks, tail_tokens(zlib.crc32(rid.encode()), tail)])
        return TraceRequest(rid, r.t, toks, r.out, self.namespace)


def parse_conversation(name: str, data: bytes, start: float,
                       on_error: OnError | None = None) -> Conversation | None:
    """Parse one conversation file's content; None when it is skipped (``on_error`` set)."""
    try:
        conv = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        report(TraceFormatError(f"{name}: not UTF-8 text"), on_error)
        return None
    except json.JSONDecodeError as exc:
        report(TraceFormatError(f"{name}: invalid JSON at line {exc.lineno}: {exc.msg}"),
               on_error)
        return None
    try:
        if not isinstance(conv, dict):
            raise TraceFormatError(f"{name}: expected a JSON object")
        block = conv.get("block_size", KVTESTER_BLOCK)
        if block != KVTESTER_BLOCK:
            raise TraceFormatError(f"{name}: field 'block_size' has bad value {block!r}")
        field(conv, "requests", list, name)
    except TraceFormatError as err:
        report(err, on_error)
        return None
    ns = str(conv.get("id", PurePosixPath(name.rsplit(":", 1)[-1]).stem))
    flat: list[tuple[float, str, int, int, list[int]]] = []
    _flatten(conv["requests"], name, "requests", start, flat, on_error)
    flat.sort(key=lambda x: x[0])  # stable: ties keep file order
    reqs: list[_Request] = []
    prev = _EMPTY
    for t, where, n, out, ids in flat:
        arr = np.asarray(ids, dtype=np.uint32)
        m = min(len(arr), len(prev))
        diff = np.flatnonzero(arr[:m] != prev[:m])
        shared = int(diff[0]) if diff.size else m
        reqs.append(_Request(t, where, n, out, shared, arr[shared:].copy()))
        prev = arr
    return Conversation(ns, reqs)


def _flatten(items: list[Any], name: str, where: str, base: float,
             out: list[tuple[float, str, int, int, list[int]]],
             on_error: OnError | None) -> None:
    for i, r in enumerate(items):
        w = f"{where}[{i}]"
        try:
            if not isinstance(r, dict):
                raise TraceFormatError(f"{name}: {w}: expected an object")
            t = field(r, "t", (int, float), f"{name}: {w}")
            if not 0 <= t < float("inf"):
                raise TraceFormatError(f"{name}: {w}: field 't' has bad value {t!r}")
            if r.get("type") == "subagent" and isinstance(r.get("requests"), list):
                _flatten(r["requests"], name, f"{w}.requests", base + t, out, on_error)
                continue
            n = field(r, "in", int, f"{name}: {w}")
            if n < 0:
                raise TraceFormatError(f"{name}: {w}: field 'in' has bad value {n!r}")
            ids = block_ids(r, "hash_ids", f"{name}: {w}", KVTESTER_BLOCK)
            if len(ids) != n // KVTESTER_BLOCK:
                raise TraceFormatError(
                    f"{name}: {w}: field 'hash_ids' has {len(ids)} ids for in={n} "
                    f"(expected {n // KVTESTER_BLOCK})")
            o = r.get("out", 0) or 0
            if isinstance(o, bool) or not isinstance(o, int) or o < 0:
                raise TraceFormatError(f"{name}: {w}: field 'out' has bad value {o!r}")
        except TraceFormatError as err:
            report(err, on_error)
            continue
        out.append((base + float(t), w, n, o, ids))


def _sources(paths: Sequence[str | Path]) -> Iterator[tuple[str, Callable[[], bytes], float]]:
    """``(name, read, fraction)`` of each conversation: files as given, archive members in
    order; ``fraction`` is how much of the input has been read once it is."""
    for i, p in enumerate(paths):
        if is_archive(p):
            for name, data, frac in archive_members(p):
                if name.lower().endswith(".json"):
                    yield name, (lambda d=data: d), (i + frac) / len(paths)  # type: ignore[misc]
        else:
            yield str(p), (lambda p=p: read_all(p)), (i + 1) / len(paths)  # type: ignore[misc]


def merge_conversations(paths: Sequence[str | Path], *, gap_s: float = 0.0,
                        on_error: OnError | None = None,
                        on_open: Callable[[int, int, float], None] | None = None,
                        ) -> Iterator[TraceRequest]:
    """Requests of every conversation in arrival order (ties: conversation order, then file
    order). ``on_open(conversations, requests, fraction)`` is called after each conversation
    is parsed, with the running totals and the share of the input read (a loading bar)."""
    return _merge(paths, gap_s, on_error, on_open, lambda conv, i: conv.expand(i))


def conversation_lengths(paths: Sequence[str | Path], *, gap_s: float = 0.0,
                         on_open: Callable[[int, int, float], None] | None = None,
                         ) -> Iterator[int]:
    """Prompt lengths of the requests :func:`merge_conversations` yields, in the same order,
    without expanding tokens (malformed records are skipped: the replay reports them)."""
    return _merge(paths, gap_s, lambda err: None, on_open, lambda conv, i: conv.requests[i].n)


def _merge(paths: Sequence[str | Path], gap_s: float, on_error: OnError | None,
           on_open: Callable[[int, int, float], None] | None,
           make: Callable[[Conversation, int], Any]) -> Iterator[Any]:
    sources = _sources(paths)
    heap: list[tuple[float, int, int, Conversation]] = []
    k = opened_requests = 0
    pending = next(sources, None)
    while True:
        while pending is not None and (not heap or k * gap_s <= heap[0][0]):
            name, read, fraction = pending
            conv = parse_conversation(name, read(), k * gap_s, on_error)
            if conv is not None and len(conv):
                heapq.heappush(heap, (conv.requests[0].t, k, 0, conv))
                opened_requests += len(conv)
            k += 1
            if on_open is not None:
                on_open(k, opened_requests, fraction)
            pending = next(sources, None)
        if not heap:
            return
        _, kk, i, conv = heapq.heappop(heap)
        item = make(conv, i)
        if i + 1 < len(conv):
            heapq.heappush(heap, (conv.requests[i + 1].t, kk, i + 1, conv))
        else:
            conv.requests = []  # its memory goes with the last request
        yield item
