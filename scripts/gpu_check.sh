#!/usr/bin/env bash
# The GPU checks of the copy engine and the cache: one run, about 2 minutes, fails loudly.
#
# For a session that is lent a CUDA machine. From the repository root on that machine:
#
#     bash scripts/gpu_check.sh            # writes into $OUT (default ./gpu_check_out)
#
# (device tool: timeout_s 480; every step below has its own limit, 420 s in all, so a
# hanging step cannot eat the budget, and what was measured comes back; an H200 ran it all in
# ~120 s. $OUT holds ten files: tar them when the tool returns at most eight.)
#
# Exit status: 0 only if the pre-flight passed, every CUDA-marked test passed with none
# skipped, and every benchmark ran to its end. 2: the pre-flight failed (no CUDA, a CPU
# build of torch, an old Python, a missing module: the message says which and what to do).
# 1: a step failed, timed out or a test was skipped. Benchmark targets that are missed are
# reported (TARGET MISSED lines and in results.jsonl), not a failure of the run.
#
# Nothing is installed from an index: no `pip install -e .` (pip would pull a multi-GB torch
# wheel over the one the image has). The image's torch, numpy, pytest, hypothesis... are
# used as they are. Modules the image lacks are installed from wheels carried in `.whl/`
# (the pre-flight prints the exact `pip download` command and fails until they are there):
#
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux2014_x86_64 -d .whl structlog pytest-asyncio
#
# and name `.whl` in the run's `carry`; this script installs them into /tmp/site.
#
# GPU_CHECK_DRY_RUN=1 (for testing this script on a machine without a GPU): the pre-flight's
# CUDA problems are warnings and every step runs on the CPU with small sizes; the CUDA tests
# then all skip, so the run fails (exit 1) -- which is what tests/transfers/test_gpu_check.py
# checks.
#
# $OUT/results.jsonl gets one JSON object per line as the run goes (a timeout keeps what was
# measured): the pre-flight, one line per step (rc, seconds), each benchmark case, the pytest
# counts, and the verdict. Next to it: pytest.log / pytest.xml, bench_*.log, env.txt.
set -u

OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the checks run from a staged copy (below)
PY=${PYTHON:-python3}
RESULTS=$OUT/results.jsonl
: >"$RESULTS"
: >"$OUT/summary.txt"
export PYTHONUNBUFFERED=1
FAILED=0
DRY=${GPU_CHECK_DRY_RUN:-0}
if [ "$DRY" = 1 ]; then
    DEVICE=cpu
    BENCH_ARGS="--profile smoke --reps 1"
else
    DEVICE=cuda
    BENCH_ARGS="--profile gpu_check --reps 3"
fi

emit() {  # emit JSON_OBJECT: one line of results.jsonl
    printf '%s\n' "$1" >>"$RESULTS"
}

step() {  # step NAME LIMIT_S LOG CMD...: run with a limit, log, one results line
    local name=$1 limit=$2 log=$3 t0 rc
    shift 3
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" >>"$log"
    timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local secs=$(( $(date +%s) - t0 ))
    emit "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $secs, \"limit_s\": $limit}"
    echo "$name rc=$rc s=$secs" | tee -a "$OUT/summary.txt"
    if [ "$rc" -ne 0 ]; then
        [ "$rc" -eq 124 ] && echo "gpu_check: $name TIMED OUT after ${limit}s" >&2
        echo "gpu_check: FAIL: $name (rc=$rc, log: $log)" >&2
        FAILED=1
    fi
    return $rc
}

# Carried wheels first: the pre-flight checks the modules with them installed.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$OUT/env.txt" 2>&1 \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# 1. Pre-flight: the Python, the installed torch, CUDA, the modules. Exit 2 on any problem.
nvidia-smi >>"$OUT/env.txt" 2>&1 || echo "nvidia-smi: not found or failed" >>"$OUT/env.txt"
"$PY" - "$RESULTS" "$DRY" <<'EOF'
import importlib, json, sys

results, dry = sys.argv[1], sys.argv[2] == "1"
problems, info = [], {"python": sys.version.split()[0]}
cuda_problems = []
if sys.version_info < (3, 11):
    problems.append(f"Python {info['python']} is too old: asynccache needs >= 3.11")
