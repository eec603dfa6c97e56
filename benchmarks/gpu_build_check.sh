#!/usr/bin/env bash
# The kernel builds on a GPU machine (one GPU, nvcc, torch; offline): what nvcc compiles, how long
# each build takes, and the CUDA tests on prebuilt kernels and on a PTX-only build. Everything
# goes to $OUT (default out/gpu_build): summary.txt (one line per part: seconds, status), a log
# per part, nvcc_archs.txt, report_*.txt.
#
# Parts (PARTS="archs jit_cpu ...", default: all that fit one call, see below), in this order:
#   archs          nvcc --version / --list-gpu-arch, the GPU, python -m shardamp.report
#   jit_cpu        (a) the CPU kernels built just in time, into an empty extension directory
#   jit_default    (b) the CUDA kernels built just in time for the visible GPU (9.0+PTX on an H200)
#   jit_all        (c) the CUDA kernels for TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;10.0;12.0+PTX"
#   wheel          (d) SHARDAMP_BUILD_KERNELS=1 pip wheel --no-build-isolation (3 CPU modules + CUDA
#                  for the visible GPU, or WHEEL_ARCHS when set, e.g. WHEEL_ARCHS="8.0;9.0+PTX")
#   tests_prebuilt the wheel installed alone into $WORK/site (built first if this machine has none
#                  in $WORK), the CUDA tests run from outside the source tree on its prebuilt
#                  kernels, with CXX=/bin/false and an empty extension directory (nothing may be built)
#   tests_ptx      TORCH_CUDA_ARCH_LIST="8.0+PTX": a JIT build with no sm_90 code (the driver
#                  JIT-compiles the compute_80 PTX on the H200), then the CUDA tests on it
# One call must end within 9 minutes: BUDGET (seconds, default 520) caps it, each part gets at
# most what is left (and its own cap), and a part that finds too little left is skipped, marked
# so in summary.txt. The default PARTS is "archs jit_cpu jit_default wheel" (expected 5-8 minutes
# on 16 cores, to be confirmed by the first run: the wheel is skipped if too little is left);
# then, one call each:
#   PARTS=jit_all            PARTS=tests_prebuilt            PARTS=tests_ptx
# (tests_prebuilt reuses the wheel that `wheel` left in $WORK on a warm machine, else builds it.)
# Builds use every core (MAX_JOBS, default nproc). PYTHON picks the interpreter (default python3;
# nothing is installed into it: the JIT parts import the checkout, the prebuilt tests the wheel in
# $WORK/site). CAP_FACTOR scales the parts' own caps on a slower machine. Run from anywhere.
set -uo pipefail
OUT="${OUT:-out/gpu_build}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
REPO="$PWD"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
PY="${PYTHON:-python3}"
WORK="${WORK:-/tmp/shardamp_gpu_build}"
PARTS="${PARTS:-archs jit_cpu jit_default wheel}"
BUDGET="${BUDGET:-520}"
ALL_ARCHS="8.0;8.6;8.9;9.0;10.0;12.0+PTX"
TESTS="tests/test_cuda.py tests/test_cuda_graph.py tests/test_kernels.py tests/test_kernels_light_state.py tests/test_kernels_stats.py"
# As benchmarks/gpu_session.sh: the tests that expect an error FROM the extension (marker
# native_raises) are left out (any C++ exception leaving an extension kills Python on the GPU image
# seen so far, csrc/NOTES.md).
TEST_M="not native_raises"
mkdir -p "$WORK"
status=0
summary="$OUT/summary.txt"
: >"$summary"

CAP_FACTOR="${CAP_FACTOR:-1}"  # scales every part's own cap (a slower machine: e.g. 4)
left() {  # seconds a part may take: its own cap, or what is left of BUDGET
  local rest=$((BUDGET - SECONDS)) cap=$(($1 * CAP_FACTOR))
  echo $((cap < rest ? cap : rest))
}

