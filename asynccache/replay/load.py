"""Which trace a replay reads, opened as many times as needed (a survey, then each replay of a
sweep or a cluster comparison), always as a stream."""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from asynccache.errors import ConfigError
from asynccache.logs import get_logger
from asynccache.replay.formats import (
    TraceFormatError,
    TraceRequest,
    detect_format,
    read_kvtester,
    read_mooncake,
    read_tokens,
)
from asynccache.replay.sources import STREAM_ERRORS, is_archive, open_binary

_log = get_logger("replay")
FORMATS = ("auto", "mooncake", "kvtester", "tokens")
_SHOWN_BAD_RECORDS = 5


@dataclass
class TraceSpec:
    """A trace: ``path`` (a file, a glob of kv-cache-tester files, an archive) or None for the
    synthetic workload."""

    path: str | None = None
    fmt: str = "auto"
    gap_s: float = 0.0  # kv-cache-tester: seconds between conversation starts
    seed: int = 0  # the synthetic workload's
    skip_bad: bool = False  # skip malformed records (counted) instead of stopping
    skipped: int = 0  # malformed records skipped by the last open()
    paths: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ConfigError(f"unknown trace format {self.fmt!r}; choose one of {list(FORMATS)}")
        if self.path in (None, "synthetic"):
            self.path = None
            return
        matches = sorted(glob.glob(self.path)) if glob.has_magic(self.path) else []
        if glob.has_magic(self.path) and not matches:
            raise TraceFormatError(f"cannot read trace {self.path!r}: no file matches it")
        self.paths = matches or [self.path]
        if self.fmt == "auto":
            self.fmt = detect_format(self.paths[0])
        if self.fmt != "kvtester" and len(self.paths) != 1:
            raise ConfigError(
                f"{self.fmt} traces are one file; {self.path!r} matches {len(self.paths)}")
        if self.fmt != "kvtester" and is_archive(self.paths[0]):
            raise ConfigError(
                f"{self.paths[0]}: tar archives hold kv-cache-tester conversations; a {self.fmt} "
                "trace is one (optionally .gz / .xz / .bz2 compressed) file")

    @property
    def name(self) -> str:
        return "synthetic" if self.path is None else self.path

    def _on_error(self, err: TraceFormatError) -> None:
        self.skipped += 1
        if self.skipped <= _SHOWN_BAD_RECORDS:
            _log.warning("trace_record_skipped", error=str(err))
        elif self.skipped == _SHOWN_BAD_RECORDS + 1:
            _log.warning("trace_records_skipped", note="more malformed records are skipped "
                         "without a message; the report counts them")

    def open(self, on_open: Callable[[int, int, float], None] | None = None,
             ) -> Iterator[TraceRequest]:
        """A fresh iterator over the trace's requests."""
        self.skipped = 0
        if self.path is None:
            from asynccache.replay.synthetic import SyntheticSpec, synthetic_trace

            return synthetic_trace(SyntheticSpec(seed=self.seed))
        on_error = self._on_error if self.skip_bad else None
        if self.fmt == "kvtester":
            return read_kvtester(self.paths, gap_s=self.gap_s, on_error=on_error,
                                 on_open=on_open)
        reader = read_mooncake if self.fmt == "mooncake" else read_tokens
        return reader(self.paths[0], on_error=on_error)

    def survey(self, limit: int | None,
               on_open: Callable[[int, int, float], None] | None = None) -> tuple[int, int]:
        """``(requests, longest prompt)`` over the first ``limit`` requests, without expanding
        tokens (malformed records are passed over here; the replay itself reports them)."""
        count = longest = 0
        for n in self._lengths(on_open):
            if limit is not None and count >= limit:
                break
            count += 1
            longest = max(longest, n)
        return count, longest

    def _lengths(self, on_open: Callable[[int, int, float], None] | None) -> Iterator[int]:
        if self.path is None:
            from asynccache.replay.synthetic import SyntheticSpec, synthetic_trace

            return (len(r) for r in synthetic_trace(SyntheticSpec(seed=self.seed)))
        if self.fmt == "kvtester":
            from asynccache.replay.kvtester import conversation_lengths

            return conversation_lengths(self.paths, gap_s=self.gap_s, on_open=on_open)
        return _line_lengths(self.paths[0], "input_length" if self.fmt == "mooncake" else None)


def _line_lengths(path: str | Path, key: str | None) -> Iterator[int]:
    """Prompt length of each well-formed line (``key``'s value, or the length of ``tokens``)."""
    with open_binary(path) as fh:
        try:
            for raw in fh:
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except (ValueError, UnicodeDecodeError):
                    continue
                if not isinstance(obj, dict):
                    continue
                val = obj.get(key) if key else obj.get("tokens")
                if key and isinstance(val, int) and not isinstance(val, bool) and val >= 0:
                    yield val
                elif not key and isinstance(val, list):
                    yield len(val)
        except STREAM_ERRORS as exc:
            raise TraceFormatError(f"cannot read trace {path}: {exc}") from None
