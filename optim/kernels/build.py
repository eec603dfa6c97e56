"""The compiled kernels: prebuilt into the installed package (``prebuilt.py``), else built just in
time from csrc/ through ``torch.utils.cpp_extension.load``.

Which module serves which tensors, and with which flags: ``variants.py``; which CUDA archs:
``archs.py``. A just-in-time build goes to ``<root>/shardamp-py<ver>-torch<ver>/<name>``,
``<root>`` being ``TORCH_EXTENSIONS_DIR`` or torch's default extension cache; the module name
ends in a hash of every kernel source and flag (the CUDA archs included), so two checkouts with
different kernels never share a build directory (nor a loaded module).

Concurrent processes (pytest-xdist workers, ranks of one job) build once: they serialise on an
``flock`` of ``shardamp-build.lock`` in that directory, which the OS releases when its holder dies,
so a killed build never blocks the next one. A ``lock`` file that torch's own loader left behind
(a build killed midway) is found stale under that flock and removed with a warning naming it.

What a person sees (stderr, one line each): the process that builds says what, for which device
and archs, where, and about how long, before it starts, then how long it took; a process that
waits for another's build says so once, naming the lock file, after ``WAIT_REPORT_S`` seconds. A
build that fails raises :class:`BuildError`, whose message starts with the cause (no C++
compiler, no nvcc, an arch nvcc cannot compile, no disk space, a compile error).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .. import config
from . import archs as _archs
from . import prebuilt
from .prebuilt import PrebuiltMismatch
from .variants import Variant, nvcc_parallel_flags, source_hash, variant, x86_64

WAIT_REPORT_S = 2.0  # a process waiting this long for another's build says so (once)

# What the messages promise (measured: CPU on 2 cores of a shared machine, 45-90 s; CUDA, one
# arch, on a 16-core H200 host: see benchmarks/gpu_build_check.sh).
CPU_BUILD_TIME = "about 45-90 s on 2 cores, less on more"
CUDA_BUILD_TIME = "about 1 minute on 16 cores for one arch, 1.5 for six; several on a few cores"

_loaded: Dict[bool, Any] = {}


def _x86_64() -> bool:  # kept for callers of the old name
    return x86_64()


def source_dir() -> Path:
    """csrc/: from the installed package, or next to optim/ in a source tree.

    Raises:
        RuntimeError: neither holds the kernel sources (a broken install).
    """
    try:
        from shardamp.csrc import SOURCE_DIR

        path = Path(SOURCE_DIR)
    except ImportError:
        path = Path(__file__).resolve().parents[2] / "csrc"
    if not (path / "binding.cpp").is_file():
        raise RuntimeError(f"shardamp kernel sources not found in {path}: reinstall shardamp")
    return path


def cpu_capability() -> str:
    """Which CPU build of the kernels to use: the vector ISA torch itself runs at on this CPU
    (``"avx512"``, ``"avx2"``) or ``"generic"`` (baseline x86-64 / other architectures).
    ``SHARDAMP_CPU_CAPABILITY=generic|avx2|avx512`` lowers it (never above what torch reports)."""
    if not x86_64():
        return "generic"
    try:
        import torch

        torch_cap = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "generic")
    except (AttributeError, RuntimeError):
        torch_cap = "generic"
    order = ["generic", "avx2", "avx512"]
    asked = config.settings().cpu_capability or torch_cap
    return order[min(order.index(asked), order.index(torch_cap))]


def cuda_archs() -> _archs.ArchChoice:
    """The CUDA archs a build here targets and why (``SHARDAMP_CUDA_ARCH``, else
    ``TORCH_CUDA_ARCH_LIST``, else the visible GPUs, else the ahead-of-time default).

    Raises:
        ValueError: a malformed arch list, naming its variable (see ``archs.select``).
    """
    return _archs.select(config.settings().cuda_arch)


def current_variant(cuda: bool) -> Variant:
    """The module that serves ``cuda`` (else CPU) tensors in this process.

    Args:
        cuda: the CUDA module, else the CPU one for this CPU's vector ISA.

    Returns:
        Its :class:`Variant` (name, sources, flags).
    """
    return variant(cuda, cpu_capability(), source_dir())


class BuildError(RuntimeError):
    """A build of the kernels that failed or cannot start. ``str()`` starts with the cause.

    Attributes:
        cause: one sentence: what went wrong (``"no C++ compiler: ..."``).
        log: the compiler's output or the underlying error's text (may be long).
    """

    def __init__(self, cause: str, log: str = "") -> None:
        super().__init__(cause)
        self.cause = cause
        self.log = log


def load_extension(cuda: bool, device: Optional[Any] = None) -> Any:
    """The compiled module (``grad_stats``, ``adam_step``, ``build_chunks``, ...) for CPU tensors,
    or for CUDA tensors when ``cuda`` is true: the prebuilt one where the package has it (and
    ``SHARDAMP_PREBUILT`` is not 0), else built just in time (cached on disk).

    Args:
        cuda: the CUDA module (else the CPU one for this CPU's vector ISA).
        device: the CUDA device it must run on (default: the current one); its arch is checked
            against the build's.

    Returns:
        The loaded extension module (cached for the process).

    Raises:
        PrebuiltMismatch: the prebuilt module was built for another torch, or lacks this GPU's arch.
        BuildError: the just-in-time build failed or cannot start (the message starts with why).
        ValueError: a malformed ``SHARDAMP_CUDA_ARCH`` / ``TORCH_CUDA_ARCH_LIST``.
    """
    if cuda in _loaded:
        return _loaded[cuda]
    src = source_dir()
    var = variant(cuda, cpu_capability(), src)
    gpu = _gpu(device) if cuda else None
    module = prebuilt.load(var, src, gpu) if config.settings().prebuilt else None
    if module is None:
        module = _jit(var, src, gpu)
    _loaded[cuda] = module
    return module


def _gpu(device: Optional[Any]) -> Optional[Tuple[int, str, Tuple[int, int]]]:
    """``(index, name, capability)`` of the CUDA device the module must serve, or None where
    CUDA is unavailable (the build then targets the ahead-of-time default)."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = getattr(device, "index", None)
    if index is None:
        index = torch.cuda.current_device()
    return index, torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))