run_part() {  # run_part NAME CAP MIN_NEEDED COMMAND...: timed, logged, its status in summary.txt
  local name=$1 cap=$2 need=$3
  shift 3
  local limit
  limit=$(left "$cap")
  if ((limit < need)); then
    echo "$name: skipped (${limit} s left of BUDGET=$BUDGET, needs ~${need} s): run it in another call" | tee -a "$summary"
    return
  fi
  echo "== $name (limit ${limit} s)"
  local start=$SECONDS rc
  # the part is a function of this script: run it in a child bash (timeout runs programs only)
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  local took=$((SECONDS - start))
  local verdict=ok
  if ((rc == 124 || rc == 137)); then verdict="TIMED OUT after ${limit} s"; elif ((rc != 0)); then verdict="FAILED (rc $rc)"; fi
  ((rc != 0)) && status=1
  echo "$name: ${took} s, $verdict" | tee -a "$summary"
  tail -n "${TAIL:-6}" "$OUT/$name.log"
}

use_checkout() {  # the JIT parts import the checkout (its root imports as shardamp through the
  # shardamp/ links): nothing is installed into this Python
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
}

jit_build() {  # jit_build cpu|cuda [DIR]: build into DIR (default a fresh, empty one); print the time
  local kind=$1 dir=${2:-}
  [ -n "$dir" ] || dir="$(mktemp -d "$WORK/ext_${kind}_XXXX")"
  TORCH_EXTENSIONS_DIR="$dir" SHARDAMP_PREBUILT=0 SHARDAMP_KERNELS=native "$PY" - "$kind" <<'EOF'
import sys, time, torch
from shardamp.optim.kernels import build
kind = sys.argv[1]
if kind == "cuda":
    choice = build.cuda_archs()
    print("archs:", choice.arch_list, "from", choice.reason, flush=True)
start = time.monotonic()
ext = build.load_extension(cuda=(kind == "cuda"))
print(f"{kind} kernels built in {time.monotonic() - start:.1f} s: {ext.__file__}", flush=True)
if kind == "cuda":  # the module runs on this GPU: one grad_stats launch
    out = torch.zeros(2, device="cuda")
    ext.grad_stats(torch.ones(1000, device="cuda"), out, 2.0)
    torch.cuda.synchronize()
    assert out[0].item() == 1000.0, out
    print("grad_stats on", torch.cuda.get_device_name(), "ok")
EOF
}

part_archs() {
  { command -v nvcc; nvcc --version; echo "--list-gpu-arch:"; nvcc --list-gpu-arch; echo "--list-gpu-code:"; nvcc --list-gpu-code; } \
    >"$OUT/nvcc_archs.txt" 2>&1
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "archs", torch.cuda.get_arch_list(), "GPUs", torch.cuda.device_count())'
  nproc
  use_checkout
  "$PY" -m shardamp.report | tee "$OUT/report_source.txt"
  cat "$OUT/nvcc_archs.txt"
}

part_wheel() {  # (d) the ahead-of-time wheel, into $WORK/dist
  rm -rf "$WORK/dist" "$WORK/src"
  # a copy without build outputs (a checkout's build/ could hold another build's files)
  mkdir -p "$WORK/src" && (cd "$REPO" && tar --exclude=./build --exclude=./dist --exclude='*.egg-info' \
    --exclude=./out --exclude='*.so' --exclude=./.git -cf - .) | (cd "$WORK/src" && tar -xf -)
  local start=$SECONDS
  (cd "$WORK" && env ${WHEEL_ARCHS:+TORCH_CUDA_ARCH_LIST="$WHEEL_ARCHS"} SHARDAMP_BUILD_KERNELS=1 \
    "$PY" -m pip wheel --no-build-isolation --no-deps -v -w "$WORK/dist" "$WORK/src") || return 1
  echo "wheel built in $((SECONDS - start)) s:"
  ls -la "$WORK/dist"
  "$PY" - "$WORK"/dist/shardamp-*.whl <<'EOF'
import json, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
print(json.dumps(json.loads(z.read("shardamp/_kernels/build_info.json")), indent=1))
for n in z.namelist():
    if n.endswith(".so"):
        print(f"{z.getinfo(n).file_size / 2**20:8.1f} MiB  {n}")
EOF
}

