#!/usr/bin/env bash
# Install the real SGLang package (the reference system) CPU-only, for the integration tests
# that decode our KV events with SGLang's own classes. Its wheel pins a CUDA torch and GPU-only
# kernels, so it goes in without its dependencies, followed by the ones its imported modules
# need (all from PyPI; torch stays this machine's build, pinned by constraints.txt).
# Exits non-zero when the import still fails afterwards; .ci/run runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --no-deps "sglang==0.5.23"
python3 -m pip install --quiet -c constraints.txt \
    msgspec pyzmq psutil pybase64 triton starlette aiohttp pydantic orjson requests ipython \
    dill apache-tvm-ffi sentencepiece compressed-tensors gguf \
    2>&1 | grep -v "^sglang .* requires " || true
python3 -c "
from sglang.srt.disaggregation.kv_events import KVEventBatch
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
" || { echo "install_sglang_cpu: SGLang's kv_events / storage factory still do not import" >&2
       exit 1; }
# The host pools and the radix tree reach SGLang's vision configs, which import torchvision at
# module level (never installed here: its wheel needs another torch); the tests and scripts
# import them under asynccache's stand-in for it (asynccache/integrations/sglang_import_guard.py).
python3 -c "
from asynccache.integrations.sglang_import_guard import missing_package_stand_in
with missing_package_stand_in():
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.radix_cache import RadixCache
" || { echo "install_sglang_cpu: SGLang's host pool / RadixCache still do not import" >&2
       exit 1; }
echo "install_sglang_cpu: sglang 0.5.23 imports (CPU)"
