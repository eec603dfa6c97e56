#!/usr/bin/env bash
# The multi-GPU checks in one call, on however many GPUs are visible (1, 2, 4 or 8): the CUDA
# tests (NCCL parity and AMP loops, CUDA graphs at world 1 and 2, checkpoint resharding from the
# largest world down), then the scaling benchmark against DDP at 1, 2, 4, 8 ranks up to the GPU
# count. Logs and JSON go to $OUT (default out/multi_gpu); a summary is printed last.
# Knobs: TEST_TIMEOUT, SCALING_TIMEOUT (seconds per world), SCALING_ARGS (bench_scaling.py flags),
# SCALING_WORLDS (default "1 2 4 8", capped at the GPU count; empty: no scaling runs), RUN_TESTS=0.
set -uo pipefail
OUT="${OUT:-out/multi_gpu}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"  # absolute: a relative $OUT must survive the cd
cd "$(dirname "$0")/.."
# NVLink SHARP (multicast) stays off: it is not what these runs test, and results stay
# comparable between hosts that have it and hosts that do not
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
status=0
source benchmarks/gpu_env.sh  # env.log, install (or source-tree shim), kernel build
N="$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
echo "visible GPUs: $N" | tee -a "$OUT/env.log"
if (( N < 1 )); then echo "no GPU visible: nothing to run"; exit 1; fi

# The two tests that expect an error FROM the extension are left out: on the GPU image seen so
# far any C++ exception leaving a JIT-built extension kills Python (csrc/NOTES.md).
# timeout signals its whole process group (-k: SIGKILL 10 s later), so no spawned rank lingers
# on a GPU that the next part needs.
t0=$SECONDS; test_rc=0
if [[ "${RUN_TESTS:-1}" == 1 ]]; then
  timeout -k 10 "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider --durations=8 \
    tests/test_cuda.py tests/test_cuda_graph.py tests/test_cuda_checkpoint.py \
    -m "not native_raises" >"$OUT/tests.log" 2>&1 || test_rc=$?
  tail -40 "$OUT/tests.log"
else
  echo "RUN_TESTS=0: tests skipped" >"$OUT/tests.log"
fi
(( test_rc == 0 )) || status=1
test_s=$((SECONDS - t0))

# About 0.7B params: each world runs in well under a minute. bench_scaling.py's own default
# model (24 x 4096) is for a full-size measurement: SCALING_ARGS="" runs it.
small="--layers 12 --dim 2048 --heads 16 --seq-len 1024 --batch 4 --warmup 2 --iters 5"
SCALING_ARGS="${SCALING_ARGS-$small}"
worlds=(); rcs=()
for K in ${SCALING_WORLDS-1 2 4 8}; do
  (( K > N )) && break
  rc=0
  # python3 -m torch.distributed.run is torchrun, for the same interpreter (and PYTHONPATH)
  # shellcheck disable=SC2086  # SCALING_ARGS is a list of flags
  timeout -k 10 "${SCALING_TIMEOUT:-120}" python3 -m torch.distributed.run --standalone --nproc-per-node "$K" \
    benchmarks/bench_scaling.py --out "$OUT/scaling" $SCALING_ARGS >"$OUT/scaling_w$K.log" 2>&1 || rc=$?
  worlds+=("$K"); rcs+=("$rc")
  (( rc == 0 )) || status=1
  grep -E "^world $K " "$OUT/scaling_w$K.log" || tail -5 "$OUT/scaling_w$K.log"
done

verdict() { case "$1" in 0) echo ok ;; 124|137) echo "TIMED OUT" ;; *) echo "FAILED (exit $1)" ;; esac; }
echo "================ summary: $N GPUs, logs in $OUT"
echo "tests: $(verdict "$test_rc") in ${test_s}s: $(grep -E "passed|failed|error|skipped" "$OUT/tests.log" | tail -1)"
for i in "${!worlds[@]}"; do
  K="${worlds[$i]}"
  echo "scaling world $K: $(verdict "${rcs[$i]}")"
  grep -E "^world $K " "$OUT/scaling_w$K.log" | sed 's/^/  /'
done
exit $status
