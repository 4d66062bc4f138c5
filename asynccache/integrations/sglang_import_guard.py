"""Import SGLang's host pools and radix tree on a machine without ``torchvision``.

SGLang's ``memory_pool_host`` and ``radix_cache`` reach ``sglang.srt.configs``, whose vision
model configs run ``import torchvision.transforms as T`` (and ``from ... import
InterpolationMode``) at module level, though nothing on the KV-pool, storage or tree paths calls
torchvision. The PyPI torchvision wheel does not match the CPU torch build here, so it cannot be
installed. :func:`missing_package_stand_in` lets those module-level imports succeed while any
*use* fails loudly: inside the ``with`` block a missing package's import by SGLang's code (only
that: other importers, such as transformers probing for torchvision, still find it absent)
yields a stand-in module
whose every public attribute is a placeholder that raises :class:`StandInUsedError` (an
``ImportError``) when called, indexed, iterated or asked for an attribute.

Only the tests and scripts that drive SGLang use it, around their SGLang imports. When the
package is importable it does nothing. On leaving the block the finder is removed and the
stand-in modules leave ``sys.modules``, so later availability probes (``importlib.util.find_spec``,
transformers' ``is_torchvision_available``) see the package as absent again; modules imported
inside the block keep their (loud) placeholders.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn


class StandInUsedError(ImportError):
    """Code used a name of a package that is not installed (imported under the stand-in)."""


def _fail(what: str) -> NoReturn:
    root = what.split(".")[0]
    raise StandInUsedError(
        f"{what} was used, but {root} is not installed: it was imported under asynccache's "
        f"stand-in (asynccache.integrations.sglang_import_guard), which lets SGLang's "
        f"module-level '{root}' imports succeed on the KV-cache paths that never call it",
        name=root)


class _Placeholder:
    """A name from a missing package: any use raises :class:`StandInUsedError`."""

    __slots__ = ("_what",)

    def __init__(self, what: str) -> None:
        object.__setattr__(self, "_what", what)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        _fail(f"{self._what}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _fail(f"{self._what}(...)")

    def __getitem__(self, key: Any) -> NoReturn:
        _fail(f"{self._what}[{key!r}]")

    def __iter__(self) -> NoReturn:
        _fail(f"iter({self._what})")

    def __repr__(self) -> str:
        return f"<missing {self._what} (asynccache import stand-in)>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        placeholder = _Placeholder(f"{self.__name__}.{name}")
        setattr(self, name, placeholder)
        return placeholder


def _importer() -> str:
    """The module name of the code that started the import being resolved (the first frame
    outside the import machinery and this module)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not name.startswith(("importlib", "_frozen_importlib")) and name != __name__:
            return name
        frame = frame.f_back  # type: ignore[assignment]
    return ""


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: frozenset[str], importers: tuple[str, ...]) -> None:
        self.roots = roots
        self.importers = importers

    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.roots:
            return None
        importer = _importer()
        if not any(importer == p or importer.startswith(p + ".") for p in self.importers):
            return None  # (an availability probe, e.g. transformers': the package is absent)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _missing(packages: Sequence[str]) -> frozenset[str]:
    out = set()
    for name in packages:
        if not name or "." in name:
            raise ValueError(f"a top-level package name, got {name!r}")
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            out.add(name)
    return frozenset(out)


@contextmanager
def missing_package_stand_in(packages: Sequence[str] = ("torchvision",), *,
                             importers: Sequence[str] = ("sglang",)) -> Iterator[frozenset[str]]:
    """Within the block, an import of any of ``packages`` that is not installed, by code in one
    of the ``importers`` packages, yields a stand-in (see the module docstring); anyone else
    (transformers probing whether torchvision exists) still finds it absent. Yields the names
    that got one (empty: all are installed)."""
    roots = _missing(packages)
    if not roots:
        yield roots
        return
    if not importers or not all(isinstance(p, str) and p for p in importers):
        raise ValueError(f"importers: package names, got {importers!r}")
    finder = _StandInFinder(roots, tuple(importers))
    sys.meta_path.append(finder)
    try:
        yield roots
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in roots]:
            if isinstance(sys.modules[name], _StandInModule):
                del sys.modules[name]