def jit_name(var: Variant, gencode: List[str], src: Path) -> str:
    """The just-in-time module's name.

    Args:
        var: the module.
        gencode: nvcc's ``-gencode`` flags (CUDA; empty for CPU).
        src: the kernel sources.

    Returns:
        ``<variant name>_<12 hex digits over the sources and every flag>``.
    """
    extra: Dict[str, Any] = {"extra_cuda_cflags": [*var.cuda_cflags, *gencode]} if var.cuda else {}
    return f"{var.base}_{source_hash(src, [list(var.cflags), extra])}"


def _jit(var: Variant, src: Path, gpu: Optional[Tuple[int, str, Tuple[int, int]]]) -> Any:
    import torch
    from torch.utils.cpp_extension import load

    if var.cuda and getattr(torch.version, "hip", None):
        raise BuildError(f"an unsupported platform: torch {torch.__version__} is a ROCm build, and shardamp's GPU "
                         "kernels are CUDA only; set SHARDAMP_KERNELS=reference")
    choice = cuda_archs() if var.cuda else None
    gencode = choice.gencode_flags() if choice is not None else []
    if choice is not None and gpu is not None and not choice.runs_on(gpu[2]):
        raise BuildError(
            f"an unsupported arch: GPU {gpu[0]} ({gpu[1]}) has compute capability {gpu[2][0]}.{gpu[2][1]}, which "
            f"the arch list {choice.arch_list} ({choice.reason}) does not run on; add {gpu[2][0]}.{gpu[2][1]} to "
            f"{'SHARDAMP_CUDA_ARCH' if choice.source == 'SHARDAMP_CUDA_ARCH' else 'TORCH_CUDA_ARCH_LIST'}")
    name = jit_name(var, gencode, src)
    build_dir = build_directory(name)
    with build_lock(build_dir, var.label):
        if os.path.exists(os.path.join(build_dir, name + ".so")):
            return _load_jit(load, var, src, name, build_dir, gencode)  # built before: a quick load
        preflight(var, build_dir, choice)
        _say(f"building the {var.label} kernels {_target(var, gpu, choice)} into {build_dir} "
             f"({CUDA_BUILD_TIME if var.cuda else CPU_BUILD_TIME}; once per torch version and kernel source; "
             "prebuilt kernels skip it: python -m shardamp.report)")
        start = time.monotonic()
        try:
            module = _load_jit(load, var, src, name, build_dir, gencode)
        except Exception as exc:
            raise BuildError(diagnose(exc, var), _text(exc)) from exc
        _say(f"built the {var.label} kernels in {time.monotonic() - start:.0f} s")
        return module


