"""The file backend's in-memory index: pages grouped into *units* (files), LRU by unit.

A unit is one file on disk: a single page, or a segment holding several pages under hard
links (:mod:`asynccache.storage.segment`). Its bytes stay on disk until the last of its pages is
gone, so capacity is counted per unit, and eviction takes whole units, least recently used
first (a hit on any page refreshes its unit: pages of one segment were written together and
are read together, as a prefix). Single-page units make this a plain per-page LRU.

:meth:`LruIndex.evict` hands back the units it dropped (:class:`Evicted`), and
:meth:`LruIndex.take` the pages it dropped for a delete grouped by unit, so a caller whose
unlink of one did not happen can put it back (:meth:`LruIndex.restore`): the index never
stops counting a file still on disk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable
from typing import NamedTuple

__all__ = ["Evicted", "LruIndex", "keys_of"]


class Evicted(NamedTuple):
    """Pages :meth:`LruIndex.evict` (a whole unit) or :meth:`LruIndex.take` dropped from one
    unit: the pages, the bytes of the unit's file and the unit's id."""

    keys: list[str]
    nbytes: int
    uid: int


def keys_of(units: Iterable[Evicted]) -> list[str]:
    """The pages of evicted units, in order."""
    return [k for u in units for k in u.keys]


class _Unit:
    __slots__ = ("keys", "nbytes")

    def __init__(self, keys: list[str], nbytes: int) -> None:
        self.keys = keys
        self.nbytes = nbytes


class LruIndex:
    """key -> unit; units in LRU order (least recent first); bytes of live units."""

    def __init__(self) -> None:
        self._units: OrderedDict[int, _Unit] = OrderedDict()
        self._where: dict[str, int] = {}
        self._next = 0
        self.used = 0

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    @property
    def files(self) -> int:
        """Files (units) indexed."""
        return len(self._units)

    def keys(self) -> list[str]:
        return list(self._where)

    def unit_of(self, key: str) -> int | None:
        return self._where.get(key)

    def unit_size(self, key: str) -> int:
        """How many pages share ``key``'s unit (0 if unknown)."""
        uid = self._where.get(key)
        return len(self._units[uid].keys) if uid is not None else 0

    def file_bytes(self, keys: Iterable[str]) -> int:
        """Bytes of the files (units) holding any of ``keys``, each counted once."""
        uids = {u for k in keys if (u := self._where.get(k)) is not None}
        return sum(self._units[u].nbytes for u in uids)

    def add(self, keys: Iterable[str], nbytes: int) -> None:
        """A new unit holding ``keys`` (most recent); keys already indexed move to it."""
        self._add(keys, nbytes)

    def restore(self, keys: Iterable[str], nbytes: int, uid: int | None = None) -> int | None:
        """Put back pages :meth:`evict` or :meth:`take` dropped whose file is still on disk
        (pages indexed again meanwhile are left where they are): into their unit ``uid`` if
        it still holds other pages (its bytes are counted, its place in the LRU order kept),
        else as the unit of ``nbytes`` made again under the same id (one file, one unit: pages
        of one segment that two calls took and both failed to unlink go back into one unit,
        its bytes counted once), the least recent (the next eviction takes it first).
        Returns the unit's id (None: no keys)."""
        fresh = [k for k in dict.fromkeys(keys) if k not in self._where]
        if not fresh:
            return None
        if uid is None:
            uid = self._next
            self._next += 1
        unit = self._units.get(uid)
        if unit is None:
            unit = self._units[uid] = _Unit([], nbytes)
            self._units.move_to_end(uid, last=False)
            self.used += nbytes
        unit.keys += fresh
        for k in fresh:
            self._where[k] = uid
        return uid

    def _add(self, keys: Iterable[str], nbytes: int) -> int | None:
        fresh = list(dict.fromkeys(keys))
        for k in fresh:
            self.drop(k)
        if not fresh:
            return None
        uid = self._next
        self._next += 1
        self._units[uid] = _Unit(fresh, nbytes)
        for k in fresh:
            self._where[k] = uid
        self.used += nbytes
        return uid

    def touch(self, key: str) -> None:
        uid = self._where.get(key)
        if uid is not None:
            self._units.move_to_end(uid)

    def drop(self, key: str) -> bool:
        """Forget one page; its unit's bytes are released with its last page."""
        uid = self._where.pop(key, None)
        if uid is None:
            return False
        unit = self._units[uid]
        unit.keys.remove(key)
        if not unit.keys:
            del self._units[uid]
            self.used -= unit.nbytes
        return True

    def take(self, keys: Iterable[str]) -> list[Evicted]:
        """Drop the indexed ones of ``keys`` (a delete): per unit, in order of first key, the
        pages taken from it (its bytes are released with its last page)."""
        taken: dict[int, Evicted] = {}
        for k in dict.fromkeys(keys):
            uid = self._where.get(k)
            if uid is not None:
                taken.setdefault(uid, Evicted([], self._units[uid].nbytes, uid)).keys.append(k)
                self.drop(k)
        return list(taken.values())

    def evict(self, limit: int, reserved: int, protect: Container[str]) -> list[Evicted]:
        """Drop least recently used units until ``used + reserved <= limit``; return them,
        least recent first.

        Units holding a protected key (pages of the batch being written) are skipped.
        """
        victims: list[Evicted] = []
        while self.used + reserved > limit:
            # Protected units are few and rarely least recent: found at or near the front.
            uid = next(
                (u for u, unit in self._units.items() if not any(k in protect for k in unit.keys)),
                None,
            )
            if uid is None:
                break
            unit = self._units.pop(uid)
            for k in unit.keys:
                del self._where[k]
            self.used -= unit.nbytes
            victims.append(Evicted(unit.keys, unit.nbytes, uid))
        return victims
