"""Traces are read as streams: compressed files and tar archives directly, one request expanded
at a time, kv-cache-tester conversations parsed only when the merge reaches them, so memory does
not grow with the trace and ``--limit`` bounds the work."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import lzma
import tarfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from asynccache.cli import main
from asynccache.replay.formats import TraceFormatError, read_kvtester, read_mooncake, read_tokens
from asynccache.replay.load import TraceSpec


def _conversation(k: int, turns: int = 6, blocks: int = 40) -> dict:
    """An agentic conversation: every turn extends the previous prompt."""
    reqs, ids = [], list(range(k * 10_000, k * 10_000 + blocks))
    for t in range(turns):
        ids = ids + [k * 10_000 + 5_000 + t * 10 + j for j in range(5)]
        reqs.append({"t": float(t), "type": "n", "in": 64 * len(ids) + 7, "out": 3,
                     "hash_ids": list(ids)})
    return {"id": f"conv-{k}", "block_size": 64, "requests": reqs}


def _archive(path: Path, convs: list[dict], mode: str = "w:xz") -> Path:
    with tarfile.open(path, mode) as tf:
        for c in convs:
            data = json.dumps(c).encode()
            info = tarfile.TarInfo(f"traces/{c['id']}.json")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _files(tmp: Path, convs: list[dict]) -> list[Path]:
    out = []
    for c in convs:
        p = tmp / f"{c['id']}.json"
        p.write_text(json.dumps(c))
        out.append(p)
    return out


@pytest.mark.parametrize("mode", ["w:xz", "w:gz", "w"])
def test_an_archive_reads_like_its_files(tmp_path, mode) -> None:
    convs = [_conversation(k) for k in range(4)]
    ext = {"w:xz": ".tar.xz", "w:gz": ".tar.gz", "w": ".tar"}[mode]
    archive = _archive(tmp_path / f"t{ext}", convs, mode)
    files = _files(tmp_path, convs)
    a = list(read_kvtester([archive], gap_s=0.5))
    b = list(read_kvtester(files, gap_s=0.5))
    assert [(r.namespace, r.arrival, r.output_len) for r in a] == \
        [(r.namespace, r.arrival, r.output_len) for r in b]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
    assert len(a) == 24 and a[0].rid.startswith("conv-0/")


def test_compressed_mooncake_lines_read_directly(tmp_path, mooncake_conversation) -> None:
    raw = mooncake_conversation.read_bytes()
    lines = raw.splitlines(keepends=True)[:50]
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join(lines)))
    xz = tmp_path / "c.jsonl.xz"
    xz.write_bytes(lzma.compress(b"".join(lines)))
    plain = list(itertools.islice(read_mooncake(mooncake_conversation), 50))
    for p in (gz, xz):
        got = list(read_mooncake(p))
        assert [r.rid for r in got] == [r.rid for r in plain]
        assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(got, plain, strict=True))
        assert TraceSpec(str(p)).fmt == "mooncake"


def test_a_broken_archive_names_itself(tmp_path) -> None:
    p = tmp_path / "t.tar.xz"
    p.write_bytes(b"not an archive")
    with pytest.raises(TraceFormatError, match=r"cannot read trace archive .*t\.tar\.xz"):
        list(read_kvtester([p]))
    gz = tmp_path / "c.jsonl.gz"
    data = gzip.compress(b"".join(b'{"tokens": [%d]}\n' % i for i in range(20_000)))
    gz.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(TraceFormatError, match=r"cannot read trace .*c\.jsonl\.gz after line"):
        list(read_tokens(gz))


def test_conversations_open_only_when_the_merge_reaches_them(tmp_path) -> None:
    convs = [_conversation(k) for k in range(50)]
    archive = _archive(tmp_path / "t.tar.xz", convs)
    opened: list[int] = []
    it = read_kvtester([archive], gap_s=100.0, on_open=lambda k, n, f: opened.append(k))
    first = list(itertools.islice(it, 8))  # conversation 0 (6 turns), then 1
    assert [r.namespace for r in first] == ["conv-0"] * 6 + ["conv-1"] * 2
    assert max(opened) <= 3  # not the 50 conversations of the archive
    # With every conversation starting at once, all of them are parsed before the first one.
    opened.clear()
    next(read_kvtester([archive], gap_s=0.0, on_open=lambda k, n, f: opened.append(k)))
    assert max(opened) == 50


def test_memory_is_flat_in_trace_length(tmp_path) -> None:
    """Reading a trace holds one expanded request at a time plus compact conversations: the
    peak while reading 40 long conversations stays far below their expanded size."""
    convs = [_conversation(k, turns=30, blocks=400) for k in range(40)]
    files = _files(tmp_path, convs)
    expanded = sum(r["in"] for c in convs for r in c["requests"]) * 4  # uint32 tokens
    tracemalloc.start()
    try:
        n = longest = 0
        for r in read_kvtester(files, gap_s=0.0):
            n += 1
            longest = max(longest, len(r))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 40 * 30
    assert peak < expanded / 20, (peak, expanded)
    assert peak < 40 * longest * 4  # not one expanded request per conversation


def test_limit_bounds_what_a_replay_reads(tmp_path, capsys) -> None:
    convs = [_conversation(k) for k in range(30)]
    archive = _archive(tmp_path / "t.tar.xz", convs)
    assert main(["replay", str(archive), "--page-size", "64", "--limit", "5",
                 "--conversation-gap", "1000", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["requests"] == rep["completed"] == 5
    assert TraceSpec(str(archive), gap_s=1000.0).survey(5) == (5, 64 * (40 + 5 * 5) + 7)  # turn 5 of conversation 0


def test_the_archive_replays_from_the_command_line(tmp_path, capsys) -> None:
    convs = [_conversation(k) for k in range(3)]
    archive = _archive(tmp_path / "t.tar.xz", convs)
    assert main(["replay", str(archive), "--page-size", "64", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["completed"] == 18 and rep["rejected"] == 0
    assert rep["hit_rate"]["total_tokens"] > 0.5  # every turn extends the previous one