try:
    import torch
except Exception as exc:  # noqa: BLE001
    problems.append(f"torch does not import: {exc!r}")
    torch = None
if torch is not None:
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    if torch.version.cuda is None:
        cuda_problems.append(f"the installed torch ({torch.__version__}) is a CPU build: "
                        "the CUDA checks need the image's CUDA torch (do not pip-install one)")
    elif not torch.cuda.is_available():
        cuda_problems.append(f"CUDA is not available to torch {torch.__version__} "
                        f"(CUDA {torch.version.cuda}): no visible GPU or a driver mismatch; "
                        "see nvidia-smi in env.txt")
    else:
        n = torch.cuda.device_count()
        info.update(devices=n, device=torch.cuda.get_device_name(0),
                    capability=list(torch.cuda.get_device_capability(0)))
missing = []
for mod in ("numpy", "anyio", "aiofiles", "structlog", "prometheus_client", "msgpack",
            "xxhash", "obstore", "tqdm", "pytest", "pytest_asyncio", "hypothesis"):
    try:
        importlib.import_module(mod)
    except ImportError:
        missing.append(mod)
if missing:
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    pkgs = " ".join(m.replace("_", "-") for m in missing)
    problems.append(
        f"modules missing: {', '.join(missing)}. Fetch their wheels on the session's machine "
        f"and carry .whl: python3 -m pip download --no-deps --only-binary=:all: "
        f"--python-version {v} --implementation cp --platform manylinux2014_x86_64 "
        f"-d .whl {pkgs}")
info["missing_modules"] = missing
if dry:
    info["dry_run"] = True
    for p in cuda_problems:
        print(f"gpu_check: dry run, ignored: {p}", file=sys.stderr)
else:
    problems = cuda_problems + problems
with open(results, "a") as f:
    f.write(json.dumps({"step": "preflight", "ok": not problems, "problems": problems,
                        **info}) + "\n")
print("pre-flight:", json.dumps(info))
for p in problems:
    print(f"gpu_check: pre-flight FAILED: {p}", file=sys.stderr)
sys.exit(2 if problems else 0)
EOF
rc=$?
if [ "$rc" -ne 0 ]; then
    echo "gpu_check: stopped at the pre-flight (exit 2); nothing else ran" >&2
    emit '{"verdict": "preflight_failed", "exit": 2}'
    exit 2
fi

# The repository keeps transfers/ and storage/ beside asynccache/; installed, they are the
# subpackages asynccache.transfers / asynccache.storage. Nothing is installed here, so run
# from a copy laid out as the installed package.
STAGE=$(mktemp -d /tmp/asynccache_src.XXXXXX)
cp -r asynccache tests scripts pyproject.toml "$STAGE/"
cp -r storage "$STAGE/asynccache/storage"
cp -r transfers "$STAGE/asynccache/transfers"
cd "$STAGE" || exit 2
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import asynccache.cache, asynccache.ranks, asynccache.transfers.engine" \
        >>"$OUT/env.txt" 2>&1; then
    echo "gpu_check: pre-flight FAILED: asynccache does not import (see env.txt)" >&2
    emit '{"step": "import", "ok": false}'
    emit '{"verdict": "preflight_failed", "exit": 2}'
    exit 2
fi

# 2. Every CUDA-marked test (copy engine, cache, buffer-only, hybrid, NCCL on the GPUs there
#    are), none may be skipped.
CUDA_FILES=$(grep -rlE "pytest\.mark\.cuda" tests --include='*.py' | sort | tr '\n' ' ')
[ "$DRY" = 1 ] && CUDA_FILES=tests/transfers/test_cuda.py  # the dry run: one file is enough
# shellcheck disable=SC2086
step pytest_cuda 140 "$OUT/pytest.log" \
    "$PY" -m pytest -q -m cuda -p no:cacheprovider -rs --junitxml="$OUT/pytest.xml" $CUDA_FILES
"$PY" - "$OUT/pytest.xml" "$RESULTS" <<'EOF' || FAILED=1
import json, sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as exc:  # noqa: BLE001 - a killed run leaves no report
    counts = {"report": f"missing: {exc!r}"}
    ok = False
