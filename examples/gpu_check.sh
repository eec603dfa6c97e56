#!/usr/bin/env bash
# On a machine with one GPU, torch with CUDA, nvcc and ninja: install shardamp in place, run the
# kernel tests (CPU + CUDA cases) and the step benchmark. Everything is logged to $OUT.
#   OUT=/path/to/results bash examples/gpu_check.sh
set -uo pipefail
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/shardamp_torch_extensions}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
status=0
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvcc --version | tail -2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/env.log"
if ! python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1; then
  # Offline machines may lack what an editable install needs: map the shardamp namespace onto
  # the source tree instead, as setup.py's package_dir does.
  echo "pip install -e . failed (see install.log): importing from the source tree" | tee -a "$OUT/env.log"
  shim="$(mktemp -d)/shim"
  mkdir -p "$shim/shardamp"
  for pkg in optim scaler csrc; do ln -s "$PWD/$pkg" "$shim/shardamp/$pkg"; done
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c 'import shardamp.optim, shardamp.csrc' || exit 1
SHARDAMP_BUILD_VERBOSE=1 python3 -m pytest -q tests/test_kernels.py 2>&1 | tee "$OUT/test_kernels.log" || status=1
python3 examples/bench_step.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/bench_step.log" || status=1
exit $status
