#!/usr/bin/env bash
# Install shardamp with its test dependencies and run the whole suite on this machine's CPUs.
# This is the README's test command and exactly what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
# `python` is the one on PATH: an activated venv's, else the system's (either works: tests/environments.py)
python -c 'import sys; print("python:", sys.executable, "(a venv)" if sys.prefix != sys.base_prefix else "(no venv)")'
python -m pip install --quiet torch==2.13.0            # first, so nothing pulls another build
torch_version=$(python -c "import torch; print(torch.__version__)")
# The frameworks (Lightning, accelerate, transformers) come after torch, constrained to the torch
# just installed: none of them may replace it (e.g. with a CUDA build).
constraints=$(mktemp)
echo "torch==${torch_version}" > "$constraints"
python -m pip install --quiet -c "$constraints" -e ".[test,integrations]"
# The docs toolchain: tests/test_docs.py builds the site with `mkdocs build --strict`.
python -m pip install --quiet -c "$constraints" "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings[python]>=0.26"
rm -f "$constraints"
if [ "$(python -c "import torch; print(torch.__version__)")" != "$torch_version" ]; then
    echo "installing the frameworks changed torch (was $torch_version)" >&2
    exit 1
fi
python -m pip show torch | grep -E "^(Name|Version)"
# A private kernel-build directory for this checkout (never a shared cache; see optim/kernels/build.py).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
# Build the C++ kernels once, before pytest-xdist starts its workers.
python -c "import torch; from shardamp.optim import kernels; print('shardamp kernels on cpu:', kernels.backend(torch.device('cpu')))"
# -n 2: one worker per core; loadgroup keeps each spawned process group's cases on one worker.
# pytest exits 5 when it collected no test: set -e turns that into a failure too.
python -m pytest -n 2 --dist loadgroup -q "$@" tests
