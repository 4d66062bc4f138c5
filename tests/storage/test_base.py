"""Layout tags, key validation, buffer handling and the page format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asynccache.errors import ConfigError, CorruptObjectError, InvalidInputError
from asynccache.storage.base import StorageLayout, check_batch, validate_keys, writable_view
from asynccache.storage.pageformat import HEADER_SIZE, encode_header, parse_header, verify_payload

KEY = "ab" * 32


def test_layout_tags_differ_for_everything_that_changes_bytes() -> None:
    base = StorageLayout(model="org/model", page_size=16)
    variants = [
        StorageLayout(model="org-model", page_size=16),  # same slug, different model
        StorageLayout(model="org/model", page_size=32),
        StorageLayout(model="org/model", page_size=16, kv_dtype="float8_e4m3fn"),
        StorageLayout(model="org/model", page_size=16, kv_layout="page_first"),
        StorageLayout(model="org/model", page_size=16, tp_rank=1, tp_size=2),
        StorageLayout(model="org/model", page_size=16, tp_rank=0, tp_size=2),
        StorageLayout(model="org/model", page_size=16, pp_rank=1, pp_size=2),
        StorageLayout(model="org/model", page_size=16, extra="int4-awq"),
    ]
    tags = {base.tag, *(v.tag for v in variants)}
    assert len(tags) == 1 + len(variants)
    assert base.tag.startswith("org-model_p16_bfloat16_layer_first_tp0of1_")
    assert base.object_name(KEY) == f"{KEY}.{base.tag}.kv"


def test_replicated_kv_omits_tp_rank_so_ranks_share_objects() -> None:
    r0 = StorageLayout(model="m", page_size=1, tp_rank=0, tp_size=4, kv_replicated=True)
    r3 = StorageLayout(model="m", page_size=1, tp_rank=3, tp_size=4, kv_replicated=True)
    assert r0.tag == r3.tag
    assert "tp" not in r0.tag.split("_")[-2]
    s0 = StorageLayout(model="m", page_size=1, tp_rank=0, tp_size=4)
    assert s0.tag != r0.tag


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model": "", "page_size": 1}, "model"),
        ({"model": "m", "page_size": 0}, "page_size"),
        ({"model": "m", "page_size": 1, "tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"model": "m", "page_size": 1, "kv_dtype": "bf 16"}, "kv_dtype"),
        ({"model": "m", "page_size": 1, "pp_size": 0}, "pp_size"),
    ],
)
def test_layout_rejects_bad_fields_naming_them(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        StorageLayout(**kwargs)


def test_validate_keys_names_the_bad_key() -> None:
    good = ["0" * 64, "f" * 64 + ".mamba"]
    assert validate_keys(good) == good
    for bad in ["A" * 64, "0" * 63, "g" * 64, "0" * 64 + ".", "../" + "0" * 61, 5]:
        with pytest.raises(InvalidInputError, match=r"keys\[1\]"):
            validate_keys([good[0], bad])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="single"):
        validate_keys("0" * 64)


def test_buffers_of_every_kind_are_flat_byte_views() -> None:
    t = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
    v = writable_view(t)
    assert v.nbytes == 16 and v.format == "B"
    v[0] ^= 0xFF  # writes through to the tensor's storage
    assert t.view(torch.uint8).reshape(-1)[0].item() == v[0]
    assert writable_view(np.zeros((4, 4), dtype=np.float32)).nbytes == 64
    assert writable_view(bytearray(3)).nbytes == 3
    with pytest.raises(InvalidInputError, match="read-only"):
        writable_view(b"abc")
    with pytest.raises(InvalidInputError, match="contiguous"):
        writable_view(torch.zeros(4, 4).t())
    with pytest.raises(InvalidInputError, match="buffer protocol"):
        writable_view([1, 2, 3])


def test_check_batch_validates_lengths_and_empty_pages() -> None:
    with pytest.raises(InvalidInputError, match="2 keys but 1 buffers"):
        check_batch([KEY, KEY], [bytearray(1)], writable=True)
    with pytest.raises(InvalidInputError, match=r"buffers\[0\] is empty"):
        check_batch([KEY], [bytearray()], writable=False)


def test_page_format_round_trip_and_every_corruption() -> None:
    payload = bytes(range(256)) * 4
    name = StorageLayout(model="m", page_size=1).object_name(KEY)
    header = encode_header(name, payload)
    assert len(header) == HEADER_SIZE
    info = parse_header(header, name)
    assert info.payload_len == len(payload)
    verify_payload(info, memoryview(payload), name)

    def reason(blob: bytes, obj_name: str = name) -> str:
        with pytest.raises(CorruptObjectError) as exc:
            info = parse_header(blob[:HEADER_SIZE], obj_name)
            verify_payload(info, memoryview(blob)[HEADER_SIZE:], obj_name)
        return exc.value.reason  # type: ignore[attr-defined]

    blob = header + payload
    assert reason(blob[:10]) == "partial"
    assert reason(blob[:-1]) == "partial"
    assert reason(b"XXXX" + blob[4:]) == "bad_magic"
    flipped_len = bytearray(blob)
    flipped_len[13] ^= 1
    assert reason(bytes(flipped_len)) == "header_checksum"
    flipped_payload = bytearray(blob)
    flipped_payload[HEADER_SIZE + 100] ^= 1
    assert reason(bytes(flipped_payload)) == "checksum"
    other = StorageLayout(model="m", page_size=2).object_name(KEY)
    assert reason(blob, other) == "name_mismatch"


@pytest.mark.parametrize("call", ["keys", "batch_keys", "batch_buffers"])
def test_none_instead_of_a_sequence_names_the_argument(call: str) -> None:
    key = "a" * 64
    with pytest.raises(InvalidInputError, match="keys" if call != "batch_buffers" else "buffers"):
        if call == "keys":
            validate_keys(None)  # type: ignore[arg-type]
        elif call == "batch_keys":
            check_batch(None, [bytearray(4)], writable=False)  # type: ignore[arg-type]
        else:
            check_batch([key], None, writable=False)  # type: ignore[arg-type]
