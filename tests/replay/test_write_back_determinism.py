"""Write-back with storage: an eviction's write-backs start storage writes whose host pins
protect device pages until they finish. The replay's figures must not depend on how fast those
writes are: the same command gives the same figures, with fast storage or slow."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import asynccache.storage.factory as factory
from asynccache.cli import main


def _trace(path: Path) -> Path:
    def r(a: int, b: int) -> list[int]:
        return list(range(a, b))

    a = r(1000, 1087)
    a2 = a + r(2000, 2029)
    b = r(3000, 3088)
    records = [(0.01, a, None), (0.51, a2, None), (1.01, b, None),
               (1.01, b + r(4000, 4045), "a"), (1.02, a2, None), (3.53, r(5000, 5149), None),
               (8.03, a[:81] + r(6000, 6103), None)]
    path.write_text("".join(
        json.dumps({"t": t, "tokens": toks, **({"namespace": ns} if ns else {})}) + "\n"
        for t, toks, ns in records))
    return path


class _Delayed:
    """A backend whose writes take ``delay`` seconds."""

    def __init__(self, inner: Any, delay: float) -> None:
        self._inner = inner
        self._delay = delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def set_batch(self, keys: Any, buffers: Any) -> list[bool]:
        await asyncio.sleep(self._delay)
        return list(await self._inner.set_batch(keys, buffers))


def test_write_back_with_storage_gives_the_same_figures_whatever_the_write_speed(
        tmp_path, capsys, monkeypatch) -> None:
    p = _trace(tmp_path / "t.jsonl")
    argv = ["replay", str(p), "--page-size", "16", "--device-tokens", "256", "--host-tokens",
            "1024", "--write-policy", "write_back", "--storage", f"file://{tmp_path / 'l3'}",
            "--clear-storage", "--json", "--progress", "off"]
    real = factory.open_backend
    reps = []
    for delay in (None, 0.0, 0.02, None, 0.02):
        if delay is None:
            monkeypatch.setattr(factory, "open_backend", real)
        else:
            async def delayed(url: str, layout: Any, d: float = delay, **kw: Any) -> Any:
                return _Delayed(await real(url, layout, **kw), d)

            monkeypatch.setattr(factory, "open_backend", delayed)
        assert main(argv) == 0
        rep = json.loads(capsys.readouterr().out)
        reps.append({k: rep[k] for k in ("hits", "moved", "computed_tokens", "verified_tokens",
                                         "evicted_device_tokens", "dropped_tokens")})
    assert reps[0]["hits"] == {"device_tokens": 160, "host_tokens": 112, "storage_tokens": 0,
                               "device_blocks": 10, "host_blocks": 7, "storage_blocks": 0}
    assert reps[0]["verified_tokens"] == 112
    for rep in reps[1:]:
        assert rep == reps[0]
