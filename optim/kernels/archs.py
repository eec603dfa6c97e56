"""Which CUDA architectures the kernels are compiled for, and what nvcc can compile.

The arch list is written as ``TORCH_CUDA_ARCH_LIST`` is (``torch.utils.cpp_extension``'s parser,
mirrored here and tested against it): ``"8.0;8.6;9.0+PTX"``, space or semicolon separated, ``a``
suffixes (``"9.0a"``) and the named archs of torch's table (``"Ampere"`` -> ``8.0;8.6+PTX``).
Each arch ``X.Y`` gives ``-gencode=arch=compute_XY,code=sm_XY``; ``+PTX`` adds
``-gencode=arch=compute_XY,code=compute_XY`` (PTX the driver compiles for newer GPUs).

Where the list comes from, first match wins (:func:`select`):

1. ``SHARDAMP_CUDA_ARCH`` (same syntax; shardamp's own override),
2. ``TORCH_CUDA_ARCH_LIST`` (unless ``"native"``),
3. the visible GPUs' compute capabilities (each capped at what nvcc compiles), PTX of the highest,
4. with no GPU visible (an ahead-of-time build): :data:`AOT_DEFAULT`, limited to what the
   installed nvcc compiles, PTX of the highest kept.

Scope: compute capability 8.0 (Ampere) and newer; the kernels use ``cp.async`` and bf16, and were
never run below it. An arch below 8.0 in ``SHARDAMP_CUDA_ARCH`` is an error; in
``TORCH_CUDA_ARCH_LIST`` (often set image-wide for other extensions too) it is left out and said
so (:attr:`ArchChoice.dropped`). ROCm builds of torch and aarch64 hosts are not supported by the
build (ROCm: torch's HIP toolchain is not wired up; aarch64: never built or tested).

This module imports only the standard library at load time (torch lazily, inside functions):
``setup.py`` loads it by path for ahead-of-time builds, before shardamp is importable.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["Arch", "ArchChoice", "AOT_DEFAULT", "MIN_CAPABILITY", "parse_arch_list", "select", "nvcc_path",
           "nvcc_version", "nvcc_archs", "unsupported_by_nvcc", "device_capabilities"]

# torch.utils.cpp_extension._get_cuda_arch_flags's table (torch 2.13). Combined names come first:
# the names are replaced as substrings, in this order. tests/test_build_archs.py checks it
# against torch's own parser, so a torch that adds an arch fails that test rather than drifting.
NAMED_ARCHES = OrderedDict([
    ("Kepler+Tesla", "3.7"),
    ("Kepler", "3.5+PTX"),
    ("Maxwell+Tegra", "5.3"),
    ("Maxwell", "5.0;5.2+PTX"),
    ("Pascal", "6.0;6.1+PTX"),
    ("Volta+Tegra", "7.2"),
    ("Volta", "7.0+PTX"),
    ("Turing", "7.5+PTX"),
    ("Ampere+Tegra", "8.7"),
    ("Ampere", "8.0;8.6+PTX"),
    ("Ada", "8.9+PTX"),
    ("Hopper", "9.0+PTX"),
    ("Blackwell+Tegra", "11.0"),
    ("Blackwell", "10.0;10.3;12.0;12.1+PTX"),
])
SUPPORTED_ARCHES = ("3.5", "3.7", "5.0", "5.2", "5.3", "6.0", "6.1", "6.2", "7.0", "7.2", "7.5", "8.0", "8.6",
                    "8.7", "8.9", "9.0", "9.0a", "10.0", "10.0a", "11.0", "11.0a", "10.3", "10.3a", "12.0",
                    "12.0a", "12.1", "12.1a")
_VALID = set(SUPPORTED_ARCHES) | {a + "+PTX" for a in SUPPORTED_ARCHES}

# The ahead-of-time default: Ampere (A100, A10/A40/RTX 30), Ada (L4/L40, RTX 40), Hopper,
# Blackwell datacenter (B200) and consumer (RTX 50), and PTX of the newest for GPUs after them.
AOT_DEFAULT = "8.0;8.6;8.9;9.0;10.0;12.0+PTX"
MIN_CAPABILITY = (8, 0)

# nvcc releases and the newest arch each compiles, for an nvcc too old for --list-gpu-arch
# (added in CUDA 11.0, so in practice never needed) or whose output cannot be read.
_NVCC_NEWEST = [((11, 8), (9, 0)), ((12, 8), (12, 0)), ((12, 9), (12, 1)), ((13, 0), (12, 1))]


@dataclass(frozen=True, order=True)
class Arch:
    """One entry of an arch list: compute capability ``major.minor``, an optional suffix
    (``"a"``: arch-specific features, runs on exactly that capability) and whether PTX is added.

    Attributes:
        major: the capability's major number (9 for Hopper).
        minor: its minor number.
        suffix: ``""`` or ``"a"``.
        ptx: also embed ``compute_XY`` PTX (``+PTX``).
    """

    major: int
    minor: int
    suffix: str = ""
    ptx: bool = False

    @property
    def name(self) -> str:
        """``"9.0a+PTX"``-style, as written in an arch list."""
        return f"{self.major}.{self.minor}{self.suffix}" + ("+PTX" if self.ptx else "")

    @property
    def num(self) -> str:
        """``"90a"``: the digits nvcc's ``compute_``/``sm_`` names use."""
        return f"{self.major}{self.minor}{self.suffix}"

    @property
    def capability(self) -> Tuple[int, int]:
        return (self.major, self.minor)

    def gencode(self) -> List[str]:
        """This arch's nvcc flags, as torch writes them."""
        flags = [f"-gencode=arch=compute_{self.num},code=sm_{self.num}"]
        if self.ptx:
            flags.append(f"-gencode=arch=compute_{self.num},code=compute_{self.num}")
        return flags

    def runs_on(self, capability: Tuple[int, int]) -> bool:
        """Whether a GPU of ``capability`` runs this arch's code: its machine code on the same
        major version and an equal or higher minor (exactly equal for an ``a`` arch), its PTX on
        any capability at or above it (JIT-compiled by the driver)."""
        if self.suffix:
            return capability == self.capability
        if self.ptx and capability >= self.capability:
            return True
        return capability[0] == self.major and capability[1] >= self.minor


