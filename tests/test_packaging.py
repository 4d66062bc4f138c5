"""Packaging: the repository's top-level ``storage/`` and ``transfers/`` folders install as
``asynccache.storage`` / ``asynccache.transfers`` (never as top-level packages that a project's
own ``storage`` package would collide with), in a wheel and in an editable install alike."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"asynccache.storage": "storage", "asynccache.transfers": "transfers"}
TIMEOUT = 120  # a hang guard, not a performance assertion


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_folders() -> dict[str, Path]:
    """Every package of the distribution (by its installed name) and its folder here."""
    out: dict[str, Path] = {}
    for init in sorted((ROOT / "asynccache").rglob("__init__.py")):
        rel = init.parent.relative_to(ROOT)
        out[".".join(rel.parts)] = init.parent
    for name, folder in MAPPED.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            out[".".join((name, *rel.parts))] = init.parent
    return out


def test_pyproject_lists_every_package_folder_and_maps_the_top_level_ones() -> None:
    cfg = _setuptools_config()
    assert cfg["package-dir"] == MAPPED
    assert sorted(cfg["packages"]) == sorted(_package_folders()), (
        "[tool.setuptools] packages in pyproject.toml must name every package folder")
    assert "find" not in cfg.get("packages", {})


def _python_files() -> list[Path]:
    files: list[Path] = []
    for top in ("asynccache", "storage", "transfers", "tests", "scripts"):
        files += [p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts]
    return files


def test_nothing_imports_the_folders_by_their_repository_names() -> None:
    """From the repository root ``import storage`` would still find the folder (a second copy of
    every module, with its own classes): the code must always say ``asynccache.storage``."""
    modules = "|".join(sorted({p.stem for d in MAPPED.values() for p in (ROOT / d).glob("*.py")}))
    imported = re.compile(r"(storage|transfers)(\..*)?")
    named = re.compile(rf"(storage|transfers)\.({modules})(\.\w+)*")  # "storage.faults" targets
    bad: list[str] = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names if imported.fullmatch(a.name)]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = [node.module] if imported.fullmatch(node.module) else []
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found = [node.value] if named.fullmatch(node.value) else []
            line = getattr(node, "lineno", 0)
            bad += [f"{path.relative_to(ROOT)}:{line}: {name}" for name in found]
    assert not bad, "import these as asynccache.storage / asynccache.transfers:\n" + "\n".join(bad)


def _outside_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def _run_outside(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                          env=_outside_env(), capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def installed(tmp_path: Path) -> None:
    probe = _run_outside("import asynccache", tmp_path)
    if probe.returncode != 0:
        pytest.skip("asynccache is not installed (pip install -c constraints.txt -e .)")


@pytest.mark.usefixtures("installed")
def test_installed_package_nests_storage_and_transfers(tmp_path: Path) -> None:
    proc = _run_outside("""
        import importlib.util, os
        import asynccache.storage.base, asynccache.transfers.pools
        from asynccache.storage import FileBackend, open_backend
        from asynccache.transfers import CopyEngine
        for top in ("storage", "transfers"):
            spec = importlib.util.find_spec(top)
            here = os.path.dirname(asynccache.__file__)
            assert spec is None or not (spec.origin or "").startswith(
                (os.path.dirname(here) + os.sep + top, here)), (top, spec)
        print("ok")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.usefixtures("installed")
def test_a_project_with_its_own_storage_package_still_imports_asynccache(tmp_path: Path) -> None:
    for top in ("storage", "transfers"):
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text(f"OWNER = 'user-{top}'\n")
    proc = _run_outside("""
        import storage, transfers
        import asynccache
        import asynccache.storage, asynccache.storage.file, asynccache.transfers.engine
        from asynccache import FileBackend, HierarchicalCache, open_backend
        assert storage.OWNER == "user-storage" and transfers.OWNER == "user-transfers"
        assert asynccache.storage is not storage and asynccache.transfers is not transfers
        assert asynccache.storage.FileBackend is FileBackend
        assert not hasattr(asynccache.storage, "OWNER")
        print("ok")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_wheel_holds_only_the_asynccache_package(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("asynccache", *MAPPED.values()):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "dist"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys; from setuptools.build_meta import build_wheel; print(build_wheel(sys.argv[1]))",
         str(out)],
        cwd=src, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (wheel,) = out.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"asynccache", "asynccache-0.1.0.dist-info"}, tops
    for name, folder in MAPPED.items():
        want = {f"{name.replace('.', '/')}/{p.name}" for p in (ROOT / folder).glob("*.py")}
        assert want <= set(names), sorted(want - set(names))
    top_level = [n for n in names if n.endswith("top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["asynccache"]
