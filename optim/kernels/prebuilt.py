"""Kernels compiled into the installed package ahead of time (``SHARDAMP_BUILD_KERNELS=1 pip
install --no-build-isolation .``, see setup.py): found, checked and imported without a compiler,
ninja or an extension directory.

They live in ``shardamp._kernels`` beside ``build_info.json``, which setup.py writes: the full
torch version they were compiled against, the Python and machine, a hash of the kernel sources,
and per module its CPU vector ISA or its CUDA archs (and, for a module left out, why). Before
importing one, its record is checked: another torch, or a GPU none of its archs runs on, raises
``PrebuiltMismatch`` naming both and the fixes (rebuild, or ``SHARDAMP_PREBUILT=0`` to ignore them
and build just in time). Kernels prebuilt from other sources than the installed csrc/ (an
editable install whose sources changed since) are passed over: the just-in-time build runs.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from . import archs as _archs
from .variants import Variant, source_hash

PACKAGE = "shardamp._kernels"
INFO_FILE = "build_info.json"

_info_cache: Dict[str, Any] = {}


class PrebuiltMismatch(RuntimeError):
    """Kernels prebuilt into the package that this process cannot use (another torch, a GPU
    whose arch they lack, or a module that does not import). ``str()`` starts with the cause,
    names both sides and the fixes."""


def directory() -> Optional[Path]:
    """The ``shardamp._kernels`` directory, or None where there is none."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def build_info() -> Optional[Dict[str, Any]]:
    """The record setup.py wrote beside the prebuilt kernels, or None (a plain install: none).

    Raises:
        RuntimeError: the record exists but cannot be read (a broken install: reinstall).
    """
    if "info" not in _info_cache:
        folder = directory()
        path = folder / INFO_FILE if folder is not None else None
        info = None
        if path is not None and path.is_file():
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise RuntimeError(f"shardamp: {path} cannot be read ({exc}): reinstall shardamp, or set "
                                   "SHARDAMP_PREBUILT=0 to ignore the prebuilt kernels") from exc
        _info_cache["info"] = info
    return _info_cache["info"]


def clear_cache() -> None:
    """Forget the cached record (tests)."""
    _info_cache.clear()


def _rebuild_hint() -> str:
    return ("rebuild them against this process's torch (SHARDAMP_BUILD_KERNELS=1 pip install --no-build-isolation "
            "<shardamp source>), or set SHARDAMP_PREBUILT=0 to ignore them and build just in time")


def _module_path(base: str) -> str:
    try:
        spec = importlib.util.find_spec(f"{PACKAGE}.{base}")
    except (ImportError, ValueError):
        spec = None
    return spec.origin if spec is not None and spec.origin else ""


def _verdict(var: Variant, src: Path, gpu: Optional[Tuple[int, str, Tuple[int, int]]]
             ) -> Optional[Tuple[str, str, str]]:
    """``(state, path, detail)``: ``"prebuilt"`` (usable) or ``"unusable"`` (detail: why and the
    fixes); None where there is nothing prebuilt for ``var`` (or it is stale)."""
    info = build_info()
    if info is None:
        return None
    entry = info.get("modules", {}).get(var.base)
    if entry is None:
        return None
    path = _module_path(var.base)
    if not path:
        return None
    import torch

    if info.get("sources") and info["sources"] != source_hash(src, []):
        return None  # built from other sources (an edited editable checkout): build just in time
    where = os.path.dirname(path)
    if info.get("torch") != torch.__version__:
        return ("unusable", path, f"the prebuilt {var.label} kernels in {where} were built for torch {info.get('torch')}, "
                f"and this process runs torch {torch.__version__}: {_rebuild_hint()}")
    if var.cuda:
        built = entry.get("archs", "")
        if gpu is not None:
            runs = any(a.runs_on(gpu[2]) for a in _archs.parse_arch_list(built, "build_info.json archs"))
            if not runs:
                cap = f"{gpu[2][0]}.{gpu[2][1]}"
                return ("unusable", path, f"the prebuilt CUDA kernels in {where} were built for archs {built}, which GPU "
                        f"{gpu[0]} ({gpu[1]}, compute capability {cap}) cannot run: rebuild them with it "
                        f"(TORCH_CUDA_ARCH_LIST=\"{built};{cap}\" SHARDAMP_BUILD_KERNELS=1 pip install "
                        "--no-build-isolation <shardamp source>), or set SHARDAMP_PREBUILT=0 to build just in time "
                        "for this GPU")
        return ("prebuilt", path, f"prebuilt for torch {info['torch']}, archs {built}")
    return ("prebuilt", path, f"prebuilt for torch {info['torch']}")


def check(var: Variant, src: Path, gpu: Optional[Tuple[int, str, Tuple[int, int]]] = None
          ) -> Optional[Tuple[str, str, str]]:
    """Whether ``var`` is prebuilt and usable here, without importing it.

    Args:
        var: the module wanted.
        src: the installed kernel sources (their hash must match the record's).
        gpu: ``(index, name, capability)`` of the GPU it must run on, for the CUDA module.

    Returns:
        ``("prebuilt", path, detail)``, ``("unusable", path, why and the fixes)``, or None where
        nothing usable-or-not is prebuilt for it.
    """
    return _verdict(var, src, gpu)


def skipped(base: str) -> Optional[str]:
    """Why the ahead-of-time build left module ``base`` out (e.g. no nvcc), or None."""
    info = build_info()
    return (info or {}).get("skipped", {}).get(base)


def load(var: Variant, src: Path, gpu: Optional[Tuple[int, str, Tuple[int, int]]] = None) -> Optional[Any]:
    """The prebuilt module for ``var``, or None where there is none (then build just in time).

    Args:
        var: the module wanted.
        src: the installed kernel sources.
        gpu: ``(index, name, capability)`` of the GPU it must run on, for the CUDA module.

    Returns:
        The imported extension module, or None.

    Raises:
        PrebuiltMismatch: it was built for another torch, lacks the GPU's arch, or does not import.
    """
    verdict = _verdict(var, src, gpu)
    if verdict is None:
        return None
    state, path, detail = verdict
    if state != "prebuilt":
        raise PrebuiltMismatch(detail)
    try:
        return importlib.import_module(f"{PACKAGE}.{var.base}")
    except ImportError as exc:
        raise PrebuiltMismatch(f"the prebuilt {var.label} kernels {path} do not import ({exc}): {_rebuild_hint()}") from exc
