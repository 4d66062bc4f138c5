"""Progress bars of ``asynccache replay`` (tqdm, on stderr): one while a trace loads, one while
it replays (requests done of the total, rate, ETA and the running token hit rate)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


class ReplayProgress:
    """``progress(1)`` per request served or rejected; ``loading(...)`` while conversations are
    parsed. Does nothing when disabled (the default when stderr is not a terminal)."""

    def __init__(self, enabled: bool, *, total: int | None = None, desc: str = "replay",
                 hit_rate: Callable[[], float] | None = None) -> None:
        self.enabled = enabled
        self.total = total
        self.desc = desc
        self.hit_rate = hit_rate
        self._bar: Any = None
        self._load: Any = None
        self._last_postfix = 0.0

    def loading(self, conversations: int, requests: int, fraction: float | None) -> None:
        """A trace's conversations are being parsed: ``fraction`` of its bytes so far."""
        if not self.enabled or self._bar is not None:
            return
        if self._load is None:
            from tqdm import tqdm

            self._load = tqdm(total=100, desc=f"loading {self.desc}", unit="%", file=sys.stderr,
                              dynamic_ncols=True, mininterval=0.2,
                              bar_format="{l_bar}{bar}| {n:.0f}/{total}% [{elapsed}<{remaining}"
                                         "{postfix}]")
        if fraction is not None:
            self._load.n = round(100 * fraction, 1)
        self._load.set_postfix_str(f"{conversations:,} conversations, {requests:,} requests",
                                   refresh=False)
        self._load.refresh()
        self.total = requests if self.total is None or requests > self.total else self.total

    def set_total(self, total: int | None) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def __call__(self, n: int) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            self._close_loading()
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, unit="req", file=sys.stderr,
                             dynamic_ncols=True, mininterval=0.2)
        self._bar.update(n)
        now = time.monotonic()
        if self.hit_rate is not None and now - self._last_postfix > 0.2:
            self._last_postfix = now
            self._bar.set_postfix_str(f"hit {self.hit_rate():.1%}", refresh=False)

    def _close_loading(self) -> None:
        if self._load is not None:
            self._load.n = self._load.total
            self._load.close()
            self._load = None

    def close(self) -> None:
        self._close_loading()
        if self._bar is not None:
            if self.hit_rate is not None:
                self._bar.set_postfix_str(f"hit {self.hit_rate():.1%}", refresh=False)
            self._bar.close()
            self._bar = None