def _load_jit(load: Any, var: Variant, src: Path, name: str, build_dir: str, gencode: List[str]) -> Any:
    kwargs: Dict[str, Any] = {
        "extra_cuda_cflags": [*var.cuda_cflags, *gencode, *nvcc_parallel_flags(gencode)]} if var.cuda else {}
    return load(
        name=name,
        sources=[str(p) for p in var.source_paths(src)],
        extra_cflags=list(var.cflags),
        extra_include_paths=[str(src)],
        with_cuda=var.cuda,
        build_directory=build_dir,
        verbose=config.settings().build_verbose,
        **kwargs,
    )


def _target(var: Variant, gpu: Optional[Tuple[int, str, Tuple[int, int]]], choice: Optional[_archs.ArchChoice]) -> str:
    import torch

    if not var.cuda:
        return f"for this CPU and torch {torch.__version__}"
    where = f"for GPU {gpu[0]} ({gpu[1]}, {gpu[2][0]}.{gpu[2][1]})" if gpu else "with no GPU visible"
    assert choice is not None
    return f"{where}, archs {choice.arch_list} (from {choice.source}), torch {torch.__version__},"


def _say(message: str) -> None:
    """One line on stderr (shown by default, outside any logging setup)."""
    print(f"shardamp: {message}", file=sys.stderr, flush=True)


def _scripts_folders() -> List[str]:
    """Where this interpreter's environment puts executables: its scripts folder (a venv's bin)
    and, where the user site is on, the user's (``~/.local/bin`` under ``pip install --user``)."""
    import site
    import sysconfig

    folders = [sysconfig.get_path("scripts")]
    if site.ENABLE_USER_SITE:
        folders.append(sysconfig.get_path("scripts", sysconfig.get_preferred_scheme("user")))
    return folders


def environment_ninja() -> Optional[str]:
    """The ninja this interpreter's environment installed (the ``ninja`` package shardamp depends on).

    Returns:
        The executable in one of the environment's scripts folders, or None where none has one.
    """
    for folder in _scripts_folders():
        exe = os.path.join(folder, "ninja")
        if os.path.isfile(exe) and os.access(exe, os.X_OK):
            return exe
    return None


def _ninja_on_path() -> bool:
    """Whether torch's extension build finds ninja, which it runs by name from PATH: where PATH has
    none, the environment's own folder is put first on this process's PATH. A venv's bin is on
    PATH only while the venv is activated (``venv/bin/python train.py`` leaves it off) and
    ``~/.local/bin`` often never is, so an installed ninja would otherwise read as missing."""
    from torch.utils import cpp_extension

    if cpp_extension.is_ninja_available():
        return True
    exe = environment_ninja()
    if exe is None:
        return False
    os.environ["PATH"] = os.path.dirname(exe) + os.pathsep + os.environ.get("PATH", "")
    return cpp_extension.is_ninja_available()


