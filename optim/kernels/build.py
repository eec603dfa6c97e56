"""Just-in-time build of the fused kernels in csrc/ through ``torch.utils.cpp_extension.load``.

Built with ninja on first use into ``<root>/shardamp-py<ver>-torch<ver>/<name>``, ``<root>`` being
``TORCH_EXTENSIONS_DIR`` or torch's default extension cache. The module name ends in a hash of
every kernel source and flag, so two checkouts with different kernels never share a build
directory (nor a loaded module). Concurrent processes (pytest-xdist workers, ranks of one job)
build once: they serialise on an ``flock`` of ``shardamp-build.lock`` in that directory, which the
OS releases when its holder dies, so a killed build never blocks the next one. A ``lock`` file
that torch's own loader left behind (a build killed midway) is found stale under that flock and
removed with a warning naming it; a process waiting for a live build says so, naming the lock,
after ``WAIT_REPORT_S`` seconds. Two modules:
``shardamp_kernels_cpu`` (C++ only, builds without CUDA) and ``shardamp_kernels_cuda`` (the same C++
plus the CUDA kernels, serving CPU and CUDA tensors alike), each with an ``_avx2`` or
``_avx512`` suffix when built for that vector ISA (the one torch itself uses on this CPU).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List

from .. import config

WAIT_REPORT_S = 30.0  # report a wait for another process's build after this long

_loaded: Dict[bool, Any] = {}

# Hopper machine code plus compute_90 PTX, which the driver JIT-compiles on any newer GPU.
# Older GPUs can be added with TORCH_CUDA_ARCH_LIST-style overrides via SHARDAMP_CUDA_ARCH.
_DEFAULT_GENCODE = ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]


def source_dir() -> Path:
    """csrc/: from the installed package, or next to optim/ in a source tree."""
    try:
        from shardamp.csrc import SOURCE_DIR

        path = Path(SOURCE_DIR)
    except ImportError:
        path = Path(__file__).resolve().parents[2] / "csrc"
    if not (path / "binding.cpp").is_file():
        raise RuntimeError(f"shardamp kernel sources not found in {path}")
    return path


def _cuda_gencode() -> List[str]:
    archs = config.settings().cuda_arch.replace(",", ";").split(";")
    archs = [a.strip().replace(".", "") for a in archs if a.strip()]
    if not archs:
        return list(_DEFAULT_GENCODE)
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    return flags + [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]


def _x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_capability() -> str:
    """Which CPU build of the kernels to use: the vector ISA torch itself runs at on this CPU
    ("avx512", "avx2") or "generic" (baseline x86-64 / other architectures).
    SHARDAMP_CPU_CAPABILITY=generic|avx2|avx512 lowers it (never above what torch reports)."""
    if not _x86_64():
        return "generic"
    try:
        import torch

        torch_cap = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "generic")
    except (AttributeError, RuntimeError):
        torch_cap = "generic"
    order = ["generic", "avx2", "avx512"]
    asked = config.settings().cpu_capability or torch_cap
    return order[min(order.index(asked), order.index(torch_cap))]


# at::vec's Vectorized<float> is 256 bits under CPU_CAPABILITY_AVX2 and 512 under _AVX512; each
# build gets its own module name, so a shared extension cache never hands it to a CPU without it.
_CPU_FLAGS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
}


def load_extension(cuda: bool):
    """The compiled module (``grad_stats``, ``adam_step``, ``build_chunks``) for CPU tensors,
    or for CUDA and CPU tensors when ``cuda`` is true. Raises if the toolchain is missing."""
    if cuda in _loaded:
        return _loaded[cuda]
    from torch.utils.cpp_extension import load

    src = source_dir()
    sources = [src / "binding.cpp", src / "grad_stager.cpp", src / "land_grads.cpp",
               src / "cpu" / "fused_adam_cpu.cpp", src / "cpu" / "step_scalars_cpu.cpp"]
    # -O3 and nothing machine-specific except the vector ISA torch itself uses on this CPU
    # (AVX2+FMA or AVX-512), each under its own module name.
    cap = cpu_capability()
    # -ffp-contract=off: no a * b + c fused into an FMA, so the step's bits are those of the
    # CUDA build (explicitly rounded intrinsics) and of the reference (csrc/common.h).
    cflags = ["-O3", "-ffp-contract=off", *_CPU_FLAGS[cap]]
    suffix = "" if cap == "generic" else f"_{cap}"
    kwargs: Dict[str, Any] = {}
    if cuda:
        sources += sorted((src / "cuda").glob("*.cu"))
        cflags.append("-DSHARDAMP_WITH_CUDA")
        # Plain -O3, no --use_fast_math: sqrt and division must stay IEEE-rounded so the kernels
        # agree with the reference to fp32 round-off.
        kwargs["extra_cuda_cflags"] = ["-O3", "-lineinfo", *_cuda_gencode()]
    base = ("shardamp_kernels_cuda" if cuda else "shardamp_kernels_cpu") + suffix
    name = f"{base}_{source_hash(src, [cflags, kwargs])}"
    build_dir = build_directory(name)
    with build_lock(build_dir):
        module = load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=cflags,
            extra_include_paths=[str(src)],
            with_cuda=cuda,
            build_directory=build_dir,
            verbose=config.settings().build_verbose,
            **kwargs,
        )
    _loaded[cuda] = module
    return module


def source_hash(src: Path, flags: Any) -> str:
    """12 hex digits over every file under csrc/ (path and bytes) and the build flags."""
    h = hashlib.sha256(repr(flags).encode())
    for path in sorted(p for p in src.rglob("*") if p.is_file() and p.suffix in (".cpp", ".cu", ".h", ".cuh")):
        h.update(str(path.relative_to(src)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def build_directory(name: str) -> str:
    """Where ``name`` is built: per Python and torch version, under TORCH_EXTENSIONS_DIR or
    torch's default extension root; created if missing."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    tag = f"shardamp-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    path = os.path.join(root, tag, name)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def build_lock(build_dir: str) -> Iterator[None]:
    """Hold the build directory's flock; inside it, a torch ``lock`` file is stale: remove it."""
    lock_path = os.path.join(build_dir, "shardamp-build.lock")
    with open(lock_path, "a") as f:
        start, reported = time.monotonic(), False
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not reported and time.monotonic() - start > WAIT_REPORT_S:
                    reported = True
                    warnings.warn(f"shardamp: waiting for another process that is building the kernels in "
                                  f"{build_dir} (it holds {lock_path}); if none is running, that file's flock "
                                  "is held by a stuck process: end it.", RuntimeWarning, stacklevel=4)
                time.sleep(0.2)
        try:
            torch_lock = os.path.join(build_dir, "lock")
            if os.path.exists(torch_lock):  # no live shardamp build holds our flock: left by a killed build
                warnings.warn(f"shardamp: removing the stale build lock {torch_lock} left by a build that was "
                              "killed; rebuilding.", RuntimeWarning, stacklevel=4)
                os.remove(torch_lock)
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
