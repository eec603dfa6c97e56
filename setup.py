"""The package's layout and, on request, its kernels compiled ahead of time. Metadata and
dependencies: pyproject.toml; tool settings: setup.cfg.

Layout: ``shardamp/`` is the package (version, ``python -m shardamp.report``, the prebuilt
kernels' folder ``shardamp/_kernels``), and the sub-packages keep their own top-level folders:
``optim/`` is installed as ``shardamp.optim``, ``scaler/`` as ``shardamp.scaler``,
``integrations/`` as ``shardamp.integrations``, and the kernel sources in ``csrc/`` as
``shardamp.csrc`` (package data, compiled just in time at first use).

Kernels ahead of time (like DeepSpeed's ``DS_BUILD_OPS=1`` and apex's ``--cpp_ext``)::

    SHARDAMP_BUILD_KERNELS=1 pip install --no-build-isolation .
    SHARDAMP_BUILD_KERNELS=1 pip wheel --no-build-isolation --no-deps . -w dist

compiles, against the torch installed in this environment (hence ``--no-build-isolation``: pip's
isolated build environment has no torch, and shardamp never makes pip download one), every CPU
module the run time can pick (baseline, AVX2 and AVX-512 on x86-64) and, where torch is a CUDA
build and a CUDA toolkit (nvcc) is found, the CUDA module for ``TORCH_CUDA_ARCH_LIST`` /
``SHARDAMP_CUDA_ARCH``, else the visible GPUs, else 8.0;8.6;8.9;9.0;10.0;12.0+PTX (as far as nvcc
compiles them; ``optim/kernels/archs.py``). They land in ``shardamp/_kernels`` with
``build_info.json`` (torch version, archs), checked before use. Without the variable the install
is pure Python and compiles nothing.
"""
import importlib.util
import json
import os
import platform
import re
import sys
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
SUBPACKAGES = {"optim": "optim", "scaler": "scaler", "integrations": "integrations"}


