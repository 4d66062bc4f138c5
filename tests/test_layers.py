"""The engine's layering, checked on the source: every import (module level, inside
``if TYPE_CHECKING:`` and inside functions alike) goes downward, the engine layer has no import
cycle, nothing below the facade imports it, and the synchronous modules import no event loop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom; a module may import its own layer or a lower one.
LAYERS: list[tuple[str, ...]] = [
    ("asynccache.cache",),
    ("asynccache.requests", "asynccache.sessions"),
    ("asynccache.retraction",),
    ("asynccache.attachment",),
    ("asynccache.buffer",),
    ("asynccache.request",),
    ("asynccache.l3",),
    ("asynccache.engine",),
    ("asynccache.ranks",),
    ("asynccache.tree", "asynccache.transfers", "asynccache.storage", "asynccache.config",
     "asynccache.errors", "asynccache.logs", "asynccache.metrics", "asynccache.kvevents",
     "asynccache.eventpub"),
]
# Clients of the cache, not part of its layers.
CLIENTS = ("asynccache.replay", "asynccache.testing", "asynccache.cli", "asynccache.__main__",
           "asynccache.integrations")
# Synchronous modules: no event loop in them (their callers never await them).
SYNC = ("asynccache.tree", "asynccache.engine.ledger", "asynccache.engine.slots",
        "asynccache.engine.effects", "asynccache.engine.parts", "asynccache.engine.hybrid_slots",
        "asynccache.l3.policy", "asynccache.l3.op", "asynccache.l3.existence",
        "asynccache.request")


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for base, prefix in ((ROOT / "asynccache", "asynccache"),
                         (ROOT / "transfers", "asynccache.transfers"),
                         (ROOT / "storage", "asynccache.storage")):
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if name.startswith(("asynccache.transfers", "asynccache.storage")) and base.name == "asynccache":
                continue  # (links to the top-level folders, if any)
            out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every asynccache module ``name`` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return {m for m in (_resolve(f) for f in found) if m is not None and m != name}


def _resolve(mod: str) -> str | None:
    """The known module ``mod`` names (an imported name resolves to its module)."""
    while mod and mod not in MODULES:
        mod = mod.rpartition(".")[0]
    return mod or None


def _layer(name: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_every_engine_module_has_a_layer() -> None:
    missing = [m for m in MODULES if m != "asynccache" and not m.startswith(CLIENTS)
               and _layer(m) is None]
    assert not missing, f"modules outside the layer map: {missing}"


def test_imports_go_downward() -> None:
    bad = []
    for src, targets in GRAPH.items():
        ls = _layer(src)
        if ls is None:
            continue
        for dst in targets:
            ld = _layer(dst)
            if ld is not None and ld < ls:
                bad.append(f"{src} -> {dst}")
    assert not bad, "imports going up a layer:\n" + "\n".join(sorted(bad))


def test_only_clients_import_the_facade() -> None:
    users = sorted(src for src, targets in GRAPH.items()
                   if "asynccache.cache" in targets and not src.startswith(CLIENTS))
    assert users == [], users


def test_no_import_cycles() -> None:
    """Strongly connected components of the import graph (Tarjan), over every layered module;
    a package's ``__init__`` re-exporting its own modules is not a cycle."""
    nodes = [m for m in GRAPH if _layer(m) is not None]
    edges = {m: {d for d in GRAPH[m] if d in GRAPH and _layer(d) is not None
                 and not m.startswith(d + ".")} for m in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    engine = [c for c in cycles if not all(m.startswith("asynccache.tree") for m in c)]
    assert not engine, f"import cycles: {engine}"


@pytest.mark.parametrize("prefix", SYNC)
def test_synchronous_modules_import_no_event_loop(prefix: str) -> None:
    for name, path in MODULES.items():
        if name == prefix or name.startswith(prefix + "."):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n.split(".")[0] in ("asyncio", "anyio") for n in names), name
