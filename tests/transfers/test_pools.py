"""KVShape, DevicePool and HostPool: sizing, layouts, config errors, page buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.transfers.pools import DevicePool, HostPool, KVShape

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_kvshape_bytes_and_dtype_names() -> None:
    s = KVShape(32, 8, 128, "fp16")
    assert s.dtype is torch.float16
    assert s.bytes_per_token_per_layer == 2 * 8 * 128 * 2
    assert s.bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    assert s.bytes_per_page(16) == 16 * 131072
    assert KVShape(2, 2, 4, "bf16").dtype is torch.bfloat16
    assert KVShape(2, 2, 4, torch.float32).bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert KVShape(1, 1, 1, "torch.float16") == KVShape(1, 1, 1, torch.float16)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_heads": -1}, "num_heads"),
        ({"head_dim": 2.5}, "head_dim"),
        ({"dtype": "int8"}, "'int8'"),
        ({"dtype": torch.int32}, "int32"),
        ({"dtype": "fp64"}, "'fp64'"),
    ],
)
def test_kvshape_rejects_bad_values(kwargs: dict[str, object], needle: str) -> None:
    args: dict[str, object] = {"num_layers": 2, "num_heads": 2, "head_dim": 4, "dtype": "fp16"}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=needle):
        KVShape(**args)  # type: ignore[arg-type]


@no_cuda
def test_device_pool_layout_and_allocator() -> None:
    shape = KVShape(3, 2, 4, "bf16")
    pool = DevicePool(shape, 32, 8)
    assert pool.device.type == "cpu" and pool.layout == "layer_first"
    assert tuple(pool.kv.shape) == (3, 2, 32, 2, 4)
    assert pool.kv.dtype is torch.bfloat16
    assert int(pool.kv.abs().sum()) == 0  # touched (zero-filled) at start-up
    assert pool.allocator.total_size == 32 and pool.allocator.page_size == 8
    assert pool.nbytes == 32 * shape.bytes_per_token
    assert tuple(pool.page_view().shape) == (3, 2, 4, 8 * 2 * 4)
    assert tuple(pool.layer_page_view(1).shape) == (2, 4, 64)
    pool.k_buffer(2)[5] = 1.5
    assert float(pool.kv[2, 0, 5, 1, 3]) == 1.5
    assert float(pool.v_buffer(2).abs().sum()) == 0.0


def test_from_tokens_and_from_bytes_round_down_to_pages() -> None:
    shape = KVShape(2, 1, 4, "fp32")  # 64 bytes per token
    assert HostPool.from_tokens(shape, 37, 8).num_slots == 32
    assert HostPool.from_bytes(shape, 64 * 8 * 5 + 100, 8).num_slots == 40
    assert DevicePool.from_bytes(shape, 64 * 8, 8, device="cpu").num_slots == 8
    with pytest.raises(ConfigError, match="num_bytes=511 is smaller than one page"):
        HostPool.from_bytes(shape, 511, 8)
    with pytest.raises(ConfigError, match="num_tokens=7"):
        HostPool.from_tokens(shape, 7, 8)
    with pytest.raises(ConfigError, match="num_bytes"):
        HostPool.from_bytes(shape, 0, 8)
    with pytest.raises(ConfigError, match="page_size"):
        HostPool.from_tokens(shape, 64, 0)


def test_pool_config_errors() -> None:
    shape = KVShape(2, 1, 4)
    with pytest.raises(ConfigError, match="layout 'row_first'"):
        HostPool(shape, 16, 4, layout="row_first")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_slots=18"):
        HostPool(shape, 18, 4)
    with pytest.raises(ConfigError, match="shape"):
        HostPool("not a shape", 16, 4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="device"):
        DevicePool(shape, 16, 4, device="nonsense")


@no_cuda
def test_cpu_only_rejects_pinned_and_cuda() -> None:
    shape = KVShape(2, 1, 4)
    assert HostPool(shape, 16, 4).pinned is False
    with pytest.raises(ConfigError, match="pin_memory=True"):
        HostPool(shape, 16, 4, pin_memory=True)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        DevicePool(shape, 16, 4, device="cuda")


def _random_bits(t: torch.Tensor, seed: int) -> None:
    """Fill with random bit patterns (NaNs and denormals included)."""
    g = torch.Generator().manual_seed(seed)
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that comparisons are exact (NaN == NaN bit-wise)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_page_first_layout_and_page_buffer() -> None:
    shape = KVShape(3, 2, 4, "fp16")
    pool = HostPool(shape, 32, 8, layout="page_first")
    assert tuple(pool.kv.shape) == (4, 3, 2, 8, 2, 4)
    _random_bits(pool.kv, 1)
    buf = pool.page_buffer(16)  # page 2
    assert buf.dtype is torch.uint8 and buf.numel() == pool.page_bytes == 8 * shape.bytes_per_token
    assert buf.is_contiguous()
    assert buf.data_ptr() == pool.kv[2].data_ptr()
    # page view (L, 2, P, R) and the raw page agree
    assert torch.equal(_bits(pool.page_view()[:, :, 2]).reshape(-1), _bits(pool.kv[2]).reshape(-1))
    # the buffer is a view: writing it writes the pool
    buf.zero_()
    assert int(pool.kv[2].view(torch.int16).abs().sum()) == 0
    assert int(pool.kv[1].view(torch.int16).abs().sum()) > 0
    with pytest.raises(InvalidInputError, match="first_slot=3"):
        pool.page_buffer(3)
    with pytest.raises(InvalidInputError, match="first_slot=32"):
        pool.page_buffer(32)
    with pytest.raises(InvalidInputError, match="page_first"):
        HostPool(shape, 32, 8).page_buffer(0)
    with pytest.raises(InvalidInputError, match="layer_first"):
        pool.k_buffer(0)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_read_page_write_page_round_trip_across_layouts(dtype: str) -> None:
    shape = KVShape(2, 3, 4, dtype)
    lf = HostPool(shape, 24, 4, layout="layer_first")
    pf = HostPool(shape, 24, 4, layout="page_first")
    _random_bits(lf.kv, 7)
    for first in (0, 8, 20):
        data = lf.read_page(first)
        assert data.dtype is torch.uint8 and data.numel() == lf.page_bytes
        pf.write_page(first, data)
        assert torch.equal(pf.page_buffer(first), data)
        # same bytes whichever layout holds the page
        assert torch.equal(pf.read_page(first), data)
    slots = np.array([8, 9, 10, 11, 20, 21, 22, 23])
    assert torch.equal(
        lf.read_slots(slots).view(torch.uint8), pf.read_slots(slots).view(torch.uint8)
    )
    assert torch.equal(_bits(lf.read_slots(slots)), _bits(lf.kv[:, :, slots]))
    with pytest.raises(InvalidInputError, match="uint8"):
        pf.write_page(0, torch.zeros(3, dtype=torch.uint8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_pools_are_allocated_exactly_and_pinning_needs_cuda() -> None:
    from asynccache.transfers.pools import register_host_memory

    shape = KVShape(3, 2, 8, "fp16")
    host = HostPool(shape, 40 * 4, 4, layout="page_first")
    assert not host.pinned
    assert host.nbytes == host.kv.untyped_storage().nbytes() == 40 * 4 * shape.bytes_per_token
    with pytest.raises(ConfigError, match="needs CUDA"):
        register_host_memory(host.kv)
