"""Request traces: parsers for Mooncake JSONL, kv-cache-tester conversations and our own format.

Every parser yields :class:`TraceRequest` in arrival order. Traces that publish block hash ids
instead of tokens are expanded to deterministic token ids: block ``b`` of ``B`` tokens becomes
``b * B + [0, B)``, so equal ids give equal tokens and different ids different tokens. Bad input
raises :class:`TraceFormatError` naming the file, line and field.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asynccache.errors import InvalidInputError

MOONCAKE_BLOCK = 512
KVTESTER_BLOCK = 64
_TAIL_BASE = 3 << 30  # token ids of un-hashed tails live above every block-derived id


class TraceFormatError(InvalidInputError):
    """A trace file is malformed (the message names the file, line and field)."""


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


def _field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    val = obj[name]
    if isinstance(val, bool) or not isinstance(val, kind):
        raise TraceFormatError(f"{where}: field {name!r} has bad value {val!r}")
    return val


def _ids(obj: dict[str, Any], name: str, where: str) -> list[int]:
    ids = _field(obj, name, list, where)
    for i, b in enumerate(ids):
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise TraceFormatError(f"{where}: field {name!r}[{i}] has bad value {b!r}")
    return ids


def expand_blocks(ids: list[int], block: int, length: int, where: str = "trace") -> np.ndarray:
    """Token ids for ``length`` tokens covered by block ``ids`` of ``block`` tokens each."""
    if not ids:
        return np.empty(0, dtype=np.uint32)
    arr = np.asarray(ids, dtype=np.uint64)
    if int(arr.max()) * block + block > _TAIL_BASE:
        raise TraceFormatError(
            f"{where}: field 'hash_ids' holds block id {int(arr.max())}, above the largest "
            f"expandable id {_TAIL_BASE // block - 1}"
        )
    toks = (arr[:, None] * np.uint64(block) + np.arange(block, dtype=np.uint64)).reshape(-1)
    return toks[:length].astype(np.uint32)


def _tail_tokens(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 1 << 29, size=n, dtype=np.int64) + _TAIL_BASE).astype(np.uint32)


def _open_lines(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        fh = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc}") from None
    with fh:
        lineno = 0
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceFormatError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
        except UnicodeDecodeError:
            raise TraceFormatError(f"{path}:{lineno + 1}: not UTF-8 text") from None


def read_mooncake(path: str | Path) -> Iterator[TraceRequest]:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    path = Path(path)
    for lineno, obj in _open_lines(path):
        where = f"{path}:{lineno}"
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object")
        ts = _field(obj, "timestamp", (int, float), where)
        n = _field(obj, "input_length", int, where)
        out = _field(obj, "output_length", int, where)
        ids = _ids(obj, "hash_ids", where)
        if n < 0 or out < 0 or ts < 0:
            raise TraceFormatError(f"{where}: negative timestamp or length")
        if len(ids) != -(-n // MOONCAKE_BLOCK):
            raise TraceFormatError(
                f"{where}: field 'hash_ids' has {len(ids)} ids for input_length {n} "
                f"(expected {-(-n // MOONCAKE_BLOCK)})"
            )
        if ts != ts or ts == float("inf"):
            raise TraceFormatError(f"{where}: field 'timestamp' has bad value {ts!r}")
        yield TraceRequest(f"mc-{lineno}", ts / 1000.0,
                           expand_blocks(ids, MOONCAKE_BLOCK, n, where), out)


def read_kvtester(paths: list[str | Path], *, gap_s: float = 0.0) -> Iterator[TraceRequest]:
    """kv-cache-tester conversation files (64-token blocks, ids local to each conversation).

    Each conversation gets its own namespace; conversation ``k`` starts at ``k * gap_s``.
    Sub-agent requests (``type: "subagent"`` with nested ``requests``) are flattened, their times
    taken relative to the sub-agent's start.
    """
    reqs: list[TraceRequest] = []
    for k, p in enumerate(paths):
        path = Path(p)
        try:
            conv = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise TraceFormatError(f"cannot read trace {path}: {exc}") from None
        except UnicodeDecodeError:
            raise TraceFormatError(f"{path}: not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
        if not isinstance(conv, dict):
            raise TraceFormatError(f"{path}: expected a JSON object")
        block = conv.get("block_size", KVTESTER_BLOCK)
        if block != KVTESTER_BLOCK:
            raise TraceFormatError(f"{path}: field 'block_size' has bad value {block!r}")
        ns = str(conv.get("id", path.stem))
        _field(conv, "requests", list, str(path))
        _flatten(conv["requests"], path, "requests", k * gap_s, ns, reqs)
    reqs.sort(key=lambda r: r.arrival)
    return iter(reqs)


def _flatten(items: list[Any], path: Path, where: str, base: float, ns: str,
             out: list[TraceRequest]) -> None:
    for i, r in enumerate(items):
        w = f"{path}: {where}[{i}]"
        if not isinstance(r, dict):
            raise TraceFormatError(f"{w}: expected an object")
        t = _field(r, "t", (int, float), w)
        if t < 0 or t != t:
            raise TraceFormatError(f"{w}: field 't' has bad value {t!r}")
        if r.get("type") == "subagent" and isinstance(r.get("requests"), list):
            _flatten(r["requests"], path, f"{where}[{i}].requests", base + t, ns, out)
            continue
        n = _field(r, "in", int, w)
        ids = _ids(r, "hash_ids", w)
        if len(ids) != n // KVTESTER_BLOCK:
            raise TraceFormatError(
                f"{w}: field 'hash_ids' has {len(ids)} ids for in={n} (expected {n // KVTESTER_BLOCK})"
            )
        toks = expand_blocks(ids, KVTESTER_BLOCK, len(ids) * KVTESTER_BLOCK, w)
        tail = n - len(toks)
        if tail:
            seed = zlib.crc32(f"{ns}/{where}[{i}]".encode())
            toks = np.concatenate([toks, _tail_tokens(seed, tail)])
        out.append(TraceRequest(f"{ns}/{where}[{i}]", base + float(t), toks,
                                int(r.get("out", 0) or 0), ns))


def read_tokens(path: str | Path) -> Iterator[TraceRequest]:
    """Our token-level JSONL: ``{"t": seconds, "tokens": [ids], "output_len": n, "namespace": s}``.

    ``t`` defaults to 0 (file order), ``output_len`` to 0, ``namespace`` to none.
    """
    path = Path(path)
    for lineno, obj in _open_lines(path):
        where = f"{path}:{lineno}"
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object")
        toks = _ids(obj, "tokens", where)
        if any(t > 0xFFFFFFFF for t in toks):
            raise TraceFormatError(f"{where}: field 'tokens' holds an id above 2**32-1")
        t = obj.get("t", 0)
        if isinstance(t, bool) or not isinstance(t, int | float) or t < 0:
            raise TraceFormatError(f"{where}: field 't' has bad value {t!r}")
        out = obj.get("output_len", 0)
        if isinstance(out, bool) or not isinstance(out, int) or out < 0:
            raise TraceFormatError(f"{where}: field 'output_len' has bad value {out!r}")
        ns = obj.get("namespace")
        if ns is not None and not isinstance(ns, str):
            raise TraceFormatError(f"{where}: field 'namespace' has bad value {ns!r}")
        yield TraceRequest(f"tok-{lineno}", float(t), np.asarray(toks, dtype=np.uint32), out, ns)


def detect_format(path: str | Path) -> str:
    """``mooncake`` / ``kvtester`` / ``tokens`` from a file's first record."""
    p = Path(path)
    if p.suffix == ".json":
        return "kvtester"
    for _, obj in _open_lines(p):
        if isinstance(obj, dict) and "hash_ids" in obj:
            return "mooncake"
        if isinstance(obj, dict) and "tokens" in obj:
            return "tokens"
        break
    raise TraceFormatError(f"{p}: cannot tell the trace format (no 'hash_ids' or 'tokens' field)")
