"""Request traces: parsers for Mooncake JSONL, kv-cache-tester conversations and our own format.

Every parser is a generator of :class:`TraceRequest` in arrival order that reads its input as
a stream and expands one request at a time, so memory does not grow with the trace (see
:mod:`asynccache.replay.kvtester` for the conversations). Files may be compressed (``.gz``,
``.xz``, ``.bz2``); conversations may come in a tar archive (see
:mod:`asynccache.replay.sources`). Traces that publish block hash ids instead of tokens are
expanded to deterministic token ids: block ``b`` of ``B`` tokens becomes ``b * B + [0, B)``,
so equal ids give equal tokens and different ids different tokens.

Bad input raises :class:`TraceFormatError` naming the file, line and field — or, with an
``on_error`` callback, is reported to it and skipped (``asynccache replay --skip-bad-lines``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asynccache.replay.sources import (
    STREAM_ERRORS,
    TraceFormatError,
    inner_suffix,
    is_archive,
    open_binary,
)

__all__ = [
    "KVTESTER_BLOCK",
    "MOONCAKE_BLOCK",
    "OnError",
    "TraceFormatError",
    "TraceRequest",
    "detect_format",
    "expand_blocks",
    "read_kvtester",
    "read_mooncake",
    "read_tokens",
]

MOONCAKE_BLOCK = 512
KVTESTER_BLOCK = 64
TAIL_BASE = 3 << 30  # token ids of un-hashed tails live above every block-derived id

#: Called with each malformed record instead of raising (the record is skipped).
OnError = Callable[[TraceFormatError], None]


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace: arrival time (s from trace start), prompt tokens, output length."""

    rid: str
    arrival: float
    tokens: np.ndarray  # uint32
    output_len: int = 0
    namespace: str | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    val = obj[name]
    if isinstance(val, bool) or not isinstance(val, kind):
        raise TraceFormatError(f"{where}: field {name!r} has bad value {val!r}")
    return val


def block_ids(obj: dict[str, Any], name: str, where: str, block: int) -> list[int]:
    """A list of block ids: non-negative ints small enough to expand to token ids."""
    ids: list[int] = field(obj, name, list, where)
    limit = TAIL_BASE // block - 1
    for i, b in enumerate(ids):
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise TraceFormatError(f"{where}: field {name!r}[{i}] has bad value {b!r}")
        if b > limit:
            raise TraceFormatError(
                f"{where}: field {name!r} holds block id {b}, above the largest "
                f"expandable id {limit}")
    return ids


def expand_blocks(ids: Sequence[int] | np.ndarray, block: int, length: int) -> np.ndarray:
    """Token ids for ``length`` tokens covered by block ``ids`` of ``block`` tokens each
    (ids already checked by :func:`block_ids`)."""
    if not len(ids):
        return np.empty(0, dtype=np.uint32)
    arr = np.asarray(ids, dtype=np.uint32)
    toks = (arr[:, None] * np.uint32(block) + np.arange(block, dtype=np.uint32)).reshape(-1)
    return toks[:length]