def _load(name: str, relpath: str):
    """A module of the source tree by path, without importing shardamp (not installed yet)."""
    spec = importlib.util.spec_from_file_location(name, HERE / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _packages():
    packages = ["shardamp", "shardamp._kernels", "shardamp.csrc"]
    for pkg, folder in SUBPACKAGES.items():
        packages += [f"shardamp.{pkg}"] + [f"shardamp.{pkg}.{sub}" for sub in find_packages(str(HERE / folder))]
    return packages


def _fail(message: str) -> None:
    sys.exit(f"\nshardamp setup.py: {message}\n")


def _kernel_extensions():
    """(ext_modules, cmdclass) for SHARDAMP_BUILD_KERNELS=1, else nothing to compile."""
    config = _load("_shardamp_setup_config", "optim/config.py")
    try:
        settings = config.from_environment()
    except ValueError as exc:
        _fail(str(exc))
    if not settings.build_kernels:
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        _fail("SHARDAMP_BUILD_KERNELS=1 compiles the kernels against the torch of this environment, but torch cannot "
              f"be imported here ({exc}). Install torch first, then build without pip's isolated build environment "
              "(which has no torch, and shardamp never makes pip download one):\n"
              "    SHARDAMP_BUILD_KERNELS=1 pip install --no-build-isolation .\n"
              "or leave SHARDAMP_BUILD_KERNELS unset for a pure-Python install (kernels built just in time).")
    if getattr(torch.version, "hip", None):
        _fail("SHARDAMP_BUILD_KERNELS=1: torch is a ROCm build, which shardamp's kernels do not support; leave "
              "SHARDAMP_BUILD_KERNELS unset (the pure-PyTorch reference kernels run on ROCm)")
    variants = _load("_shardamp_setup_variants", "optim/kernels/variants.py")
    archs = _load("_shardamp_setup_archs", "optim/kernels/archs.py")
    src = HERE / "csrc"
    include = [str(src)]
    exts, modules, skipped = [], {}, {}
    # -g0: no debug info in the shipped modules (the Python's own CFLAGS may carry -g).
    # The first CPU module (baseline) compiles every source; the others only those a vector ISA
    # changes, and link the first one's objects of the shared ones (variants.SHARED_CPP_SOURCES).
    shared = [f"csrc/{s}" for s in variants.SHARED_CPP_SOURCES]
    for k, cap in enumerate(variants.prebuilt_cpu_capabilities()):
        var = variants.variant(False, cap, src)
        sources = [f"csrc/{s}" for s in var.sources]
        ext = CppExtension(f"shardamp._kernels.{var.base}", sources if k == 0 else [s for s in sources if s not in shared],
                           include_dirs=include, extra_compile_args={"cxx": [*var.cflags, "-g0"]})
        ext.shares_objects_of = None if k == 0 else exts[0].name  # read by BuildKernels
        exts.append(ext)
        modules[var.base] = {"cuda": False, "cpu_capability": cap}
    nvcc = archs.nvcc_path()
    if not torch.version.cuda:
        skipped["shardamp_kernels_cuda"] = f"torch {torch.__version__} is a CPU-only build"
    elif CUDA_HOME is None or nvcc is None:
        skipped["shardamp_kernels_cuda"] = "no CUDA toolkit (nvcc) was found at build time: set CUDA_HOME"
    else:
        try:
            choice = archs.select(settings.cuda_arch)
        except ValueError as exc:
            _fail(str(exc))
        bad = archs.unsupported_by_nvcc(choice)
        if bad:
            _fail(f"nvcc at {nvcc} cannot compile {', '.join(bad)} ({choice.reason}); set TORCH_CUDA_ARCH_LIST to "
                  "archs it knows (nvcc --list-gpu-arch) or use a newer CUDA toolkit")
        var = variants.variant(True, "generic", src)
        exts.append(CUDAExtension(f"shardamp._kernels.{var.base}", [f"csrc/{s}" for s in var.sources],
                                  include_dirs=include, extra_compile_args={
                                      "cxx": [*var.cflags, "-g0"], "nvcc": [*var.cuda_cflags, *choice.gencode_flags(),
                                              *variants.nvcc_parallel_flags(choice.gencode_flags())]}))
        v = archs.nvcc_version()
        modules[var.base] = {"cuda": True, "archs": choice.arch_list, "arch_source": f"{choice.source}: {choice.reason}",
                             "nvcc": ".".join(map(str, v)) if v else "?"}
        print(f"shardamp: CUDA kernels for archs {choice.arch_list} (from {choice.source}: {choice.reason})",
              file=sys.stderr)
    info = {
        "shardamp": re.search(r'^__version__ = "([^"]+)"', (HERE / "shardamp" / "__init__.py").read_text(), re.M).group(1),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "sources": variants.source_hash(src, []),
        "modules": modules,
        "skipped": skipped,
    }

    class BuildKernels(BuildExtension):
        """torch's BuildExtension, each module in its own temp folder (the CPU variants compile
        the same sources with other flags), the CPU modules after the first linking its objects
        of the shared sources, then build_info.json beside the modules."""

        def build_extension(self, ext):
            temp = self.build_temp
            self.build_temp = os.path.join(temp, ext.name.rsplit(".", 1)[-1])
            owner = getattr(ext, "shares_objects_of", None)
            if owner is not None:
                objects = self.compiler.object_filenames(
                    shared, output_dir=os.path.abspath(os.path.join(temp, owner.rsplit(".", 1)[-1])))
                missing = [o for o in objects if not os.path.exists(o)]
                if missing:
                    _fail(f"building {ext.name}: the shared objects of {owner} are missing ({', '.join(missing)})")
                ext.extra_objects = [*ext.extra_objects, *objects]
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = temp

        def run(self):
            super().run()
            if self.extensions:
                folder = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")

    return exts, {"build_ext": BuildKernels.with_options(use_ninja=True)}


ext_modules, cmdclass = _kernel_extensions()

setup(
    packages=_packages(),
    package_dir={"shardamp": "shardamp", "shardamp.csrc": "csrc",
                 **{f"shardamp.{pkg}": folder for pkg, folder in SUBPACKAGES.items()}},
    package_data={
        "shardamp": ["py.typed"],
        "shardamp.optim": ["py.typed"],
        "shardamp.scaler": ["py.typed"],
        "shardamp.integrations": ["py.typed"],
        "shardamp.csrc": ["*.cpp", "*.h", "cpu/*.cpp", "cpu/*.h", "cuda/*.cu", "cuda/*.cuh", "cuda/*.h"],
    },
    include_package_data=False,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
