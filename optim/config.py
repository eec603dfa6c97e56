"""shardamp's configuration in one place: every ``SHARDAMP_*`` environment variable, parsed once
into one frozen :class:`Settings`.

Precedence, for each setting: an explicit value (a constructor argument of
``DistributedFusedAdam`` where it has one, or :func:`configure`), then the environment, then the
default. The environment is read at the first use of any setting and not again: a change to
``os.environ`` after that takes effect only through :func:`reload` (tests use it). A malformed
value raises ``ValueError`` naming the variable and what it accepts, at that first read.

The variables (``python -m shardamp.report`` prints the ones in force):

========================================  =====================================================
``SHARDAMP_KERNELS``                      ``native`` (the compiled kernels; a failed build
                                          raises), ``reference`` (the pure-PyTorch math), unset:
                                          native where they build, else the reference, warned
``SHARDAMP_PREBUILT``                     ``0``: ignore kernels prebuilt into the installed
                                          package and build just in time (default ``1``)
``SHARDAMP_CUDA_ARCH``                    CUDA archs to build for, ``TORCH_CUDA_ARCH_LIST``'s
                                          syntax; overrides it (default: that variable, else the
                                          visible GPUs)
``SHARDAMP_CPU_CAPABILITY``               ``generic`` / ``avx2`` / ``avx512``: lower the CPU
                                          kernels' vector ISA (never above what torch uses)
``SHARDAMP_BUILD_VERBOSE``                ``1``: show the compiler's output of a build
``SHARDAMP_BUILD_KERNELS``                ``1``: ``pip install --no-build-isolation .`` (or
                                          ``pip wheel``) compiles the kernels into the package
                                          (read by setup.py; default ``0``: a pure-Python
                                          install, the kernels built just in time)
``SHARDAMP_CUDA_CHUNK``                   elements per block of the CUDA step (a tuning knob)
``SHARDAMP_CUDA_STEP``                    the CUDA step's launch shape for the lighter state
                                          kinds (a tuning knob: ``2x1``, ``2x3``, ``c2x4``,
                                          ``1x4``)
``SHARDAMP_COLLECTIVE_TIMEOUT``           seconds a rank waits for a collective its peers never
                                          join before it raises the error naming every rank's
                                          position (default: the process group's timeout)
``SHARDAMP_COLLECTIVE_WATCHDOG``          ``1`` (default: watch CUDA collectives from a
                                          thread), ``0`` (off), ``force`` (also on gloo)
``SHARDAMP_PYTHON_GRAD_HOOKS``            ``1``: land grads through Python hooks instead of the
                                          native ones (slower; the path compiled autograd
                                          traces, and for debugging)
``SHARDAMP_ASYNC_GRAD_RELEASE``           ``0``: free landed CUDA grads inline instead of on the
                                          release thread (default ``1``)
``SHARDAMP_OFFLOAD_THREADS``              threads of an offloaded step's CPU kernels (default
                                          ``0``: the cores this process may use divided by
                                          ``LOCAL_WORLD_SIZE``, at least 1)
``SHARDAMP_SWITCH_PARAM_CLASS``           ``0``: a managed param keeps the class whose ``.grad``
                                          shows the optimizer's grads from construction on
                                          (default ``1``: only while grads are held; see
                                          torch_tools.py)
========================================  =====================================================
"""
from __future__ import annotations

import dataclasses
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional

__all__ = ["Settings", "settings", "reload", "configure", "VARIABLES", "CUDA_STEP_SHAPES"]

# The CUDA step's launch shapes a tuning run may pick, in the order of their codes 1, 2, ...
# (adam_step's ``shape`` argument, csrc/cuda/adam_step.cu).
CUDA_STEP_SHAPES = ("2x1", "2x3", "c2x4", "1x4")