def _parse_one(item: str) -> Arch:
    ptx = item.endswith("+PTX")
    version = item[:-4] if ptx else item
    major, minor = version.split(".")
    suffix = minor.lstrip("0123456789")
    return Arch(int(major), int(minor[: len(minor) - len(suffix)]), suffix, ptx)


def parse_arch_list(text: str, variable: str = "TORCH_CUDA_ARCH_LIST") -> List[Arch]:
    """Parse an arch list as ``torch.utils.cpp_extension`` parses ``TORCH_CUDA_ARCH_LIST``.

    Args:
        text: e.g. ``"8.0;8.6;9.0+PTX"``, ``"8.0 9.0a"``, ``"Ampere;Hopper"`` (surrounding
            whitespace ignored; ``"native"`` is not a list: :func:`select` handles it).
        variable: the name the error message gives the value.

    Returns:
        The archs in the order written (duplicates kept; the flags are de-duplicated).

    Raises:
        ValueError: an entry torch would reject (e.g. ``"8.5"``, ``"80"``, an empty entry),
            naming ``variable``, the entry and the accepted forms.
    """
    spec = text.strip().replace(" ", ";")
    for named, archs in NAMED_ARCHES.items():
        spec = spec.replace(named, archs)
    archs = []
    for item in spec.split(";"):
        if item not in _VALID:
            hint = f" (write {item} as {_dotted(item)})" if re.fullmatch(r"\d{2,3}[a-z]?(\+PTX)?", item) else ""
            raise ValueError(
                f"{variable}={text!r}: {item!r} is not a CUDA arch torch knows{hint}. Expected entries "
                "like 8.0, 9.0a or 9.0+PTX (or the names Ampere, Ada, Hopper, Blackwell), separated "
                "by ';' or spaces, e.g. '8.0;8.6;9.0+PTX'")
        archs.append(_parse_one(item))
    return archs


