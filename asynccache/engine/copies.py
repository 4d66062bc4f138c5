"""Copies in flight and how their completions commit.

:class:`CopyTracker` holds every copy the cache started until it lands (``flush``,
``alloc_device`` and ``aclose`` wait for them). A :class:`CommitPolicy` decides *when* a landed
copy's commit runs: :class:`ImmediateCommits` (one rank: in the copy's done-callback, on the
loop, in submission order) or :class:`AgreedCommits` (several ranks: at the agreement tick where
every rank has it, so all ranks commit alike). One-rank and several-rank behaviour differ in
exactly this choice. A commit callback never awaits.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from asynccache.errors import TransferError
from asynccache.ranks import Agreement
from asynccache.transfers.handles import CopyHandle, wait_all

Commit = Callable[[BaseException | None], object]  # called with a peer rank's error, or None


def copy_error(handle: CopyHandle) -> BaseException | None:
    """The copy's own error (delivered through the bridge), or None when it succeeded."""
    try:
        handle.result()
    except Exception as exc:
        return exc
    return None


class CopyTracker:
    """Copies not yet landed, by key: a tree operation's id, or a fresh negative key."""

    __slots__ = ("_inflight", "_keys")

    def __init__(self) -> None:
        self._inflight: dict[int, CopyHandle] = {}
        self._keys = itertools.count(-1, -1)

    def __len__(self) -> int:
        return len(self._inflight)

    def add(self, key: int, handle: CopyHandle) -> None:
        """``handle`` belongs to tree operation ``key``; its commit calls :meth:`discard`."""
        self._inflight[key] = handle

    def discard(self, key: int) -> None:
        self._inflight.pop(key, None)

    def track(self, handle: CopyHandle) -> CopyHandle:
        """A copy without a tree operation: tracked until it lands."""
        key = next(self._keys)
        self._inflight[key] = handle
        handle.add_done_callback(lambda _h: self._inflight.pop(key, None))
        return handle

    def of(self, keys: Sequence[int]) -> list[CopyHandle]:
        return [self._inflight[k] for k in keys if k in self._inflight]

    def all(self) -> list[CopyHandle]:
        return list(self._inflight.values())


class CommitPolicy(Protocol):
    """When a landed copy commits, and how callers wait for that."""

    agreement: Agreement | None

    async def sync(self) -> int:
        """One agreement tick (one rank: nothing to agree on, 0); returns items retired."""

    def on_done(self, handle: CopyHandle, commit: Commit) -> None:
        """Run ``commit`` once ``handle`` has landed (and, several ranks, landed everywhere)."""

    async def settle(self, handles: Sequence[CopyHandle]) -> None:
        """Wait until the copies landed and their commits ran (success or failure)."""

    def committed(self, handle: CopyHandle) -> Callable[[], Awaitable[None]] | None:
        """What a caller awaits for ``handle``'s commit (None: awaiting the handle is enough)."""

    async def await_copy(self, handle: CopyHandle, on_cancel: Callable[[], None]) -> None:
        """Await one copy a caller owns, raising :class:`TransferError` if it failed; when the
        awaiter is cancelled, ``on_cancel`` runs once the copy can no longer touch its slots."""


class ImmediateCommits:
    """One rank: a copy commits in its done-callback."""

    agreement: Agreement | None = None

    async def sync(self) -> int:
        return 0

    def on_done(self, handle: CopyHandle, commit: Commit) -> None:
        handle.add_done_callback(lambda _h: commit(None))

    async def settle(self, handles: Sequence[CopyHandle]) -> None:
        await wait_all(handles)

    def committed(self, handle: CopyHandle) -> Callable[[], Awaitable[None]] | None:
        return None

    async def await_copy(self, handle: CopyHandle, on_cancel: Callable[[], None]) -> None:
        try:
            await handle
        except asyncio.CancelledError:
            if handle.finished:
                on_cancel()
            else:
                handle.add_done_callback(lambda _h: on_cancel())
            raise
        except Exception as exc:
            raise TransferError(f"copy failed: {exc}") from exc


class AgreedCommits:
    """Several ranks: a copy commits at the agreement tick that retires it on every rank; one
    that failed on any rank commits as failed on all."""

    def __init__(self, agreement: Agreement) -> None:
        self.agreement: Agreement | None = agreement
        self._agree = agreement

    async def sync(self) -> int:
        return await self._agree.sync()

    def on_done(self, handle: CopyHandle, commit: Commit) -> None:
        self._agree.defer_copy(handle, commit)

    async def settle(self, handles: Sequence[CopyHandle]) -> None:
        await self._agree.settle(handles)

    def committed(self, handle: CopyHandle) -> Callable[[], Awaitable[None]] | None:
        return lambda: self.settle([handle])

    async def await_copy(self, handle: CopyHandle, on_cancel: Callable[[], None]) -> None:
        outcome: dict[str, Any] = {}

        def retire(peer_error: BaseException | None) -> None:
            outcome["error"] = copy_error(handle) or peer_error
            if outcome.get("cancelled"):
                on_cancel()

        self._agree.defer_copy(handle, retire)
        try:
            await self._agree.settle([handle])
        except asyncio.CancelledError:
            if "error" in outcome:
                on_cancel()
            else:
                outcome["cancelled"] = True
            raise
        except BaseException:
            # The ranks could not agree (a peer failed): the caller frees the slots, so the
            # copy must have landed here first.
            await wait_all([handle])
            raise
        err = outcome["error"]
        if err is not None:
            raise TransferError(f"copy failed: {err}") from err
