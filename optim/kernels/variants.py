"""What each build of the kernels compiles: its module name, sources and flags. One table for
the just-in-time build (``build.py``) and the ahead-of-time one (``setup.py`` with
``SHARDAMP_BUILD_KERNELS=1``, which loads this file by path: standard library only).

Modules:

* ``shardamp_kernels_cpu`` (baseline x86-64, or any other CPU), ``shardamp_kernels_cpu_avx2``,
  ``shardamp_kernels_cpu_avx512``: the C++ kernels for CPU tensors, one per vector ISA (at::vec's
  ``Vectorized<float>`` is 256 bits under AVX2 and 512 under AVX-512). The run time picks the one
  torch itself runs at on this CPU (``build.cpu_capability``).
* ``shardamp_kernels_cuda``: the same C++ plus the CUDA kernels, for CUDA tensors. Its C++ is
  built for baseline x86-64 whatever the CPU: CPU tensors always go to a CPU module (the
  dispatcher picks the module by the tensors' device type), so one CUDA build serves every CPU.
"""
from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["Variant", "CPU_CAPABILITIES", "CPU_FLAGS", "CPP_SOURCES", "SHARED_CPP_SOURCES", "variant",
           "prebuilt_cpu_capabilities", "x86_64", "source_hash", "nvcc_parallel_flags"]

CPU_CAPABILITIES = ("generic", "avx2", "avx512")

# -O3 and nothing machine-specific except the vector ISA. -ffp-contract=off: no a * b + c fused
# into an FMA, so the step's bits are those of the CUDA build (explicitly rounded intrinsics) and
# of the reference (csrc/common.h).
BASE_CFLAGS = ("-O3", "-ffp-contract=off")
CPU_FLAGS: Dict[str, Tuple[str, ...]] = {
    "generic": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"),
}
# The C++ sources no vector ISA changes (nothing in them is vectorized by hand; the module's
# name is compiled into module.cpp only): an ahead-of-time build compiles them once, with the
# baseline flags, and links those objects into every CPU module (setup.py).
SHARED_CPP_SOURCES = ("binding.cpp", "binding_blockwise.cpp", "grad_stager.cpp", "stager_state.cpp", "land_grads.cpp",
                      "fused_step.cpp", "grad_parts.cpp")
CPP_SOURCES = SHARED_CPP_SOURCES + ("module.cpp", "cpu/fused_adam_cpu.cpp", "cpu/grad_stats_cpu.cpp", "cpu/adam_blockwise_cpu.cpp",
                                     "cpu/step_scalars_cpu.cpp")
# Plain -O3, no --use_fast_math: sqrt and division must stay IEEE-rounded so the kernels agree
# with the reference to fp32 round-off. The -gencode flags are added per build (archs.py).
CUDA_CFLAGS = ("-O3", "-lineinfo")
# nvcc compiles the archs of one file one after the other unless told otherwise: up to this many
# at once (each a cicc + ptxas process, ~1-2 GB for adam_step.cu). Output is the same, so the
# flag stays out of the module name's hash.
NVCC_MAX_THREADS = 8


def nvcc_parallel_flags(gencode: Sequence[str]) -> Tuple[str, ...]:
    """``("--threads", "N")``: compile up to ``N`` of ``gencode``'s targets at once (none for one)."""
    return ("--threads", str(min(len(gencode), NVCC_MAX_THREADS))) if len(gencode) > 1 else ()


@dataclass(frozen=True)
class Variant:
    """One module of the kernels.

    Attributes:
        base: the module's name (a just-in-time build appends a hash of sources and flags).
        cuda: the CUDA kernels are in it.
        cpu_capability: the vector ISA its C++ is compiled for (``generic``, ``avx2``, ``avx512``).
        sources: source files, relative to csrc/.
        cflags: the C++ compiler's flags.
        cuda_cflags: nvcc's flags, without the ``-gencode`` ones.
    """

    base: str
    cuda: bool
    cpu_capability: str
    sources: Tuple[str, ...]
    cflags: Tuple[str, ...]
    cuda_cflags: Tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """``"CPU (AVX-512)"`` / ``"CUDA"``: how messages name it."""
        if self.cuda:
            return "CUDA"
        return "CPU (" + {"generic": "baseline", "avx2": "AVX2", "avx512": "AVX-512"}[self.cpu_capability] + ")"

    def source_paths(self, src: Path) -> List[Path]:
        return [src / s for s in self.sources]


def variant(cuda: bool, cpu_capability: str, src: Path) -> Variant:
    """The module serving ``cuda`` (else CPU) tensors on a CPU of ``cpu_capability``.

    Args:
        cuda: the CUDA module (its C++ is always baseline: see the module's docstring).
        cpu_capability: ``generic``, ``avx2`` or ``avx512``.
        src: the csrc/ directory (the CUDA sources are every ``cuda/*.cu`` in it).

    Returns:
        The :class:`Variant`.

    Raises:
        ValueError: an unknown ``cpu_capability``.
    """
    if cpu_capability not in CPU_FLAGS:
        raise ValueError(f"cpu_capability={cpu_capability!r}: expected one of {', '.join(CPU_CAPABILITIES)}")
    if cuda:
        cu = tuple(sorted(str(p.relative_to(src)) for p in (src / "cuda").glob("*.cu")))
        return Variant("shardamp_kernels_cuda", True, "generic", CPP_SOURCES + cu,
                       BASE_CFLAGS + ("-DSHARDAMP_WITH_CUDA",), CUDA_CFLAGS)
    suffix = "" if cpu_capability == "generic" else f"_{cpu_capability}"
    return Variant("shardamp_kernels_cpu" + suffix, False, cpu_capability, CPP_SOURCES,
                   BASE_CFLAGS + CPU_FLAGS[cpu_capability])


def x86_64() -> bool:
    """This machine is x86-64 (the only ISA with vector variants)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def prebuilt_cpu_capabilities() -> Tuple[str, ...]:
    """Every CPU variant the run time can pick on this kind of machine: all three on x86-64
    (whatever this CPU has: the compiler needs only the flags), ``generic`` elsewhere."""
    return CPU_CAPABILITIES if x86_64() else ("generic",)


def source_hash(src: Path, flags: Any) -> str:
    """12 hex digits over every kernel source under csrc/ (path and bytes) and ``flags``."""
    h = hashlib.sha256(repr(flags).encode())
    for path in sorted(p for p in src.rglob("*") if p.is_file() and p.suffix in (".cpp", ".cu", ".h", ".cuh")):
        h.update(str(path.relative_to(src)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]