def _dotted(item: str) -> str:
    """``"90a+PTX"`` -> ``"9.0a+PTX"``: the hint for the pre-dotted spelling."""
    m = re.fullmatch(r"(\d+)(\d)([a-z]?)(\+PTX)?", item)
    return f"{m.group(1)}.{m.group(2)}{m.group(3)}{m.group(4) or ''}" if m else item


def gencode_flags(archs: Sequence[Arch]) -> List[str]:
    """The nvcc ``-gencode`` flags of ``archs``, sorted and de-duplicated as torch returns them.

    Args:
        archs: parsed entries (:func:`parse_arch_list`).

    Returns:
        e.g. ``["-gencode=arch=compute_90,code=compute_90", "-gencode=arch=compute_90,code=sm_90"]``.
    """
    return sorted({flag for arch in archs for flag in arch.gencode()})


@dataclass(frozen=True)
class ArchChoice:
    """The archs a CUDA build targets and why.

    Attributes:
        archs: what is compiled (capability order; ``+PTX`` marks the archs with PTX).
        source: where the list came from: ``"SHARDAMP_CUDA_ARCH"``, ``"TORCH_CUDA_ARCH_LIST"``,
            ``"visible GPUs"`` or ``"default"`` (no GPU visible).
        reason: one line for people, e.g. ``"TORCH_CUDA_ARCH_LIST='8.0;9.0+PTX'"`` or
            ``"the visible GPUs: GPU 0: NVIDIA H200 (9.0)"``.
        dropped: entries left out, each with why (below 8.0, or beyond what nvcc compiles).
    """

    archs: Tuple[Arch, ...]
    source: str
    reason: str
    dropped: Tuple[str, ...] = field(default=())

    @property
    def arch_list(self) -> str:
        """The list in ``TORCH_CUDA_ARCH_LIST`` syntax, e.g. ``"8.0;9.0+PTX"``."""
        return ";".join(a.name for a in self.archs)

    def gencode_flags(self) -> List[str]:
        """nvcc's ``-gencode`` flags for this choice (as torch would pass them)."""
        return gencode_flags(self.archs)

    def runs_on(self, capability: Tuple[int, int]) -> bool:
        """Whether code built for this choice runs on a GPU of ``capability``."""
        return any(a.runs_on(capability) for a in self.archs)


def _sorted_unique(archs: Sequence[Arch]) -> List[Arch]:
    """By capability, one entry per capability and suffix, PTX kept where any entry asked for it."""
    merged: Dict[Tuple[int, int, str], Arch] = {}
    for a in archs:
        key = (a.major, a.minor, a.suffix)
        old = merged.get(key)
        merged[key] = Arch(a.major, a.minor, a.suffix, a.ptx or (old is not None and old.ptx))
    return [merged[k] for k in sorted(merged)]


