"""``copy_faults(copier, ...)``: make a real copier's completions late, or failed.

``copier`` is a :class:`~asynccache.transfers.engine.CopyEngine` or a
:class:`~asynccache.transfers.hybrid_copies.StateCopier` (its ``submit_d2h`` / ``submit_h2d``). Each copy
still runs for real on the copier's thread; what changes is when (and how) the cache hears of
it: the returned handle completes ``delay_s`` after the real copy did, and the copies that
``fail`` picks (by submission number, from 0) complete with a :class:`TransferError` instead
of their result, as a copy whose DMA failed would. Multi-rank tests give each rank its own
delays, so copies finish in a different order and at different ticks on every rank.

>>> faults = copy_faults(cache.hybrid.tier.states, delay_s=0.003, fail={5})
>>> ...
>>> faults.remove()
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container
from typing import Any

from asynccache.errors import TransferError
from asynccache.transfers.handles import CopyHandle

__all__ = ["CopyFaults", "copy_faults"]

_OPS = ("submit_d2h", "submit_h2d")


class CopyFaults:
    """The wrapping of one copier (see the module docstring); ``remove()`` undoes it."""

    def __init__(self, copier: Any, delay_s: float, fail: Container[int]) -> None:
        self.copier = copier
        self.delay_s = delay_s
        self.fail = fail
        self.submitted = 0
        self.failed = 0
        for op in _OPS:
            setattr(copier, op, self._wrap(getattr(copier, op)))

    def _wrap(self, submit: Callable[..., CopyHandle]) -> Callable[..., CopyHandle]:
        def submit_late(src: Any, dst: Any) -> CopyHandle:
            real = submit(src, dst)
            n = self.submitted
            self.submitted += 1
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[Any] = loop.create_future()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())

            def settle() -> None:
                if fut.done():
                    return
                if n in self.fail:
                    self.failed += 1
                    fut.set_exception(TransferError(f"injected failure of copy {n}"))
                    return
                try:
                    fut.set_result(real.result())
                except BaseException as exc:
                    fut.set_exception(exc)

            real.add_done_callback(lambda _h: loop.call_later(self.delay_s, settle))
            return CopyHandle(real.op, fut, real.src_indices, real.dst_indices, real.num_bytes)

        return submit_late

    def remove(self) -> None:
        for op in _OPS:
            self.copier.__dict__.pop(op, None)


def copy_faults(copier: Any, *, delay_s: float = 0.0,
                fail: Container[int] = ()) -> CopyFaults:
    """Delay (and optionally fail) the completions of ``copier``'s copies."""
    return CopyFaults(copier, delay_s, fail)
