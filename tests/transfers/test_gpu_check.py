"""scripts/gpu_check.sh: what can be checked without a GPU (its pre-flight fails loudly)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_the_script_parses_and_installs_nothing_from_an_index() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    commands = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not any("pip install -e" in line or "pip install ." in line for line in commands)
    assert all("--no-index" in line for line in commands if "pip install" in line)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_the_preflight_fails_with_exit_2_and_says_why(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_check: pre-flight FAILED" in proc.stderr
    assert "CPU build" in proc.stderr or "CUDA is not available" in proc.stderr
    assert "nothing else ran" in proc.stderr
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    pre = lines[0]
    assert pre["step"] == "preflight" and pre["ok"] is False
    assert pre["python"] == ".".join(map(str, sys.version_info[:3]))
    assert pre["torch"] == torch.__version__
    assert lines[-1] == {"verdict": "preflight_failed", "exit": 2}
    assert not (out / "pytest.log").exists()  # no step ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_a_missing_module_is_named_with_the_command_to_fetch_it(tmp_path: Path) -> None:
    if any((ROOT / ".whl").glob("*.whl")):  # a GPU session's carried wheels go first
        pytest.skip(".whl/ holds carried wheels, which the script installs over the stub")
    # A Python that cannot import structlog: a stub first on the path fails to import.
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "structlog.py").write_text("raise ImportError('hidden for the test')\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
           "PYTHONPATH": f"{stub}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert "modules missing: structlog" in proc.stderr
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"pip download --no-deps --only-binary=:all: --python-version {v}" in proc.stderr
    pre = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert pre["missing_modules"] == ["structlog"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_a_dry_run_streams_every_step_and_fails_on_skipped_cuda_tests(tmp_path: Path) -> None:
    """GPU_CHECK_DRY_RUN=1 runs every step on the CPU (small sizes): each step leaves its
    line, the benchmarks their cases, and the CUDA tests -- all skipped here -- fail the run."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_DRY_RUN": "1"}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    steps = {d["step"]: d for d in lines if "step" in d}
    assert list(steps) == ["preflight", "pytest_cuda", "bench_transfers", "bench_overlap",
                           "bench_lanes", "bench_events"]
    assert all(d.get("rc", 0) == 0 for d in steps.values())
    pytest_counts = next(d for d in lines if "pytest_cuda" in d)
    assert pytest_counts["ok"] is False
    assert pytest_counts["pytest_cuda"]["skipped"] == pytest_counts["pytest_cuda"]["tests"] > 0
    ops = {d["case"]["op"] for d in lines if "case" in d}
    assert ops == {"d2h", "h2d", "h2d_layerwise"}
    assert any("summary" in d for d in lines) and any("overlap" in d for d in lines)
    lanes = next(d["lanes"] for d in lines if "lanes" in d)
    assert lanes["separate"]["load_ms"] > 0 and lanes["one_lane"]["load_ms"] > 0
    events = next(d["events"] for d in lines if "events" in d)
    assert events["device"] == "cpu" and events["event_to_coroutine_us"] > 0
    assert lines[-1]["verdict"] == "failed" and lines[-1]["exit"] == 1
    assert "gpu_check: FAILED" in proc.stderr