def select(cuda_arch: str = "", environ: Optional[Dict[str, str]] = None,
           capabilities: Optional[Callable[[], List[Tuple[str, Tuple[int, int]]]]] = None,
           nvcc_supported: Optional[Callable[[], Optional[List[Tuple[int, int]]]]] = None) -> ArchChoice:
    """The archs a CUDA build of the kernels targets, and why (see the module's docstring).

    Args:
        cuda_arch: ``SHARDAMP_CUDA_ARCH``'s value (``shardamp.optim.config``'s ``cuda_arch``);
            ``""`` when unset.
        environ: where ``TORCH_CUDA_ARCH_LIST`` is read (default ``os.environ``).
        capabilities: the visible GPUs as ``[(name, (major, minor))]`` (default
            :func:`device_capabilities`; tests pass fakes).
        nvcc_supported: the capabilities nvcc compiles (default :func:`nvcc_archs`; None when
            unknown or no nvcc: nothing is limited).

    Returns:
        The :class:`ArchChoice`.

    Raises:
        ValueError: a malformed list (naming its variable); an arch below 8.0 in
            ``SHARDAMP_CUDA_ARCH``; a list, or visible GPUs, with nothing at 8.0 or above.
    """
    env = os.environ if environ is None else environ
    caps = capabilities or device_capabilities
    supported = nvcc_supported or nvcc_archs
    torch_list = env.get("TORCH_CUDA_ARCH_LIST", "") or ""
    if cuda_arch.strip():
        archs = parse_arch_list(cuda_arch, "SHARDAMP_CUDA_ARCH")
        old = [a.name for a in archs if a.capability < MIN_CAPABILITY]
        if old:
            raise ValueError(
                f"SHARDAMP_CUDA_ARCH={cuda_arch!r}: {', '.join(old)} is below compute capability 8.0, which "
                "shardamp's CUDA kernels need (Ampere or newer); leave it out")
        return ArchChoice(tuple(_sorted_unique(archs)), "SHARDAMP_CUDA_ARCH", f"SHARDAMP_CUDA_ARCH={cuda_arch!r}")
    if torch_list.strip() and torch_list.strip() != "native":
        archs = parse_arch_list(torch_list, "TORCH_CUDA_ARCH_LIST")
        kept = [a for a in archs if a.capability >= MIN_CAPABILITY]
        dropped = tuple(f"{a.name} (below 8.0)" for a in archs if a.capability < MIN_CAPABILITY)
        if not kept:
            raise ValueError(
                f"TORCH_CUDA_ARCH_LIST={torch_list!r} names only archs below compute capability 8.0, which "
                "shardamp's CUDA kernels need: set SHARDAMP_CUDA_ARCH (same syntax, e.g. '8.0;9.0+PTX') "
                "for shardamp alone, or add an arch of 8.0 or newer")
        return ArchChoice(tuple(_sorted_unique(kept)), "TORCH_CUDA_ARCH_LIST",
                          f"TORCH_CUDA_ARCH_LIST={torch_list!r}", dropped)
    visible = caps()
    nvcc = supported()
    if visible:
        too_old = [f"GPU {i}: {name} ({c[0]}.{c[1]}, below 8.0)" for i, (name, c) in enumerate(visible)
                   if c < MIN_CAPABILITY]
        usable = [c for _, c in visible if c >= MIN_CAPABILITY]
        if not usable:
            raise ValueError(
                f"no visible GPU has compute capability 8.0 or newer, which shardamp's CUDA kernels need "
                f"({'; '.join(too_old)}): SHARDAMP_KERNELS=reference runs the pure-PyTorch kernels on them")
        newest = max(nvcc) if nvcc else None
        capped = sorted({min(c, newest) if newest else c for c in usable})
        archs = [Arch(m, n) for m, n in capped]
        archs[-1] = Arch(archs[-1].major, archs[-1].minor, "", True)
        reason = "the visible GPUs: " + "; ".join(f"GPU {i}: {name} ({c[0]}.{c[1]})" for i, (name, c) in enumerate(visible))
        notes = tuple(too_old) + tuple(
            f"{c[0]}.{c[1]} built as {newest[0]}.{newest[1]}+PTX (the newest nvcc compiles)"
            for c in usable if newest and c > newest)
        src = "visible GPUs" + (" (TORCH_CUDA_ARCH_LIST=native)" if torch_list.strip() == "native" else "")
        return ArchChoice(tuple(archs), src, reason, notes)
    archs = parse_arch_list(AOT_DEFAULT, "the default arch list")
    dropped: Tuple[str, ...] = ()
    if nvcc:
        kept = [a for a in archs if a.capability in nvcc]
        dropped = tuple(f"{a.name} (nvcc {_version_text()} does not compile it)" for a in archs
                        if a.capability not in nvcc)
        if not kept:
            raise ValueError(f"nvcc {_version_text()} compiles none of the default archs {AOT_DEFAULT} (it "
                             f"knows {', '.join(f'{m}.{n}' for m, n in sorted(nvcc))}): install CUDA 11.8 or "
                             "newer, or set TORCH_CUDA_ARCH_LIST")
        if not kept[-1].ptx:
            top = kept[-1]
            kept[-1] = Arch(top.major, top.minor, top.suffix, True)
        archs = kept
    return ArchChoice(tuple(archs), "default", f"no GPU visible: the default {AOT_DEFAULT}"
                      + (f" limited to what nvcc {_version_text()} compiles" if dropped else ""), dropped)