@dataclass(frozen=True)
class Settings:
    """Every setting of shardamp, one field each (see the module's table for the variables).

    Attributes:
        kernels: ``"auto"``, ``"native"`` or ``"reference"`` (``SHARDAMP_KERNELS``).
        prebuilt: use kernels prebuilt into the package when present (``SHARDAMP_PREBUILT``).
        cuda_arch: the CUDA arch list to build for, ``""`` when unset (``SHARDAMP_CUDA_ARCH``).
        cpu_capability: ``""`` (torch's own), ``"generic"``, ``"avx2"`` or ``"avx512"``.
        build_verbose: show the compiler's output (``SHARDAMP_BUILD_VERBOSE``).
        build_kernels: setup.py compiles the kernels into the package (``SHARDAMP_BUILD_KERNELS``;
            read at install time only).
        cuda_chunk: elements per block of the CUDA step, 0 for each kind's default.
        cuda_step: the CUDA step's launch shape for the lighter kinds, ``""`` for their own.
        collective_timeout: seconds before a collective the peers never join raises; None: the
            process group's timeout applies.
        collective_watchdog: ``"on"``, ``"off"`` or ``"force"``.
        python_grad_hooks: land grads through Python hooks even where native ones exist (the
            path compiled autograd traces: the native hooks are opaque to it).
        async_grad_release: free landed CUDA grads on the release thread (else inline).
        copy_grads: one process, land every grad in its bucket's flat shard (a copy)
            even where the step could read it where autograd left it (``SHARDAMP_COPY_GRADS``:
            for A/B measurements and to rule the zero-copy landing out).
        offload_threads: threads of an offloaded step's CPU kernels, 0 for the cores divided by
            the ranks on the host (docs/offload.md).
        switch_param_class: a managed param has its own class while its optimizer holds no grads
            (``SHARDAMP_SWITCH_PARAM_CLASS``; off: the ``.grad``-showing class from construction
            on, so a ``torch.compile``'d forward of a gradient-accumulation loop sees one class and
            compiles one graph, not two).
    """

    kernels: str = "auto"
    prebuilt: bool = True
    cuda_arch: str = ""
    cpu_capability: str = ""
    build_verbose: bool = False
    build_kernels: bool = False
    cuda_chunk: int = 0
    cuda_step: str = ""
    collective_timeout: Optional[float] = None
    collective_watchdog: str = "on"
    python_grad_hooks: bool = False
    async_grad_release: bool = True
    offload_threads: int = 0
    copy_grads: bool = False
    switch_param_class: bool = True


def _flag(name: str, value: str, default: bool) -> bool:
    v = value.strip().lower()
    if v == "":
        return default
    if v in ("1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{name}={value!r}: expected 1 or 0 (or unset for the default, {int(default)})")


def _kernels(name: str, value: str) -> str:
    v = value.strip().lower() or "auto"
    if v not in ("auto", "native", "reference"):
        raise ValueError(f"{name}={value!r}: expected 'native', 'reference' or unset")
    return v


def _cpu_capability(name: str, value: str) -> str:
    v = value.strip().lower()
    if v not in ("", "generic", "avx2", "avx512"):
        raise ValueError(f"{name}={value!r}: expected generic, avx2 or avx512")
    return v


def _cuda_chunk(name: str, value: str) -> int:
    v = value.strip()
    if not v:
        return 0
    if not v.isdigit() or not 0 < int(v) < 2**31:
        raise ValueError(f"{name}={value!r}: expected a positive number of elements (e.g. 4096), "
                         "or unset for the default")
    return int(v)


def _cuda_step(name: str, value: str) -> str:
    if value and value not in CUDA_STEP_SHAPES:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(CUDA_STEP_SHAPES)}, "
                         "or unset for each kind's own shape")
    return value


def _threads(name: str, value: str) -> int:
    v = value.strip()
    if not v:
        return 0
    if not v.isdigit():
        raise ValueError(f"{name}={value!r}: expected a number of threads >= 1, or 0 / unset for the cores "
                         "divided by LOCAL_WORLD_SIZE")
    return int(v)


def _timeout(name: str, value: str) -> Optional[float]:
    v = value.strip()
    if not v:
        return None
    try:
        seconds = float(v)
    except ValueError:
        seconds = -1.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name}={value!r}: expected a number of seconds > 0")
    return seconds


def _watchdog(name: str, value: str) -> str:
    v = value.strip().lower()
    if v in ("", "1", "on"):
        return "on"
    if v in ("0", "off"):
        return "off"
    if v == "force":
        return "force"
    raise ValueError(f"{name}={value!r}: expected 1 (default: watch CUDA collectives), 0 (off) or force "
                     "(also on gloo CPU groups, in place of the bounded host waits)")


