"""The README's snippets run as written (issue 21, "Docs that run as written").

Every fenced ``python`` block of README.md is executed: blocks with top-level ``await`` inside an
event loop, the others as a module. Sections whose blocks need a companion get one here, kept to
the minimum and said so: a temp directory for the storage example, a temp project for the pytest
example, the logging set-up undone afterwards. ``bash`` blocks are checked where that is cheap:
the two set-up commands CI runs are pinned, ``asynccache --help`` runs, and every flag of the
``asynccache replay`` commands exists.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import logging
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PRIORITIES_EXAMPLE = ROOT / "examples" / "priorities.py"

# Sections whose blocks have a dedicated test below; every other python block runs as it is.
SCHEDULER = "Using the cache from a scheduler"
PRIORITIES = "Priorities, sessions and preemption"
STORAGE = "Storage (L3)"
LOGGING = "Logging"
TESTING = "Testing your scheduler against asynccache"


@dataclass(frozen=True)
class Block:
    lang: str
    section: str  # the nearest heading above the block
    line: int  # 1-based line of the opening fence
    code: str

    @property
    def id(self) -> str:
        return f"{self.section}:{self.line}"


def readme_blocks(lang: str | None = None) -> list[Block]:
    blocks, section, fence = [], "", None
    body: list[str] = []
    for no, line in enumerate(README.read_text().splitlines(), 1):
        if fence is None:
            if line.startswith("#"):
                section = line.lstrip("#").strip()
            elif line.startswith("```"):
                fence, body = (line[3:].strip(), no), []
        elif line.startswith("```"):
            blocks.append(Block(fence[0], section, fence[1], "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"README.md: the fence opened at line {fence[1]} is never closed"
    return [b for b in blocks if lang is None or b.lang == lang]


def section_blocks(section: str, lang: str = "python") -> list[Block]:
    found = [b for b in readme_blocks(lang) if b.section == section]
    assert found, f"README.md has no {lang} block under the heading {section!r}"
    return found


def run_block(block: Block, module: types.ModuleType | None = None) -> types.ModuleType:
    """Run a block as the body of a module (top-level ``await`` inside a fresh event loop);
    ``module``: the one of an earlier block that this block continues."""
    module = module or types.ModuleType(f"readme_line_{block.line}")
    code = compile(block.code, f"README.md:{block.line}", "exec",
                   flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    try:
        result = eval(code, module.__dict__)  # a coroutine when the block awaits at top level
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    finally:
        del sys.modules[module.__name__]
    return module


# ---------------------------------------------------------------------------- python blocks
OTHER_BLOCKS = [b for b in readme_blocks("python")
                if b.section not in (SCHEDULER, PRIORITIES, STORAGE, LOGGING, TESTING)]


def test_other_python_blocks_run_as_written() -> None:
    for block in OTHER_BLOCKS:  # none today: a new block runs here until it needs its own test
        run_block(block)


def test_scheduler_example(capsys: pytest.CaptureFixture[str]) -> None:
    (block,) = section_blocks(SCHEDULER)
    for needle in ("cache.write_kv(", "(layers, 2, n, heads, head_dim)", "def run_forward",
                   "prompts = ", "asyncio.run(main())"):
        assert needle in block.code, needle
    run_block(block)
    # the printed line is the one its comment shows: the second request on hits the prompt
    assert capsys.readouterr().out.splitlines() == ["0 [256, 256, 256, 256, 256, 256, 256]"]


def test_priorities_example_runs_and_matches_examples_priorities() -> None:
    (block,) = section_blocks(PRIORITIES)
    source = PRIORITIES_EXAMPLE.read_text()
    begin = source.index("(verbatim) ---\n") + len("(verbatim) ---\n")
    end = source.index("# --- end of the README's example ---")
    assert source[begin:end] == block.code, \
        "README.md's priorities example and examples/priorities.py differ: keep them the same"
    module = run_block(block)
    assert callable(module.Item) and callable(module.step)


def test_examples_priorities_preempts_and_restores(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(PRIORITIES_EXAMPLE), run_name="__main__")  # asserts as it goes
    out = capsys.readouterr().out
    assert "preempted chat-1: 160 tokens" in out and "restored chat-1: its 160" in out


def test_storage_example_against_a_temp_directory(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (scheduler,) = section_blocks(SCHEDULER)
    (block,) = section_blocks(STORAGE)
    assert "open_backend(" in block.code and "cache.attach_storage(" in block.code
    module = run_block(scheduler)  # the storage example replaces its main()
    run_block(block, module)
    root = tmp_path / "kv"
    asyncio.run(module.main(str(root)))  # the only change: a temp directory, not /var/cache/kv
    assert list(root.rglob("*")), "nothing was written to the storage directory"
    asyncio.run(module.main(str(root)))  # a restarted engine: the system prompt comes from L3
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "256 [256, 256, 256, 256, 256, 256, 256]", lines


def test_logging_example_routes_events_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    (block,) = section_blocks(LOGGING)
    lib = logging.getLogger("asynccache")
    handlers, level = list(lib.handlers), lib.level
    try:
        run_block(block)
        from asynccache.logs import get_logger

        get_logger("retraction").info("retracted", rid="req-1", tokens=160)
    finally:  # the example configures this process's logging: undo it
        for handler in lib.handlers[len(handlers):]:
            lib.removeHandler(handler)
        lib.setLevel(level)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert {"event": "retracted", "rid": "req-1", "tokens": 160, "level": "info",
            "logger": "asynccache.retraction"} in lines


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one_process", "xdist"])
def test_pytest_example_in_a_user_project(tmp_path: Path, workers: list[str]) -> None:
    """The example and the configuration above it, as a user's project, in a separate pytest;
    also under pytest-xdist (each worker gets its own fixtures and leak checks)."""
    (toml,) = section_blocks(TESTING, "toml")
    (example,) = section_blocks(TESTING)
    assert 'asyncio_mode = "auto"' in toml.code
    (tmp_path / "pyproject.toml").write_text(toml.code)
    (tmp_path / "test_scheduler.py").write_text(example.code)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers,
         "test_scheduler.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\b2 passed\b", proc.stdout), proc.stdout


# ---------------------------------------------------------------------------- bash blocks
def test_setup_commands_are_the_ones_ci_runs() -> None:
    first = readme_blocks("bash")[0]
    commands = [line.split("#")[0].strip() for line in first.code.splitlines()]
    assert commands[:2] == [
        "pip install -c constraints.txt -e . && asynccache replay",
        "pip install -c constraints.txt -e '.[test]' && python -m pytest -q -n auto",
    ]


def _asynccache_cli() -> list[str]:
    exe = shutil.which("asynccache") or str(Path(sys.executable).with_name("asynccache"))
    return [exe] if Path(exe).exists() else [sys.executable, "-m", "asynccache"]


def test_cli_help_runs() -> None:
    for args in (["--help"], ["replay", "--help"]):
        proc = subprocess.run([*_asynccache_cli(), *args], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "usage: asynccache" in proc.stdout


def _replay_commands() -> list[tuple[int, list[str]]]:
    found = []
    for block in readme_blocks("bash"):
        text = block.code.replace("\\\n", " ")
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                argv = shlex.split(line, comments=True)
                for i in range(len(argv) - 1):
                    if argv[i:i + 2] == ["asynccache", "replay"]:
                        found.append((block.line, argv[i + 2:]))
    return found


def test_replay_commands_use_existing_flags() -> None:
    commands = _replay_commands()
    assert commands, "README.md shows no 'asynccache replay' command"
    proc = subprocess.run([*_asynccache_cli(), "replay", "--help"], capture_output=True,
                          text=True, timeout=60)
    known = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", proc.stdout))
    for line, argv in commands:
        flags = {a.split("=")[0] for a in argv if a.startswith("--")}
        assert flags <= known, f"README.md block at line {line}: unknown {sorted(flags - known)}"
