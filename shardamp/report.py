"""``python -m shardamp.report``: what shardamp runs on here, for bug reports and first-run
checks (like ``python -m torch.utils.collect_env`` and DeepSpeed's ``ds_report``).

Prints the versions (shardamp, Python, torch, CUDA, NCCL, the C++ compiler, ninja, nvcc), the CUDA
archs a build would target and why, per device type whether the kernels are prebuilt, built in
the just-in-time cache or missing and which backend will run, the build directory, and the
``SHARDAMP_*`` settings in force. Builds nothing unless ``--build`` is given; exits 0, or 1 when a
build asked for with ``--build`` fails.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence, TextIO

import shardamp

_WIDTH = 26


def _line(out: TextIO, key: str, value: str) -> None:
    out.write(f"{key:<{_WIDTH}}{value}\n")


def _safe(fn: Callable[[], str]) -> str:
    """A section's text, or the error that kept it from being found (the report never fails)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a report shows what it could not read
        return f"(could not be read: {type(exc).__name__}: {exc})"


def _first_line(args: List[str]) -> Optional[str]:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    text = (done.stdout or done.stderr).strip()
    return text.splitlines()[0] if text else ""


def _install_kind() -> str:
    here = os.path.dirname(os.path.abspath(shardamp.__file__))
    root = os.path.dirname(here)
    if os.path.isfile(os.path.join(root, "setup.py")) and os.path.isfile(os.path.join(root, "csrc", "binding.cpp")):
        return f"from the source tree {root} (an editable install or the checkout itself)"
    return f"installed at {here}"


def _torch() -> str:
    import torch

    parts = [torch.__version__]
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
        if torch.cuda.is_available():
            parts.append(f"{torch.cuda.device_count()} GPU(s) visible")
            try:
                parts.append(f"cuDNN {torch.backends.cudnn.version()}")
            except Exception:  # noqa: BLE001
                pass
        else:
            parts.append("no GPU available")
    elif getattr(torch.version, "hip", None):
        parts.append(f"ROCm {torch.version.hip} (not supported by shardamp's CUDA kernels: the reference runs)")
    else:
        parts.append("CPU-only build")
    return ", ".join(parts)


def _nccl() -> str:
    import torch

    if not torch.version.cuda:
        return "none (CPU-only torch)"
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:  # noqa: BLE001
        return f"not available ({exc})"


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return f"none: {cxx!r} not found (CXX={os.environ.get('CXX', 'unset')}); the just-in-time build needs one"
    version = _first_line([path, "--version"])
    if version is None:
        return f"{path} does not run ('{cxx} --version' failed; CXX={os.environ.get('CXX', 'unset')})"
    return f"{version} ({path}; CXX={os.environ.get('CXX', 'unset')})"


def _ninja() -> str:
    from shardamp.optim.kernels import build

    path = shutil.which("ninja")
    where = ""
    if path is None:
        path, where = build.environment_ninja(), "; not on PATH: the build puts its folder there"
    if path is None:
        return "none (pip install ninja: the just-in-time build needs it)"
    return f"{_first_line([path, '--version']) or '?'} ({path}{where})"


def _nvcc() -> str:
    from shardamp.optim.kernels import archs

    path = archs.nvcc_path()
    if path is None:
        return "none (CUDA kernels can only be prebuilt or built where a CUDA toolkit is installed)"
    v = archs.nvcc_version()
    known = archs.nvcc_archs()
    listed = ", ".join(f"{m}.{n}" for m, n in known) if known else "?"
    return f"{'.'.join(map(str, v)) if v else '?'} at {path}; compiles {listed}"


def _gpus() -> str:
    from shardamp.optim.kernels import archs

    gpus = archs.device_capabilities()
    if not gpus:
        return "none visible"
    return "; ".join(f"{i}: {name} ({c[0]}.{c[1]})" for i, (name, c) in enumerate(gpus))


def _arch_choice() -> str:
    from shardamp.optim.kernels import build

    try:
        choice = build.cuda_archs()
    except ValueError as exc:
        return f"none: {exc}"
    text = f"{choice.arch_list}  ({choice.reason})"
    if choice.dropped:
        text += f"; left out: {', '.join(choice.dropped)}"
    return text


def _backend(state: str, requested: str, cuda: bool, gpu_visible: bool) -> str:
    if requested == "reference":
        return "reference (SHARDAMP_KERNELS=reference)"
    if cuda and not gpu_visible:
        return "none here (no GPU visible)"
    if state in ("loaded", "prebuilt", "built"):
        return "native"
    if state == "unusable":
        return "an error (SHARDAMP_KERNELS=native)" if requested == "native" else "reference, with a warning"
    fallback = "an error" if requested == "native" else "the reference"
    return f"native after a build at first use ({fallback} if it fails)"


def _kernels(out: TextIO) -> None:
    from shardamp.optim import config
    from shardamp.optim.kernels import archs, build, prebuilt

    requested = config.settings().kernels
    gpu_visible = bool(archs.device_capabilities())
    for cuda in (False, True):
        kind = "cuda" if cuda else "cpu"
        try:
            d = build.describe(cuda)
        except Exception as exc:  # noqa: BLE001
            _line(out, f"  {kind}", f"(could not be read: {exc})")
            continue
        where = f" {d['path']}" if d.get("path") else ""
        _line(out, f"  {kind}", f"{d['label']}, module {d['module']}: {d['state']}:{where}")
        _line(out, "", d["detail"])
        why = prebuilt.skipped(d["module"]) if d["state"] in ("missing", "built") else None
        if why:
            _line(out, "", f"not prebuilt: {why}")
        _line(out, "", f"runs: {_backend(d['state'], requested, cuda, gpu_visible)}")