# variable -> (field, parser)
VARIABLES: Dict[str, tuple] = {
    "SHARDAMP_KERNELS": ("kernels", _kernels),
    "SHARDAMP_PREBUILT": ("prebuilt", lambda n, v: _flag(n, v, True)),
    "SHARDAMP_CUDA_ARCH": ("cuda_arch", lambda n, v: v.strip()),
    "SHARDAMP_CPU_CAPABILITY": ("cpu_capability", _cpu_capability),
    "SHARDAMP_BUILD_VERBOSE": ("build_verbose", lambda n, v: _flag(n, v, False)),
    "SHARDAMP_BUILD_KERNELS": ("build_kernels", lambda n, v: _flag(n, v, False)),
    "SHARDAMP_CUDA_CHUNK": ("cuda_chunk", _cuda_chunk),
    "SHARDAMP_CUDA_STEP": ("cuda_step", _cuda_step),
    "SHARDAMP_COLLECTIVE_TIMEOUT": ("collective_timeout", _timeout),
    "SHARDAMP_COLLECTIVE_WATCHDOG": ("collective_watchdog", _watchdog),
    "SHARDAMP_PYTHON_GRAD_HOOKS": ("python_grad_hooks", lambda n, v: _flag(n, v, False)),
    "SHARDAMP_ASYNC_GRAD_RELEASE": ("async_grad_release", lambda n, v: _flag(n, v, True)),
    "SHARDAMP_OFFLOAD_THREADS": ("offload_threads", _threads),
    "SHARDAMP_COPY_GRADS": ("copy_grads", lambda n, v: _flag(n, v, False)),
    "SHARDAMP_SWITCH_PARAM_CLASS": ("switch_param_class", lambda n, v: _flag(n, v, True)),
}
_FIELD_VARIABLE = {field: var for var, (field, _) in VARIABLES.items()}

_lock = threading.Lock()
_current: Optional[Settings] = None
_explicit: Dict[str, Any] = {}  # configure()'s values: above the environment, kept by reload()
_listeners: List[Callable[[Settings], None]] = []


def from_environment(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Parse ``environ`` (default ``os.environ``) into a :class:`Settings`; unset variables keep
    their defaults. Raises ``ValueError`` naming the first malformed variable."""
    env = os.environ if environ is None else environ
    values = {}
    for var, (field, parse) in VARIABLES.items():
        raw = env.get(var)
        if raw is not None:
            values[field] = parse(var, raw)
    return Settings(**values)


def settings() -> Settings:
    """The settings in force: :func:`configure`'s values over the environment (read once) over the
    defaults. Cheap after the first call (no environment read)."""
    global _current
    current = _current
    if current is None:
        with _lock:
            if _current is None:
                _current = dataclasses.replace(from_environment(), **_explicit)
            current = _current
    return current


def reload() -> Settings:
    """Read the environment again (values given to :func:`configure` still take precedence) and
    tell the parts that cache a setting. Returns the new settings."""
    global _current
    with _lock:
        _current = dataclasses.replace(from_environment(), **_explicit)
        current = _current
    for listener in list(_listeners):
        listener(current)
    return current


def configure(**values: Any) -> Settings:
    """Set settings for this process explicitly, above the environment (the public way to change
    what the variables change, e.g. ``configure(async_grad_release=False)``,
    ``configure(collective_timeout=120.0)``). ``None`` drops an explicit value (the environment or
    the default applies again). Process-wide; applies to optimizers built later and, for
    ``async_grad_release``, at once.

    Args:
        **values: field names of :class:`Settings` and their values, validated as the
            corresponding variable would be.

    Returns:
        The settings now in force.

    Raises:
        TypeError: an unknown setting name.
        ValueError: a malformed value (naming the setting).
    """
    for name, value in values.items():
        if name not in _FIELD_VARIABLE:
            raise TypeError(f"shardamp.optim.config.configure: unknown setting {name!r}; "
                            f"known: {', '.join(sorted(_FIELD_VARIABLE))}")
        if value is None:
            _explicit.pop(name, None)
            continue
        var = _FIELD_VARIABLE[name]
        parse = VARIABLES[var][1]
        raw = value if isinstance(value, str) else ("1" if value is True else "0" if value is False else str(value))
        _explicit[name] = parse(f"{name} (configure)", raw)
    return reload()


def on_change(listener: Callable[[Settings], None]) -> None:
    """Call ``listener(settings)`` after each :func:`reload` / :func:`configure` (for parts that
    push a setting into a loaded extension)."""
    _listeners.append(listener)


def explicit() -> Dict[str, Any]:
    """The values set through :func:`configure` (for the report)."""
    return dict(_explicit)


def environment() -> Dict[str, str]:
    """The ``SHARDAMP_*`` variables set in this process's environment (for the report)."""
    return {k: v for k, v in os.environ.items() if k.startswith("SHARDAMP_")}