def unsupported_by_nvcc(choice: ArchChoice) -> List[str]:
    """The archs of ``choice`` the installed nvcc cannot compile.

    Args:
        choice: what a build would target.

    Returns:
        Their names (``["10.0"]``); empty when nvcc compiles them all, or its list is unknown.
    """
    nvcc = nvcc_archs()
    if not nvcc:
        return []
    return [a.name for a in choice.archs if a.capability not in nvcc]


def device_capabilities() -> List[Tuple[str, Tuple[int, int]]]:
    """The visible GPUs.

    Returns:
        ``[(name, (major, minor))]`` per visible GPU; empty without CUDA (a CPU build of torch,
        no driver or no GPU).
    """
    try:
        import torch

        if not torch.cuda.is_available() or torch.version.cuda is None:
            return []
        return [(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
                for i in range(torch.cuda.device_count())]
    except (ImportError, RuntimeError, AssertionError):
        return []


_nvcc_cache: Dict[str, object] = {}


def nvcc_path() -> Optional[str]:
    """The nvcc a CUDA build uses.

    Returns:
        The executable under torch's ``CUDA_HOME`` (from ``CUDA_HOME``/``CUDA_PATH``, the nvcc on
        ``PATH``, ``/usr/local/cuda``), else the first of those that exists; None where none does.
    """
    home = None
    try:
        from torch.utils import cpp_extension

        home = cpp_extension.CUDA_HOME
    except ImportError:
        pass
    candidates = []
    if home:
        candidates.append(os.path.join(home, "bin", "nvcc"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(on_path)
    candidates.append("/usr/local/cuda/bin/nvcc")
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _run(args: List[str]) -> Optional[str]:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def nvcc_version() -> Optional[Tuple[int, int, int]]:
    """nvcc's release (cached per process).

    Returns:
        e.g. ``(13, 0, 88)``; None without a working nvcc.
    """
    if "version" not in _nvcc_cache:
        path = nvcc_path()
        out = _run([path, "--version"]) if path else None
        m = re.search(r"release (\d+)\.(\d+), V\d+\.\d+\.(\d+)", out or "") or re.search(r"release (\d+)\.(\d+)()", out or "")
        _nvcc_cache["version"] = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None
    return _nvcc_cache["version"]  # type: ignore[return-value]


def _version_text() -> str:
    v = nvcc_version()
    return f"{v[0]}.{v[1]}" if v else "(unknown version)"


def nvcc_archs() -> Optional[List[Tuple[int, int]]]:
    """The compute capabilities the installed nvcc compiles (cached per process).

    Returns:
        Sorted ``(major, minor)`` pairs from ``nvcc --list-gpu-arch``; for an nvcc that cannot
        list them, every arch of torch's table up to the newest its release knows; None without
        nvcc.
    """
    if "archs" not in _nvcc_cache:
        path = nvcc_path()
        archs: Optional[List[Tuple[int, int]]] = None
        if path:
            out = _run([path, "--list-gpu-arch"])
            found = re.findall(r"compute_(\d+)(\d)\b", out or "")
            if found:
                archs = sorted({(int(a), int(b)) for a, b in found})
            elif nvcc_version() is not None:
                v = nvcc_version()[:2]  # type: ignore[index]
                newest = max((top for rel, top in _NVCC_NEWEST if rel <= v), default=(8, 6))
                archs = sorted({a.capability for a in map(_parse_one, SUPPORTED_ARCHES) if a.capability <= newest})
        _nvcc_cache["archs"] = archs
    return _nvcc_cache["archs"]  # type: ignore[return-value]


def clear_cache() -> None:
    """Forget nvcc's cached version and arch list (tests)."""
    _nvcc_cache.clear()