install_wheel() {  # the wheel alone in $WORK/site (PYTHONPATH): torch from this Python, no source tree
  # (--target, not a venv: this Python may itself be a venv, e.g. /opt/torch/.venv, whose packages a
  # nested venv would not see, and its base may lack ensurepip)
  rm -rf "$WORK/site"
  "$PY" -m pip install -q --no-deps --no-index --ignore-installed --target "$WORK/site" "$WORK"/dist/shardamp-*.whl
}

part_tests_prebuilt() {
  if ! ls "$WORK"/dist/shardamp-*.whl >/dev/null 2>&1; then
    echo "no wheel in $WORK/dist: building it first"
    part_wheel || return 1
  fi
  install_wheel || return 1
  local ext cwd
  ext="$(mktemp -d "$WORK/ext_empty_XXXX")"
  cwd="$(mktemp -d "$WORK/cwd_XXXX")"
  export PYTHONPATH="$WORK/site" CC=/bin/false CXX=/bin/false TORCH_EXTENSIONS_DIR="$ext" SHARDAMP_KERNELS=native
  (cd "$cwd" && "$PY" -m shardamp.report --build) | tee "$OUT/report_prebuilt.txt" || return 1
  grep -q "^shardamp .*installed at $WORK/site/shardamp" "$OUT/report_prebuilt.txt" || {
    echo "shardamp was not imported from $WORK/site"; return 1; }
  (cd "$cwd" && "$PY" -m pytest -q -p no:cacheprovider -rfE -c "$REPO/setup.cfg" --rootdir "$REPO" \
    $(for t in $TESTS; do echo "$REPO/$t"; done) -m "$TEST_M") || return 1
  if [ -n "$(ls -A "$ext")" ]; then echo "something was built in $ext:"; ls -R "$ext"; return 1; fi
  echo "nothing built: the tests ran on the prebuilt kernels"
}

part_tests_ptx() {
  local ext
  ext="$(mktemp -d "$WORK/ext_ptx_XXXX")"
  export TORCH_EXTENSIONS_DIR="$ext" TORCH_CUDA_ARCH_LIST="8.0+PTX" SHARDAMP_PREBUILT=0
  jit_build cuda "$ext" || return 1  # the tests below load this build from $ext
  cuobjdump --list-elf --list-ptx "$(ls "$ext"/*/*/*.so | head -1)" 2>&1 | head -20
  "$PY" -m pytest -q -p no:cacheprovider -rfE $TESTS -m "$TEST_M"
}

export OUT REPO PY WORK TESTS TEST_M ALL_ARCHS
export -f jit_build part_archs part_wheel install_wheel part_tests_prebuilt part_tests_ptx use_checkout
for part in $PARTS; do
  case $part in
    archs) run_part archs 120 20 part_archs ;;
    jit_cpu) use_checkout; run_part jit_cpu 240 60 jit_build cpu ;;
    jit_default) use_checkout; run_part jit_default 420 120 jit_build cuda ;;
    jit_all) use_checkout; TORCH_CUDA_ARCH_LIST="$ALL_ARCHS" run_part jit_all 520 300 jit_build cuda ;;
    wheel) TAIL=12 run_part wheel 420 180 part_wheel ;;
    tests_prebuilt) TAIL=15 run_part tests_prebuilt 520 240 part_tests_prebuilt ;;
    tests_ptx) use_checkout; TAIL=15 run_part tests_ptx 520 240 part_tests_ptx ;;
    *) echo "unknown part '$part' (parts: archs jit_cpu jit_default jit_all wheel tests_prebuilt tests_ptx)"; status=1 ;;
  esac
done
echo "gpu_build_check: $SECONDS s, status $status (summary: $summary)"
cat "$summary"
exit $status