else:
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    ok = counts["tests"] > 0 and not (counts["failures"] or counts["errors"] or counts["skipped"])
with open(sys.argv[2], "a") as f:
    f.write(json.dumps({"pytest_cuda": counts, "ok": ok}) + "\n")
print("pytest_cuda", counts, "ok" if ok else "FAILED (a failure, an error or a skip)")
sys.exit(0 if ok else 1)
EOF

# 3. Copy ratios against the pinned peak (pinned host <-> device copy_ of the same bytes in the
#    same run): D->H, H->D and layer-wise H->D, three models, pages of 16 / 64 / 256 tokens.
# shellcheck disable=SC2086
step bench_transfers 150 "$OUT/bench_transfers.log" \
    "$PY" scripts/bench_transfers.py --device "$DEVICE" $BENCH_ARGS --jsonl "$RESULTS"

# 4. Layer-wise loads overlapped with a compute kernel on the compute stream.
# shellcheck disable=SC2086
step bench_overlap 30 "$OUT/bench_overlap.log" \
    "$PY" scripts/bench_transfers.py --device "$DEVICE" --only-overlap $BENCH_ARGS \
    --jsonl "$RESULTS"

# 4b. A layer-wise load right behind a large backup: separate D->H / H->D lanes vs one lane.
# shellcheck disable=SC2086
step bench_lanes 30 "$OUT/bench_lanes.log" \
    "$PY" scripts/bench_transfers.py --device "$DEVICE" --only-lanes $BENCH_ARGS \
    --jsonl "$RESULTS"

# 5. Event-to-coroutine latency with CUDA events, against a bare call_soon_threadsafe.
step bench_events 30 "$OUT/bench_events.log" \
    "$PY" scripts/bench_bridge.py --events --device "$DEVICE" --jsonl "$RESULTS" \
    $([ "$DRY" = 1 ] && echo --quick)

# 6. Where a copy's fixed cost goes: the engine's calls timestamped and a fixed + bytes / rate
#    fit (probe_dma.py; CUDA only, so not in the dry run).
if [ "$DRY" != 1 ]; then
    step probe_timeline 40 "$OUT/probe_timeline.log" \
        "$PY" scripts/probe_dma.py --reps 4 --only py_timeline timeline blocking \
        --jsonl "$RESULTS"
fi

# Verdict: targets (reported), failures (the exit status).
"$PY" - "$RESULTS" "$FAILED" <<'EOF'
import json, sys

lines = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
failed = sys.argv[2] != "0"
missed = []
for d in lines:
    if "summary" in d:
        for op, e in d["summary"].get("by_op", {}).items():
            if e["cases_below_target"]:
                missed.append(f"{op}: {e['cases_below_target']}/{e['cases']} cases of pages "
                              f">= 256 KiB below 0.8 of the pinned peak (min {e['min_ratio']})")
    if "events" in d and not d["events"]["meets_event_target"]:
        missed.append(f"event-to-coroutine {d['events']['event_ratio']}x a bare round trip "
                      "(target <= 2x)")
    if "overlap" in d:
        print("overlap of layer loads with compute:", d["overlap"]["overlap"])
    if "lanes" in d:
        print("load behind a backup, separate lanes / one lane:",
              d["lanes"]["load_latency_ratio"])
    if "summary" in d and "by_path" in d["summary"]:
        for k, e in d["summary"]["by_path"].items():
            extra = (f"; {e['in_flight_median_ratio']} / {e['in_flight_min_ratio']} with "
                     "copies in flight" if "in_flight_median_ratio" in e else "")
            print(f"copy ratio {k}: median {e['median_ratio']}, min {e['min_ratio']} "
                  f"({e['cases']} cases of pages >= 256 KiB){extra}")
for m in missed:
    print("TARGET MISSED:", m)
verdict = {"verdict": "failed" if failed else "passed", "exit": 1 if failed else 0,
           "targets_missed": missed}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(verdict) + "\n")
print(json.dumps(verdict))
EOF
cat "$OUT/summary.txt"
if [ "$FAILED" -ne 0 ]; then
    echo "gpu_check: FAILED (see above and $RESULTS)" >&2
    exit 1
fi
echo "gpu_check: passed"