def tail_tokens(seed: int, n: int) -> np.ndarray:
    """``n`` deterministic token ids no block can produce (un-hashed prompt tails)."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 1 << 29, size=n, dtype=np.int64) + TAIL_BASE).astype(np.uint32)


def report(err: TraceFormatError, on_error: OnError | None) -> None:
    """Raise ``err``, or hand it to ``on_error`` (the caller then skips the record)."""
    if on_error is None:
        raise err
    on_error(err)


def json_lines(path: str | Path, on_error: OnError | None = None) -> Iterator[tuple[str, Any]]:
    """``("file:line", object)`` for each non-blank line of a (possibly compressed) JSONL file."""
    fh = open_binary(path)
    with fh:
        lineno = 0
        it = iter(fh)
        while True:
            try:
                raw = next(it)
            except StopIteration:
                return
            except STREAM_ERRORS as exc:
                raise TraceFormatError(
                    f"cannot read trace {path} after line {lineno}: {exc}") from None
            lineno += 1
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                report(TraceFormatError(f"{where}: not UTF-8 text"), on_error)
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                report(TraceFormatError(f"{where}: invalid JSON: {exc.msg}"), on_error)
                continue
            yield where, obj


def _mooncake(where: str, obj: Any, lineno: str) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    ts = field(obj, "timestamp", (int, float), where)
    n = field(obj, "input_length", int, where)
    out = field(obj, "output_length", int, where)
    ids = block_ids(obj, "hash_ids", where, MOONCAKE_BLOCK)
    if n < 0 or out < 0 or ts < 0:
        raise TraceFormatError(f"{where}: negative timestamp or length")
    if len(ids) != -(-n // MOONCAKE_BLOCK):
        raise TraceFormatError(
            f"{where}: field 'hash_ids' has {len(ids)} ids for input_length {n} "
            f"(expected {-(-n // MOONCAKE_BLOCK)})"
        )
    if ts != ts or ts == float("inf"):
        raise TraceFormatError(f"{where}: field 'timestamp' has bad value {ts!r}")
    return TraceRequest(f"mc-{lineno}", ts / 1000.0, expand_blocks(ids, MOONCAKE_BLOCK, n), out)


def read_mooncake(path: str | Path, *, on_error: OnError | None = None) -> Iterator[TraceRequest]:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    for where, obj in json_lines(path, on_error):
        try:
            yield _mooncake(where, obj, where.rsplit(":", 1)[1])
        except TraceFormatError as err:
            report(err, on_error)


def _token_request(where: str, obj: Any, lineno: str) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    toks = field(obj, "tokens", list, where)
    for i, tok in enumerate(toks):
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise TraceFormatError(f"{where}: field 'tokens'[{i}] has bad value {tok!r}")
        if tok > 0xFFFFFFFF:
            raise TraceFormatError(f"{where}: field 'tokens' holds an id above 2**32-1")
    t = obj.get("t", 0)
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < float("inf"):
        raise TraceFormatError(f"{where}: field 't' has bad value {t!r}")
    out = obj.get("output_len", 0)
    if isinstance(out, bool) or not isinstance(out, int) or out < 0:
        raise TraceFormatError(f"{where}: field 'output_len' has bad value {out!r}")
    ns = obj.get("namespace")
    if ns is not None and not isinstance(ns, str):
        raise TraceFormatError(f"{where}: field 'namespace' has bad value {ns!r}")
    return TraceRequest(f"tok-{lineno}", float(t), np.asarray(toks, dtype=np.uint32), out, ns)


def read_tokens(path: str | Path, *, on_error: OnError | None = None) -> Iterator[TraceRequest]:
    """Our token-level JSONL: ``{"t": seconds, "tokens": [ids], "output_len": n, "namespace": s}``.

    ``t`` defaults to 0 (file order), ``output_len`` to 0, ``namespace`` to none.
    """
    for where, obj in json_lines(path, on_error):
        try:
            yield _token_request(where, obj, where.rsplit(":", 1)[1])
        except TraceFormatError as err:
            report(err, on_error)


def read_kvtester(paths: Sequence[str | Path], *, gap_s: float = 0.0,
                  on_error: OnError | None = None,
                  on_open: Callable[[int, int, float], None] | None = None,
                  ) -> Iterator[TraceRequest]:
    """kv-cache-tester conversations (files, or tar archives of them), merged by arrival time.

    See :func:`asynccache.replay.kvtester.merge_conversations`.
    """
    from asynccache.replay.kvtester import merge_conversations

    return merge_conversations(paths, gap_s=gap_s, on_error=on_error, on_open=on_open)


def detect_format(path: str | Path) -> str:
    """``mooncake`` / ``kvtester`` / ``tokens`` from a file's name or first record."""
    if is_archive(path) or inner_suffix(path) == ".json":
        return "kvtester"
    for where, obj in json_lines(path):
        if isinstance(obj, dict) and "hash_ids" in obj:
            return "mooncake"
        if isinstance(obj, dict) and "tokens" in obj:
            return "tokens"
        raise TraceFormatError(
            f"{where}: cannot tell the trace format (no 'hash_ids' or 'tokens' field)")
    raise TraceFormatError(f"{path}: cannot tell the trace format (the file has no records)")
