"""The stand-in for a missing package that SGLang imports at module level but the KV-cache paths
never call: imports by the named importers succeed, any use raises an ImportError naming the
package, other importers still find it absent, and nothing is left behind after the block."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap

import pytest

from asynccache.integrations.sglang_import_guard import StandInUsedError, missing_package_stand_in

MISSING = "asynccache_no_such_pkg"


@pytest.fixture
def importer(tmp_path, monkeypatch):
    """A package ``fakeeng`` whose module imports MISSING the way SGLang imports torchvision."""
    pkg = tmp_path / "fakeeng"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "vision.py").write_text(textwrap.dedent(f"""
        import {MISSING}.transforms as T
        from {MISSING}.transforms.functional import InterpolationMode
        MEAN = (0.5, 0.5)
        def build():
            return T.Compose([T.Resize(8, interpolation=InterpolationMode.BICUBIC)])
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fakeeng"
    for name in [n for n in sys.modules if n.split(".")[0] in ("fakeeng", MISSING)]:
        del sys.modules[name]


def test_module_level_imports_succeed_and_any_use_fails_loudly(importer):
    with missing_package_stand_in([MISSING], importers=[importer]) as stood_in:
        assert stood_in == {MISSING}
        vision = importlib.import_module(f"{importer}.vision")
    assert vision.MEAN == (0.5, 0.5)  # the rest of the module is usable
    with pytest.raises(StandInUsedError, match=rf"{MISSING}.transforms.functional."
                                               rf"InterpolationMode.BICUBIC was used, but "
                                               rf"{MISSING} is not installed"):
        vision.build()
    with pytest.raises(StandInUsedError, match=r"transforms.Compose\(\.\.\.\)"):
        vision.T.Compose([])
    with pytest.raises(ImportError, match="BICUBIC"):
        _ = vision.InterpolationMode.BICUBIC
    with pytest.raises(ImportError, match=r"transforms.Normalize\[0\]"):
        vision.T.Normalize[0]
    with pytest.raises(ImportError, match=r"iter\("):
        list(vision.T.Normalize)
    assert "missing" in repr(vision.InterpolationMode)


def test_others_still_find_the_package_absent(importer):
    with missing_package_stand_in([MISSING], importers=[importer]):
        assert importlib.util.find_spec(MISSING) is None  # e.g. transformers' probe
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(MISSING)
        importlib.import_module(f"{importer}.vision")
    assert importlib.util.find_spec(MISSING) is None  # the stand-ins left sys.modules
    assert not any(n.split(".")[0] == MISSING for n in sys.modules)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(MISSING)


def test_an_installed_package_is_left_alone():
    with missing_package_stand_in(["json"]) as stood_in:
        assert stood_in == frozenset()
        import json

        assert json.dumps([1]) == "[1]"


def test_bad_names_are_named():
    with pytest.raises(ValueError, match=r"'a\.b'"), missing_package_stand_in(["a.b"]):
        pass
    with pytest.raises(ValueError, match=r"importers: package names, got \[''\]"), \
            missing_package_stand_in([MISSING], importers=[""]):
        pass