def preflight(var: Variant, build_dir: str, choice: Optional[_archs.ArchChoice]) -> None:
    """The causes of a failed build that can be seen before it starts.

    Raises:
        BuildError: no working C++ compiler, no ninja, no nvcc, an arch nvcc cannot compile, or
            too little free disk space in ``build_dir``.
    """
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        raise BuildError(f"no C++ compiler: {cxx!r} (the CXX variable, default c++) is not on PATH; install "
                         "g++ (e.g. apt-get install g++) or set CXX to one")
    try:
        ok = subprocess.run([path, "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        raise BuildError(f"no working C++ compiler: '{path} --version' failed (CXX={cxx!r}); install g++ or set "
                         "CXX to a working compiler")
    if not _ninja_on_path():
        raise BuildError("no ninja: torch's extension builds need it (none on PATH nor in this environment's "
                         f"scripts folders {', '.join(_scripts_folders())}); pip install ninja")
    if var.cuda:
        nvcc = _archs.nvcc_path()
        if nvcc is None or cpp_extension.CUDA_HOME is None:
            raise BuildError("no nvcc: the CUDA kernels need the CUDA toolkit (nvcc) matching torch's CUDA "
                             "build; install it and set CUDA_HOME to it")
        assert choice is not None
        bad = _archs.unsupported_by_nvcc(choice)
        if bad:
            v = _archs.nvcc_version()
            raise BuildError(
                f"an unsupported arch: nvcc {f'{v[0]}.{v[1]}' if v else ''} at {nvcc} cannot compile {', '.join(bad)} "
                f"(asked by {choice.reason}); use a newer CUDA toolkit or leave them out")
    need = (2 if var.cuda else 0.5) * 2**30
    free = shutil.disk_usage(build_dir).free
    if free < need:
        raise BuildError(f"no disk space: {free / 2**20:.0f} MiB free in {build_dir}, a build needs about "
                         f"{need / 2**30:g} GiB; free some or point TORCH_EXTENSIONS_DIR elsewhere")


def _text(exc: BaseException) -> str:
    parts = [str(exc)]
    out = getattr(exc, "output", None) or getattr(getattr(exc, "__cause__", None), "output", None)
    if isinstance(out, bytes):
        out = out.decode(errors="replace")
    if out and out not in parts[0]:
        parts.append(out)
    return "\n".join(parts)


def diagnose(exc: BaseException, var: Optional[Variant] = None) -> str:
    """One sentence naming why a build failed, from the exception's text (the compiler's log).

    Args:
        exc: what ``torch.utils.cpp_extension.load`` (or setuptools) raised.
        var: the module being built (for CUDA-specific causes).

    Returns:
        ``"no disk space: ..."``, ``"an unsupported arch: ..."``, ``"no nvcc: ..."``,
        ``"no C++ compiler: ..."``, ``"no ninja: ..."``, ``"a compile error: <first error>"``, or
        ``"the build failed: <first line>"``.
    """
    text = _text(exc)
    low = text.lower()
    if "no space left on device" in low or getattr(exc, "errno", None) == 28:
        return "no disk space: the build ran out of it (No space left on device); free some or point " \
               "TORCH_EXTENSIONS_DIR elsewhere"
    m = re.search(r"unsupported gpu architecture '?([\w.]+)'?", text, re.IGNORECASE)
    if m:
        return f"an unsupported arch: nvcc cannot compile {m.group(1)}; set TORCH_CUDA_ARCH_LIST to archs it knows " \
               "(nvcc --list-gpu-arch) or install a newer CUDA toolkit"
    if "cuda_home" in low or re.search(r"nvcc['\"]?:? (command )?not found|no such file or directory: '?[^ ]*nvcc", low):
        return "no nvcc: the CUDA toolkit was not found; install it and set CUDA_HOME"
    if "ninja is required" in low:
        return "no ninja: torch's extension builds need it; pip install ninja"
    m = re.search(r"(?:^|[\s/])(c\+\+|g\+\+|gcc|cc|clang\+\+)[:']? (?:command )?not found", low) or re.search(
        r"no such file or directory: '([^']*(?:c\+\+|g\+\+|gcc|clang))'", low)
    if m:
        return f"no C++ compiler: {m.group(1)} was not found; install g++ or set CXX"
    # gcc/clang "file:3:1: error: ...", nvcc "file.cu(12): error: ...", "fatal error", the linker's
    errors = [ln.strip() for ln in text.splitlines()
              if re.search(r"(: |^)(fatal )?error\b|undefined reference|ld returned", ln.strip())]
    first_line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    if errors and "Error building extension" in text:
        return f"a compile error: {errors[0][:300]}"
    if "Error building extension" in text:
        return "the compiler failed without a message (is CXX a working C++ compiler?); SHARDAMP_BUILD_VERBOSE=1 " \
               "shows its command lines"
    return f"the build failed: {first_line[:300]}"


def build_root() -> str:
    """Where just-in-time builds go (not created here).

    Returns:
        ``TORCH_EXTENSIONS_DIR`` (else torch's default extension root), then
        ``shardamp-py<ver>-torch<ver>``.
    """
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return os.path.join(root, f"shardamp-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}")


def build_directory(name: str) -> str:
    """Where module ``name`` is built (created if missing).

    Args:
        name: the just-in-time module's name (:func:`jit_name`).

    Returns:
        ``build_root()/name``.
    """
    path = os.path.join(build_root(), name)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def build_lock(build_dir: str, what: str = "") -> Iterator[None]:
    """Hold the build directory's flock; inside it, a torch ``lock`` file is stale: remove it.
    A process that waits for it more than ``WAIT_REPORT_S`` seconds says so once (stderr).

    Args:
        build_dir: the module's build directory (holds ``shardamp-build.lock``).
        what: how the wait message names the kernels (``"CPU (AVX2)"``).
    """
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
                    _say(f"waiting for another process to build the {what + ' ' if what else ''}kernels: it holds "
                         f"the lock file {lock_path} (if no such process runs, a stuck one holds it: end it)")
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


def describe(cuda: bool) -> Dict[str, Any]:
    """Where the kernels for ``cuda`` (else CPU) tensors would come from, without building or
    importing anything (``python -m shardamp.report``).

    Returns:
        A dict: ``module`` (the variant's name), ``state`` (``"loaded"``, ``"prebuilt"``,
        ``"built"`` (in the just-in-time cache), ``"missing"`` (a build at first use) or
        ``"unusable"`` (prebuilt for another torch or arch, SHARDAMP_PREBUILT=1)), ``path`` (the
        module file or the build directory), ``detail`` (one line) and, for CUDA, ``archs`` (the
        ArchChoice a build here would use, or the ValueError's text).
    """
    src = source_dir()
    var = variant(cuda, cpu_capability(), src)
    out: Dict[str, Any] = {"module": var.base, "label": var.label}
    choice = None
    if cuda:
        try:
            choice = cuda_archs()
            out["archs"] = choice
        except ValueError as exc:
            out["archs"] = str(exc)
    if cuda in _loaded:
        mod = _loaded[cuda]
        out.update(state="loaded", path=getattr(mod, "__file__", ""), detail="loaded in this process")
        return out
    if config.settings().prebuilt:
        gpu = None
        if cuda:
            try:
                gpu = _gpu(None)
            except RuntimeError:
                gpu = None
        found = prebuilt.check(var, src, gpu)
        if found is not None:
            state, path, detail = found
            out.update(state=state, path=path, detail=detail)
            return out
    gencode = choice.gencode_flags() if choice is not None else []
    if cuda and choice is None:
        out.update(state="missing", path="", detail="no build possible until the arch list is fixed")
        return out
    name = jit_name(var, gencode, src)
    path = os.path.join(build_root(), name)
    if os.path.exists(os.path.join(path, name + ".so")):
        out.update(state="built", path=path, detail="built just in time before (cached)")
    else:
        out.update(state="missing", path=path,
                   detail=f"a just-in-time build at first use ({CUDA_BUILD_TIME if cuda else CPU_BUILD_TIME})")
    return out
