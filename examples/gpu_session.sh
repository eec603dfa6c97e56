#!/usr/bin/env bash
# Everything the GPU machine checks, in one call: build, the CUDA tests (kernels, NCCL world-1
# parity and AMP loops without host syncs, CUDA graphs), the step benchmark and the overlap
# profile. Logs and JSON go to $OUT (default out/gpu).
set -uo pipefail
OUT="${OUT:-out/gpu}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"  # absolute: a relative $OUT must survive the cd
cd "$(dirname "$0")/.."
status=0
source examples/gpu_env.sh  # env.log, install (or source-tree shim), kernel build
# PARTS picks what runs (default: tests bench overlap): tests (kernels + NCCL + graphs),
# kernel_tests (kernels only), bench, variants (step chunk sizes side by side), profile, overlap
PARTS="${PARTS:-tests bench overlap}"
if [[ " $PARTS " == *" kernel_tests "* ]]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "not empty_and_cached and not rejects_non_fp32" \
    2>&1 | tail -15 | tee "$OUT/kernel_tests.log" || status=1
fi
if [[ " $PARTS " == *" tests "* ]]; then
  # The two tests that expect an error FROM the extension are left out: on the GPU image seen so
  # far (torch 2.11 + g++ 13.3) any C++ exception leaving a JIT-built extension kills Python
  # (csrc/NOTES.md); the library itself never relies on one.
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cuda.py tests/test_cuda_graph.py \
    -k "not empty_and_cached and not rejects_non_fp32" 2>&1 | tail -60 | tee "$OUT/tests.log" || status=1
fi
if [[ " $PARTS " == *" bench "* ]]; then
  timeout 200 python3 examples/bench_step.py --device cuda --iters "${BENCH_ITERS:-30}" --out "$OUT" 2>&1 | tail -30 | tee "$OUT/bench.log" || status=1
fi
if [[ " $PARTS " == *" profile "* ]]; then
  timeout 200 python3 examples/profile_step.py --out "$OUT" 2>&1 | tail -80 | tee "$OUT/profile.log" || status=1
fi
if [[ " $PARTS " == *" variants "* ]]; then
  # the CUDA step's chunk size (SHARDAMP_CUDA_CHUNK, read by optim/kernels.py) side by side
  for c in ${CHUNKS:-4096 8192 16384}; do
    echo "== SHARDAMP_CUDA_CHUNK=$c" | tee -a "$OUT/variants.log"
    SHARDAMP_CUDA_CHUNK=$c timeout 150 python3 examples/bench_step.py --device cuda --iters "${BENCH_ITERS:-30}" \
      --only "${VARIANT_ROWS:-shardamp fp32 graph,shardamp bf16 graph,kernels}" --out "$OUT/chunk_$c" \
      2>&1 | grep -E "graph|kernels|copy" | tee -a "$OUT/variants.log" || status=1
  done
fi
if [[ " $PARTS " == *" overlap "* ]]; then
  timeout 120 python3 examples/profile_overlap.py --out "$OUT" 2>&1 | tail -8 | tee "$OUT/overlap.log" || status=1
fi
exit $status
