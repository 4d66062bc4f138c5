"""Trace parsers: good input gives exact requests, bad input names the file, line and field."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from asynccache.errors import InvalidInputError
from asynccache.replay.formats import (
    TraceFormatError,
    detect_format,
    read_kvtester,
    read_mooncake,
    read_tokens,
)


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _block(b: int, size: int) -> list[int]:
    return list(range(b * size, b * size + size))


# -- Mooncake -------------------------------------------------------------------------------------


def test_mooncake_good_lines_expand_blocks_exactly(tmp_path) -> None:
    p = _write(tmp_path / "m.jsonl", [
        {"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [3, 9]},
        "",
        {"timestamp": 1500, "input_length": 1024, "output_length": 0, "hash_ids": [3, 4]},
        {"timestamp": 2001.5, "input_length": 1, "output_length": 2, "hash_ids": [9]},
        {"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []},
    ])
    reqs = list(read_mooncake(p))
    assert [r.rid for r in reqs] == ["mc-1", "mc-3", "mc-4", "mc-5"]  # numbered by file line
    assert [r.arrival for r in reqs] == [1.5, 1.5, 2.0015, 0.0]
    assert [r.output_len for r in reqs] == [7, 0, 2, 1]
    assert [r.namespace for r in reqs] == [None] * 4
    assert reqs[0].tokens.dtype == np.uint32
    assert reqs[0].tokens.tolist() == _block(3, 512) + _block(9, 512)[:88]
    assert reqs[1].tokens.tolist() == _block(3, 512) + _block(4, 512)
    assert reqs[2].tokens.tolist() == [9 * 512]
    assert len(reqs[3]) == 0
    # Equal ids at a position give equal tokens, so the first blocks are a shared prefix.
    assert np.array_equal(reqs[0].tokens[:512], reqs[1].tokens[:512])


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ({"input_length": 1, "output_length": 1, "hash_ids": [1]}, "'timestamp'"),
        ({"timestamp": "0", "input_length": 1, "output_length": 1, "hash_ids": [1]}, "'timestamp'"),
        ({"timestamp": 0, "output_length": 1, "hash_ids": [1]}, "'input_length'"),
        ({"timestamp": 0, "input_length": 1.0, "output_length": 1, "hash_ids": [1]}, "'input_length'"),
        ({"timestamp": 0, "input_length": True, "output_length": 1, "hash_ids": [1]}, "'input_length'"),
        ({"timestamp": 0, "input_length": 1, "output_length": "1", "hash_ids": [1]}, "'output_length'"),
        ({"timestamp": 0, "input_length": 1, "output_length": 1}, "'hash_ids'"),
        ({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": 1}, "'hash_ids'"),
        ({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [-1]}, "'hash_ids'[0]"),
        ({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, "2"]}, "'hash_ids'"),
        ({"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}, "'hash_ids' has 1 ids"),
        ({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]}, "'hash_ids' has 2 ids"),
        ({"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}, "negative"),
        ([1, 2, 3], "expected a JSON object"),
        ("{not json", "invalid JSON"),
    ],
)
def test_mooncake_bad_line_names_line_and_field(tmp_path, line, field) -> None:
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}
    p = _write(tmp_path / "bad.jsonl", [good, good, line])
    with pytest.raises(TraceFormatError) as err:
        list(read_mooncake(p))
    assert f"{p}:3" in str(err.value)
    assert field in str(err.value)
    assert isinstance(err.value, InvalidInputError)


def test_mooncake_too_large_block_id_names_the_line(tmp_path) -> None:
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}
    p = _write(tmp_path / "big.jsonl", [good, {"timestamp": 0, "input_length": 10,
                                               "output_length": 1, "hash_ids": [7_000_000]}])
    with pytest.raises(TraceFormatError, match=rf"{p}:2.*hash_ids"):
        list(read_mooncake(p))


@pytest.mark.parametrize("fmt", ["mooncake", "tokens", "kvtester"])
def test_non_utf8_trace_is_a_format_error(tmp_path, fmt) -> None:
    good = {"mooncake": b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
            "tokens": b'{"tokens": [1, 2]}'}
    if fmt == "kvtester":
        p = tmp_path / "c.json"
        p.write_bytes(b'{"id": "c", "requests": [], "note": "\xff"}')
    else:
        p = tmp_path / "t.jsonl"
        p.write_bytes(good[fmt] + b"\n\xff\xfe\n")
    with pytest.raises(TraceFormatError, match=str(p)):
        if fmt == "kvtester":
            list(read_kvtester([p]))
        else:
            list(read_mooncake(p) if fmt == "mooncake" else read_tokens(p))


def test_missing_file_is_a_format_error(tmp_path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        list(read_mooncake(tmp_path / "absent.jsonl"))
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        list(read_kvtester([tmp_path / "absent.json"]))


def test_real_mooncake_lines_parse(mooncake_conversation) -> None:
    with mooncake_conversation.open() as f:
        raw = [json.loads(line) for line in itertools.islice(f, 300)]
    reqs = list(itertools.islice(read_mooncake(mooncake_conversation), 300))
    for obj, r in zip(raw, reqs, strict=True):
        assert len(r) == obj["input_length"]
        assert r.arrival == obj["timestamp"] / 1000
        ids = obj["hash_ids"]
        assert r.tokens[::512].tolist() == [b * 512 for b in ids]


# -- kv-cache-tester ----------------------------------------------------------------------------


def _conversation() -> dict:
    return {
        "id": "conv-a",
        "models": ["m"],
        "block_size": 64,
        "hash_id_scope": "local",
        "requests": [
            {"t": 0.0, "type": "n", "in": 130, "out": 5, "hash_ids": [1, 2]},
            {"t": 10.0, "type": "subagent", "agent_id": "agent_001", "requests": [
                {"t": 0.0, "type": "n", "in": 64, "out": 3, "hash_ids": [7]},
                {"t": 2.5, "type": "n", "in": 192, "out": 0, "hash_ids": [7, 8, 9]},
                {"t": 4.0, "type": "subagent", "requests": [
                    {"t": 1.0, "type": "n", "in": 70, "hash_ids": [11]},
                ]},
            ]},
            {"t": 11.0, "type": "n", "in": 256, "out": 9, "hash_ids": [1, 2, 3, 4]},
        ],
    }


def test_kvtester_flattens_sub_agents_exactly(tmp_path) -> None:
    p = tmp_path / "conv.json"
    p.write_text(json.dumps(_conversation()))
    reqs = list(read_kvtester([p]))
    by_rid = {r.rid: r for r in reqs}
    # Sub-agent times count from the sub-agent's start; the result is sorted by arrival.
    assert [(r.rid, r.arrival) for r in reqs] == [
        ("conv-a/requests[0]", 0.0),
        ("conv-a/requests[1].requests[0]", 10.0),
        ("conv-a/requests[2]", 11.0),
        ("conv-a/requests[1].requests[1]", 12.5),
        ("conv-a/requests[1].requests[2].requests[0]", 15.0),
    ]
    assert all(r.namespace == "conv-a" for r in reqs)
    assert [r.output_len for r in reqs] == [5, 3, 9, 0, 0]
    first = by_rid["conv-a/requests[0]"].tokens
    assert len(first) == 130
    assert first[:128].tolist() == _block(1, 64) + _block(2, 64)
    assert (first[128:] >= 3 << 30).all()  # the un-hashed tail: ids no block can produce
    assert by_rid["conv-a/requests[1].requests[1]"].tokens.tolist() == (
        _block(7, 64) + _block(8, 64) + _block(9, 64))
    assert by_rid["conv-a/requests[2]"].tokens.tolist() == [
        t for b in (1, 2, 3, 4) for t in _block(b, 64)]
    nested = by_rid["conv-a/requests[1].requests[2].requests[0]"].tokens
    assert nested[:64].tolist() == _block(11, 64) and len(nested) == 70
    # Deterministic: parsing again gives the same tails.
    again = {r.rid: r for r in read_kvtester([p])}
    assert all(np.array_equal(again[k].tokens, v.tokens) for k, v in by_rid.items())


def test_kvtester_conversations_get_namespaces_and_gaps(tmp_path) -> None:
    a, b = _conversation(), _conversation()
    b["id"] = "conv-b"
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    reqs = list(read_kvtester([pa, pb], gap_s=100.0))
    assert [r.namespace for r in reqs] == ["conv-a"] * 5 + ["conv-b"] * 5
    assert [r.arrival for r in reqs[5:]] == [100.0, 110.0, 111.0, 112.5, 115.0]
    mixed = list(read_kvtester([pa, pb], gap_s=0.5))  # interleaved by arrival time
    assert [(r.namespace, r.arrival) for r in mixed[:4]] == [
        ("conv-a", 0.0), ("conv-b", 0.5), ("conv-a", 10.0), ("conv-b", 10.5)]
    # Without an id the file name is the namespace.
    del a["id"]
    pc = tmp_path / "trace_0042.json"
    pc.write_text(json.dumps(a))
    assert {r.namespace for r in read_kvtester([pc])} == {"trace_0042"}


@pytest.mark.parametrize(
    ("mutate", "named"),
    [
        (lambda c: c.update(block_size=16), "'block_size'"),
        (lambda c: c.pop("requests"), "'requests'"),
        (lambda c: c["requests"][0].update(hash_ids=[1]), "requests[0]: field 'hash_ids' has 1 ids"),
        (lambda c: c["requests"][0].pop("in"), "requests[0]: missing field 'in'"),
        (lambda c: c["requests"][0].update(t="soon"), "requests[0]: field 't'"),
        (lambda c: c["requests"][1]["requests"][1].update(hash_ids=[7, "8", 9]),
         "requests[1].requests[1]: field 'hash_ids'[1]"),
        (lambda c: c["requests"][1]["requests"][2]["requests"][0].update(**{"in": -3}),
         "requests[1].requests[2].requests[0]"),
        (lambda c: c["requests"].append(5), "requests[3]: expected an object"),
    ],
)
def test_kvtester_bad_input_names_the_request_and_field(tmp_path, mutate, named) -> None:
    conv = _conversation()
    mutate(conv)
    p = tmp_path / "conv.json"
    p.write_text(json.dumps(conv))
    with pytest.raises(TraceFormatError) as err:
        list(read_kvtester([p]))
    assert str(p) in str(err.value)
    assert named in str(err.value)


def test_kvtester_invalid_json_names_the_line(tmp_path) -> None:
    p = tmp_path / "conv.json"
    p.write_text('{"id": "x",\n "requests": [\n {"t": 0,, }]}')
    with pytest.raises(TraceFormatError, match=rf"{p}: invalid JSON at line 3"):
        list(read_kvtester([p]))


def test_real_kvtester_samples_parse(kvtester_samples) -> None:
    for p in kvtester_samples:
        conv = json.loads(p.read_text())
        reqs = list(read_kvtester([p]))
        assert len(reqs) == len(conv["requests"])  # the samples have no sub-agents
        for raw, r in zip(sorted(conv["requests"], key=lambda x: x["t"]), reqs, strict=True):
            assert len(r) == raw["in"] and r.namespace == conv["id"]
            assert r.tokens[: 64 * len(raw["hash_ids"]) : 64].tolist() == [
                b * 64 for b in raw["hash_ids"]]


# -- token JSONL --------------------------------------------------------------------------------


def test_tokens_jsonl_good(tmp_path) -> None:
    p = _write(tmp_path / "t.jsonl", [
        {"tokens": [1, 2, 3]},
        {"t": 0.5, "tokens": [4294967295, 0], "output_len": 20, "namespace": "tenant-a"},
        {"t": 2, "tokens": []},
    ])
    reqs = list(read_tokens(p))
    assert [r.rid for r in reqs] == ["tok-1", "tok-2", "tok-3"]
    assert [r.arrival for r in reqs] == [0.0, 0.5, 2.0]
    assert [r.tokens.tolist() for r in reqs] == [[1, 2, 3], [4294967295, 0], []]
    assert [r.output_len for r in reqs] == [0, 20, 0]
    assert [r.namespace for r in reqs] == [None, "tenant-a", None]


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ({"t": 0}, "missing field 'tokens'"),
        ({"tokens": "1 2 3"}, "'tokens'"),
        ({"tokens": [1, -2]}, "'tokens'[1]"),
        ({"tokens": [1, 2.0]}, "'tokens'[1]"),
        ({"tokens": [1, True]}, "'tokens'[1]"),
        ({"tokens": [4294967296]}, "'tokens'"),
        ({"tokens": [1], "t": -1}, "'t'"),
        ({"tokens": [1], "t": "0"}, "'t'"),
        ({"tokens": [1], "output_len": -1}, "'output_len'"),
        ({"tokens": [1], "output_len": False}, "'output_len'"),
        ({"tokens": [1], "namespace": 5}, "'namespace'"),
        ("[1, 2]", "expected a JSON object"),
        ('{"tokens": [1,', "invalid JSON"),
    ],
)
def test_tokens_jsonl_bad_line_names_line_and_field(tmp_path, line, field) -> None:
    p = _write(tmp_path / "t.jsonl", [{"tokens": [1]}, line])
    with pytest.raises(TraceFormatError) as err:
        list(read_tokens(p))
    assert f"{p}:2" in str(err.value)
    assert field in str(err.value)


# -- detection ----------------------------------------------------------------------------------


def test_detect_format(tmp_path) -> None:
    mc = _write(tmp_path / "a.jsonl", [
        "", {"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}])
    tok = _write(tmp_path / "b.jsonl", [{"tokens": [1]}])
    conv = tmp_path / "c.json"
    conv.write_text(json.dumps(_conversation()))
    assert detect_format(mc) == "mooncake"
    assert detect_format(tok) == "tokens"
    assert detect_format(conv) == "kvtester"
    for name, lines in (("d.jsonl", [{"prompt": "hi"}]), ("e.jsonl", []), ("f.txt", ["[1]"])):
        p = _write(tmp_path / name, lines)
        with pytest.raises(TraceFormatError, match="cannot tell the trace format"):
            detect_format(p)
    bad = _write(tmp_path / "g.jsonl", ["{oops"])
    with pytest.raises(TraceFormatError, match=rf"{bad}:1: invalid JSON"):
        detect_format(bad)


def test_detect_format_of_the_real_traces(mooncake_conversation, kvtester_samples) -> None:
    assert detect_format(mooncake_conversation) == "mooncake"
    assert {detect_format(p) for p in kvtester_samples} == {"kvtester"}
