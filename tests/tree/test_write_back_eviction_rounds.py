"""Write-back eviction across the engine's rounds, against SGLang 0.5.23 (found by the
differential ``tests/tree/test_sglang_write_back.py`` in soak runs, FIFO and MRU policies).

The reference backs each victim up and demotes it before it takes the next one. Ours returns the
backups and counts their victims (``pending_tokens``); the engine's ``evict_async`` (what
``OursWriteBack.evict`` does) commits them and calls ``evict`` again for what is still owed. A
victim demoted at once in the first call (it had a host copy) can leave its parent a device leaf
that sorts before the victims still waiting; the next call must demote the owed victims first
(``HostTier._pay_owed``), or it takes that parent where the reference had stopped.

Here: [0] (oldest) -> [0,10] (newest, a duplicate) and [10,0,0] (not backed up). FIFO takes
[10,0,0] (backed up, 3 tokens) and [0,10] (1): 4 tokens (before the fix, the second call took
[0] before [10,0,0]: 5).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.tree.sglang_write_back import driver_params


@pytest.mark.parametrize("make", driver_params("fifo"))
def test_a_parent_exposed_by_a_demotion_waits_for_the_owed_victims(make: Any) -> None:
    t = make()
    t.insert([0])
    t.insert([10, 0, 0])
    t.insert([0, 10])
    assert t.evict(100) == 5
    assert (t.load([10, 0, 0]), t.load([0, 10])) == (3, 2)
    # [0] and [10,0,0] lose their host copies; [0,10] stays a duplicate
    assert t.evict_host(4) == (4, [(0,), (10,), (10, 0), (10, 0, 0)])
    t.removed()
    assert t.evict(4) == 4
    assert sorted(t.removed()) == [("gpu", (0, 10)), ("gpu", (10,)), ("gpu", (10, 0)),
                                   ("gpu", (10, 0, 0))]
