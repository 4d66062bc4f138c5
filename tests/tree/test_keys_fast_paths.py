"""The one-pass key paths (array typecodes, contiguous numpy and torch integers) against a
plain reference: struct-packed uint32 ids, and the bad id named exactly as the general path
names it."""

from __future__ import annotations

import struct
from array import array

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asynccache.errors import InvalidInputError
from asynccache.tree.keys import DEFAULT_NAMESPACE, BigramKey, Namespace, RadixKey

MAX = 2**32 - 1


def _want(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def _bounds(code: str) -> tuple[int, int]:
    bits = array(code).itemsize * 8
    if code.isupper():
        return 0, 2**bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def _bad_message(tokens: list[int]) -> str | None:
    for pos, t in enumerate(tokens):
        if not 0 <= t <= MAX:
            return f"token id {t} at position {pos} is outside [0, {MAX}]"
    return None


CODES = "bBhHiIlLqQ"


@given(st.data())
def test_every_array_typecode_matches_the_reference(data) -> None:
    code = data.draw(st.sampled_from(CODES))
    lo, hi = _bounds(code)
    edges = [v for v in (lo, -1, 0, 1, MAX, MAX + 1, hi) if lo <= v <= hi]
    tokens = data.draw(st.lists(st.one_of(st.sampled_from(edges), st.integers(lo, hi)),
                                max_size=40))
    bad = _bad_message(tokens)
    for form in (array(code, tokens), np.array(tokens, dtype=np.dtype(code))):
        if bad is None:
            assert RadixKey(form).data == _want(tokens)
        else:
            with pytest.raises(InvalidInputError) as err:
                RadixKey(form)
            assert str(err.value) == bad


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_torch_tensors_take_the_same_paths(dtype) -> None:
    tokens = [0, 1, 200, 7, 0, 127]
    assert RadixKey(torch.tensor(tokens, dtype=dtype)).data == _want(tokens)


def test_wide_ids_out_of_range_are_named() -> None:
    with pytest.raises(InvalidInputError, match=r"token id 4294967296 at position 2 "):
        RadixKey(array("q", [0, MAX, MAX + 1]))
    with pytest.raises(InvalidInputError, match=r"token id -1 at position 1 "):
        RadixKey(array("q", [5, -1]))
    with pytest.raises(InvalidInputError, match=r"token id -9223372036854775808 at position 0 "):
        RadixKey(array("q", [-(2**63)]))
    with pytest.raises(InvalidInputError, match=r"token id 18446744073709551615 at position 1 "):
        RadixKey(array("Q", [3, 2**64 - 1]))
    with pytest.raises(InvalidInputError, match=r"token id -2147483648 at position 0 "):
        RadixKey(array("i", [-(2**31), 4]))
    with pytest.raises(InvalidInputError, match=r"token id -2 at position 0 "):
        RadixKey(torch.tensor([-2, 1]))


def test_non_native_and_strided_numpy_arrays() -> None:
    tokens = [1, 2, 65536, MAX, 0]
    for dtype in (">i8", ">u4", "<i8", "<u4"):
        assert RadixKey(np.array(tokens, dtype=dtype)).data == _want(tokens), dtype
    assert RadixKey(np.array(tokens[:3], dtype=">i4")).data == _want(tokens[:3])
    wide = np.array([[t, -1] for t in tokens], dtype=np.int64)
    assert RadixKey(wide[:, 0]).data == _want(tokens)  # strided: not contiguous
    assert RadixKey(np.array(tokens, dtype=np.int64)[::-1]).data == _want(tokens[::-1])
    with pytest.raises(InvalidInputError, match=r"token id -1 at position 0 "):
        RadixKey(wide[:, 1])
    with pytest.raises(InvalidInputError, match="one-dimensional"):
        RadixKey(np.zeros((2, 3), dtype=np.int64))


def test_empty_arrays_give_empty_keys() -> None:
    for code in CODES:
        assert RadixKey(array(code)).data == b""
    assert RadixKey(np.empty(0, dtype=np.int64)).data == b""
    assert BigramKey(array("q")).data == b""


def test_the_key_never_aliases_the_callers_buffer() -> None:
    for code in ("q", "I", "i"):
        src = array(code, [1, 2, 3])
        key = RadixKey(src)
        src[0] = 9
        assert key.tokens == [1, 2, 3], code
    arr = np.array([4, 5], dtype=np.uint32)
    key = RadixKey(arr)
    arr[0] = 7
    assert key.tokens == [4, 5]


def test_namespaces_and_bigrams_from_fast_paths() -> None:
    tokens = [3, 1, 4, 1, 5]
    assert RadixKey(array("q", tokens)).namespace is DEFAULT_NAMESPACE
    key = RadixKey(array("q", tokens), "lora", "salt")
    assert key.namespace is Namespace("lora", "salt")
    ns = Namespace(None, "s")
    assert RadixKey(array("q", tokens), namespace=ns).namespace is ns
    with pytest.raises(InvalidInputError, match="not both"):
        RadixKey(array("q", tokens), "lora", namespace=ns)
    big = BigramKey(array("q", tokens))
    assert big.pairs == [(3, 1), (1, 4), (4, 1), (1, 5)]
    assert big.data == BigramKey(tokens).data


# A list's ids take array.fromlist, a tuple's the array constructor: both must give the bytes
# and name the bad value exactly as the element-by-element path does.
_LIST_ITEMS = st.one_of(
    st.integers(0, MAX),
    st.sampled_from([-1, MAX + 1, 2**64, -(2**63), True, False, 2.0, "3", None]),
    st.integers(0, MAX).map(np.int64),
    st.integers(0, 2**16 - 1).map(np.uint16),
    st.sampled_from([np.int64(-1), np.uint64(MAX + 1)]),
)


@given(st.lists(_LIST_ITEMS, max_size=30))
def test_list_and_tuple_keys_match_the_element_by_element_path(items) -> None:
    from asynccache.tree.keys import _encode_slow

    try:
        want: bytes | str = _encode_slow(items)
    except InvalidInputError as exc:
        want = str(exc)
    for form in (items, tuple(items)):
        try:
            got: bytes | str = RadixKey(form).data
        except InvalidInputError as exc:
            got = str(exc)
        assert got == want, type(form)


def test_a_failed_list_key_leaves_nothing_behind() -> None:
    with pytest.raises(InvalidInputError, match=r"token id -7 at position 2 "):
        RadixKey([1, 2, -7, 4])
    assert RadixKey([1, 2, 7, 4]).data == _want([1, 2, 7, 4])