def _prebuilt() -> str:
    from shardamp.optim.kernels import prebuilt

    info = prebuilt.build_info()
    if info is None:
        return "none (a plain install: the kernels are built just in time at first use)"
    mods = ", ".join(sorted(info.get("modules", {})))
    text = f"{prebuilt.directory()}: torch {info.get('torch')}, {mods}"
    cuda = info.get("modules", {}).get("shardamp_kernels_cuda")
    if cuda:
        text += f"; CUDA archs {cuda.get('archs')} (nvcc {cuda.get('nvcc')})"
    if info.get("skipped"):
        text += "; left out: " + ", ".join(f"{k} ({v})" for k, v in info["skipped"].items())
    return text


def _build_dir() -> str:
    from shardamp.optim.kernels import build

    var = "TORCH_EXTENSIONS_DIR=" + os.environ["TORCH_EXTENSIONS_DIR"] if os.environ.get(
        "TORCH_EXTENSIONS_DIR") else "torch's default; TORCH_EXTENSIONS_DIR moves it"
    return f"{build.build_root()}  ({var})"


def _settings(out: TextIO) -> None:
    from shardamp.optim import config

    env = config.environment()
    explicit = config.explicit()
    for var in sorted(config.VARIABLES):
        field = config.VARIABLES[var][0]
        value = getattr(config.settings(), field)
        if field in explicit:
            origin = "configure()"
        elif var in env:
            origin = f"environment: {var}={env[var]!r}"
        else:
            origin = "default"
        out.write(f"  {var:<30}{value!r}  ({origin})\n")
    unknown = sorted(set(env) - set(config.VARIABLES))
    if unknown:
        _line(out, "  unknown variables", ", ".join(unknown) + " (ignored: misspelt?)")


def _build(out: TextIO, which: Sequence[str]) -> int:
    """Build (or load) the kernels for ``which`` device types; 1 if any fails."""
    from shardamp.optim.kernels import build
    from shardamp.optim.kernels.dispatch import failure_cause

    status = 0
    for kind in which:
        start = time.monotonic()
        try:
            module = build.load_extension(cuda=(kind == "cuda"))
        except Exception as exc:  # noqa: BLE001 - reported, exit status 1
            status = 1
            _line(out, f"  build {kind}", f"FAILED: {failure_cause(kind, exc)}")
            log = getattr(exc, "log", "")
            if log:
                out.write("    " + "\n    ".join(log.strip().splitlines()[-30:]) + "\n")
            continue
        _line(out, f"  build {kind}", f"ok in {time.monotonic() - start:.0f} s: {getattr(module, '__file__', module)}")
    return status


def main(argv: Optional[Sequence[str]] = None, out: Optional[TextIO] = None) -> int:
    """Print the report.

    Args:
        argv: the command line (default ``sys.argv[1:]``): ``--build [cpu|cuda ...]`` builds (or
            loads) the kernels first: for the CPU, and CUDA where a GPU is visible, unless named.
        out: where to write (default stdout).

    Returns:
        The exit status: 0, or 1 when a build asked for with ``--build`` failed.
    """
    parser = argparse.ArgumentParser(prog="python -m shardamp.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", nargs="*", choices=["cpu", "cuda"], default=None,
                        help="build (or load) the kernels before reporting: cpu, cuda, or both (default: cpu, and "
                             "cuda where a GPU is visible); exit 1 if a build fails")
    args = parser.parse_args(argv)
    out = out or sys.stdout
    status = 0
    if args.build is not None:
        which = args.build
        if not which:
            from shardamp.optim.kernels import archs

            which = ["cpu"] + (["cuda"] if archs.device_capabilities() else [])
        out.write("builds\n")
        status = _build(out, which)
    _line(out, "shardamp", f"{shardamp.__version__}, {_safe(_install_kind)}")
    _line(out, "python", f"{platform.python_version()} ({sys.executable}), {platform.platform()}")
    _line(out, "torch", _safe(_torch))
    _line(out, "NCCL", _safe(_nccl))
    _line(out, "C++ compiler", _safe(_compiler))
    _line(out, "ninja", _safe(_ninja))
    _line(out, "nvcc", _safe(_nvcc))
    _line(out, "GPUs", _safe(_gpus))
    _line(out, "CUDA archs of a build", _safe(_arch_choice))
    _line(out, "prebuilt kernels", _safe(_prebuilt))
    _line(out, "build directory", _safe(_build_dir))
    out.write("kernels\n")
    try:
        _kernels(out)
    except Exception as exc:  # noqa: BLE001
        _line(out, "  ", f"(could not be read: {exc})")
    out.write("settings (SHARDAMP_*)\n")
    try:
        _settings(out)
    except Exception as exc:  # noqa: BLE001
        _line(out, "  ", f"(could not be read: {exc})")
    return status


def cli() -> None:
    """The ``shardamp-report`` console script: :func:`main`'s exit status."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
