#!/usr/bin/env bash
# The engine checks on a GPU machine: the SGLang tier and the eviction benchmark with every KV
# index tensor on the GPU, as a serving worker holds them (the CPU tier keeps them in host memory).
#
# For a GPU machine with torch + CUDA but no package index: wheels of SGLang 0.5.23, the short
# list it imports, and kvroute itself travel in ./.whl (scripts/gpu_wheels.sh builds them where
# pip works), are installed into /tmp/site, and the results go to $OUT (default ./gpu-check).
# Nothing here needs SGLang's GPU kernels: the radix cache and the KV allocator are plain torch.
#
#   scripts/gpu_engine_check.sh [repeats]      (default 11)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check}"
REPEATS="${1:-11}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
fi
# RLT's per-eviction loops in C, built next to their source if this machine can (else the
# reference loop runs), and next to the installed copy that PYTHONPATH puts first.
if python3 setup.py -q build_ext --inplace >/dev/null 2>&1; then
  [ -d /tmp/site/engine_ext/cache ] && cp engine_ext/cache/_kernels*.so /tmp/site/engine_ext/cache/
else
  echo "no C compiler here: RLT runs its reference loop (engine_ext.cache.rlt_reference)"
fi
# SGLang's CUDA kernel wheels (sgl_kernel, flashinfer, deep_gemm) are too large to travel;
# stand-ins that fail when called let SGLang's modules import (scripts/gpu_kernel_stubs.py).
export PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
RUN_PY='import gpu_kernel_stubs, runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")'

nvidia-smi -L | tee "$OUT/gpu.txt"
python3 -c 'import gpu_kernel_stubs, torch, sglang
from sglang.srt.mem_cache.radix_cache import RadixCache
print("torch", torch.__version__, "sglang", sglang.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(), "stand-ins:", sorted(set(gpu_kernel_stubs.stubbed)))' \
  2>&1 | grep -v -i warn | tee -a "$OUT/gpu.txt"

echo "== engine tier, KV indices on cuda"
KVROUTE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p gpu_kernel_stubs -p no:cacheprovider \
  -W "ignore::UserWarning" tests/engine_sglang 2>&1 | tee "$OUT/engine_tier_cuda.txt" | tail -20

for device in cuda cpu; do
  echo "== eviction benchmark, KV indices on $device"
  timeout 280 python3 -c "$RUN_PY" benchmarks/sglang_eviction.py --device "$device" --repeats "$REPEATS" \
    --floor-repeats 3 --churn-repeats 3 --out "$OUT/sglang_eviction_$device.json" 2>&1 | grep -v -i "warn" | tee "$OUT/eviction_$device.txt"
done
