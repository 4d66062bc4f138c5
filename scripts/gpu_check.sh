#!/usr/bin/env bash
# The GPU checks of the copy engine and the cache, in one go (about 6-7 minutes at most).
#
# For a session that is lent a CUDA machine (one H200, a 15-minute device budget for the
# session, machine start included). Run from the repository root on the device machine:
#
#     bash scripts/gpu_check.sh            # writes into $OUT (default ./gpu_check_out)
#
# with the device tool's timeout_s at 480 or so: every step has its own limit below, so a
# hanging step cannot eat the budget, and what finished still comes back.
#
# The device image has torch (CUDA), numpy, anyio, aiofiles, msgpack, prometheus-client,
# hypothesis and pytest, but not structlog or pytest-asyncio. Fetch those two as wheels here
# first (pure Python, ~100 KiB), in the repository root:
#
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux2014_x86_64 -d .whl structlog pytest-asyncio
#
# and name `.whl` in the run's `carry`; this script installs them into /tmp/site.
#
# Files it leaves in $OUT (the device tool brings back at most 8):
#   summary.txt                one line per step: name, exit code, seconds
#   env.txt                    nvidia-smi, torch / CUDA versions, import checks
#   pytest.log                 pytest -m cuda over the CUDA test files
#   bench_transfers.json/.log  scripts/bench_transfers.py --device cuda (full run, best of 3)
#   bench_cache.json           scripts/bench_cache.py --device cuda, both host layouts (a list)
#   bench_cache.log            its stderr
set -u

OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the checks run from a staged copy (below)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >"$OUT/env.txt" 2>&1 \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The repository keeps transfers/ and storage/ beside asynccache/; installed, they are the
# subpackages asynccache.transfers / asynccache.storage. Nothing is installed on the device
# image, so run from a copy laid out as the installed package.
STAGE=$(mktemp -d /tmp/asynccache_src.XXXXXX)
cp -r asynccache tests scripts pyproject.toml "$STAGE/"
cp -r storage "$STAGE/asynccache/storage"
cp -r transfers "$STAGE/asynccache/transfers"
cd "$STAGE"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

: >"$OUT/summary.txt"
step() {  # step NAME LIMIT_S STDOUT_FILE STDERR_FILE CMD...
    local name=$1 limit=$2 out=$3 err=$4 t0 rc
    shift 4
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" >>"$err"
    timeout -k 10 "$limit" "$@" >>"$out" 2>>"$err"
    rc=$?
    echo "$name rc=$rc s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/summary.txt"
    return $rc
}

# 1. The machine, and whether every module of the CUDA paths imports.
{
    nvidia-smi || true
    "$PY" - <<'EOF'
import importlib, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
missing = []
for mod in ("structlog", "pytest_asyncio", "hypothesis", "anyio", "aiofiles", "msgpack",
            "prometheus_client", "xxhash"):
    try:
        importlib.import_module(mod)
    except ImportError:
        missing.append(mod)
print("missing modules:", missing or "none")
for mod in ("asynccache.transfers.pools", "asynccache.transfers.plan",
            "asynccache.transfers.chunks", "asynccache.transfers.workers",
            "asynccache.transfers.engine", "asynccache.cache", "asynccache"):
    try:
        importlib.import_module(mod)
        print("import", mod, "ok")
    except Exception as exc:  # noqa: BLE001 - report and go on
        print("import", mod, "FAILED", repr(exc))
EOF
} >>"$OUT/env.txt" 2>&1
echo "env rc=0" >>"$OUT/summary.txt"

# 2. The CUDA-marked tests (bit-exact copies, fences, ordering, the cache round trip).
step pytest 180 "$OUT/pytest.log" "$OUT/pytest.log" \
    "$PY" -m pytest -q -m cuda -p no:cacheprovider \
    tests/transfers/test_cuda.py tests/cache/test_cuda.py

# 3. Copy throughput against pinned host <-> device copy_ in the same run.
step bench_transfers 150 "$OUT/bench_transfers.json" "$OUT/bench_transfers.log" \
    "$PY" scripts/bench_transfers.py --device cuda --reps 3

# 4. Cache round trips on a CUDA device pool, both host layouts.
echo "[" >"$OUT/bench_cache.json"
step bench_cache_layer_first 60 "$OUT/bench_cache.json" "$OUT/bench_cache.log" \
    "$PY" scripts/bench_cache.py --device cuda --host-layout layer_first
echo "," >>"$OUT/bench_cache.json"
step bench_cache_page_first 60 "$OUT/bench_cache.json" "$OUT/bench_cache.log" \
    "$PY" scripts/bench_cache.py --device cuda --host-layout page_first
echo "]" >>"$OUT/bench_cache.json"

cat "$OUT/summary.txt"
