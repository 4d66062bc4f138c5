"""Pages whose read is stuck: later reads of them are immediate misses.

A read still running when its call's deadline passes (a FIFO at the page's name, a file on a
dead NFS server) is abandoned on its thread; its pages go into the :class:`Quarantine`, so that
no later call sends another thread to hang on them. The entry goes when that read finally
returns (the function :meth:`Quarantine.add` returns is called from its thread), or when the page
is written again or deleted (:meth:`Quarantine.discard`). Entries carry a generation: a late
return of an old read never lifts a newer quarantine of the same page.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

__all__ = ["Quarantine"]


class Quarantine:
    """key -> generation; read on the loop thread, lifted from worker threads."""

    def __init__(self) -> None:
        self._keys: dict[str, int] = {}
        self._gen = 0
        self._lock = threading.Lock()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: list[str]) -> Callable[[], None]:
        """Quarantine ``keys``; returns what lifts this quarantine (callable from any thread)."""
        with self._lock:
            self._gen += 1
            gen = self._gen
            for key in keys:
                self._keys[key] = gen

        def lift() -> None:
            with self._lock:
                for key in keys:
                    if self._keys.get(key) == gen:
                        del self._keys[key]

        return lift

    def discard(self, keys: Iterable[str]) -> None:
        if self._keys:
            with self._lock:
                for key in keys:
                    self._keys.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()
