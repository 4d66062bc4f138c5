"""CacheConfig(max_token_id=...): token ids above the model's vocabulary are rejected at
admission, before anything is matched, locked or allocated (tenant-isolation hardening: crafted
ids around 1.6e9 are what a cross-namespace key attack needs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asynccache import CacheConfig
from asynccache.errors import ConfigError, InvalidInputError

GOOD = {"page_size": 4, "num_layers": 2, "num_heads": 2, "head_dim": 8, "device_tokens": 64}


@pytest.mark.parametrize("bad", (-1, 2**32, 1.5, "100", True))
def test_bad_bound_is_a_config_error(bad) -> None:
    with pytest.raises(ConfigError, match="max_token_id"):
        CacheConfig(**GOOD, max_token_id=bad)


@pytest.mark.parametrize("form", ("list", "numpy", "torch"))
async def test_ids_above_the_bound_are_rejected_before_any_change(make_cache, form: str) -> None:
    cache = await make_cache(**GOOD, max_token_id=999)
    tokens = [1, 2, 3, 4, 5, 6, 1000, 8]
    key = {"list": tokens, "numpy": np.array(tokens, dtype=np.int64),
           "torch": torch.tensor(tokens)}[form]
    for call in (lambda: cache.admit(key), lambda: cache.match_prefix(key),
                 lambda: cache.insert(key, np.arange(8))):
        with pytest.raises(InvalidInputError, match=r"token id 1000 .*max_token_id 999"):
            call()
    assert cache.tree.node_count == 0 and cache.tree.held_locks == 0
    assert cache.device_pool.allocator.used_size == 0
    req = cache.admit([999, 0, 5, 7])  # the bound itself is a valid id
    cache.abort_req(req)
    cache.sanity_check()
