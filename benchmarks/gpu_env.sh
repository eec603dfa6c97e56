# Sourced by gpu_session.sh and multi_gpu.sh (from the repository root, with $OUT set): records
# the machine in $OUT/env.log, installs the package (or imports the source tree where an offline
# editable install fails), and builds the CUDA kernels once, before tests or
# several ranks at a time would wait on the build lock.
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/shardamp_ext}" MAX_JOBS="${MAX_JOBS:-16}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u;
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")'; } 2>&1 | tee "$OUT/env.log"
if ! python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1; then
  # the checkout imports as shardamp from its root (shardamp/ links optim/, scaler/, csrc/, ...)
  echo "pip install -e . failed (install.log): importing from the source tree" | tee -a "$OUT/env.log"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c 'import torch; from shardamp.optim import kernels; print("cuda kernels:", kernels.backend(torch.device("cuda")))' 2>&1 | tail -5 | tee -a "$OUT/env.log"
