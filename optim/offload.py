"""Where the optimizer state lives: the one declaration of the ``offload`` options, and what the
host offers it.

``offload="cpu"`` keeps each rank's owned fp32 master and Adam moments in (pinned, where CUDA is
available) host memory and steps them with the CPU kernels (docs/offload.md: which buckets go to
the host under ``offload_fraction``, the step's one host read, the copies on side streams; the
host state itself is ``shards/host_state.py``'s). This module validates the constructor's two
arguments into one frozen :class:`OffloadOptions`, which the ranks compare at construction
(``checks/agreement.py``), and reads what the host has: the bytes available to this process
(:func:`host_memory_available`: ``MemAvailable`` capped by the cgroup's limit) and the ranks
sharing it (:func:`local_ranks`). Standard library only below the options.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

OFFLOAD_VALUES = (None, "cpu")  # what ``offload=`` accepts; NVMe offload is a non-goal
DEFAULT_FRACTION = 1.0  # ``offload_fraction`` when ``offload`` is given without it

_DESIGN = "docs/offload.md"


@dataclass(frozen=True)
class OffloadOptions:
    """The validated ``offload`` options.

    Attributes:
        offload: ``None`` (the state on the params' device) or ``"cpu"`` (owned fp32 masters and
            moments in host memory).
        fraction: the share of the owned state bytes kept in host memory, rounded to whole
            buckets when the buckets are chosen; ``None`` without offload.
    """

    offload: Optional[str] = None
    fraction: Optional[float] = None

    @property
    def enabled(self) -> bool:
        """Some state is asked to live in host memory."""
        return self.offload is not None

    def agreed(self) -> Dict[str, Any]:
        """What every rank must have passed (compared at construction by ``checks/agreement.py``)."""
        return {"offload": self.offload, "offload_fraction": self.fraction}


def resolve_offload(offload: Any, offload_fraction: Any, store_param_remainders: bool,
                    capturable: bool) -> OffloadOptions:
    """Validate the constructor's ``offload`` and ``offload_fraction`` (local, no collective).

    Args:
        offload: ``None`` or ``"cpu"``.
        offload_fraction: ``None`` (1.0 with offload), or a number from 0 to 1 with offload.
        store_param_remainders: the constructor's flag (already checked to be a bool).
        capturable: the constructor's flag (already checked to be a bool).

    Returns:
        The options, ``fraction`` filled in (``None`` without offload).

    Raises:
        ValueError: an unknown ``offload``; ``offload_fraction`` outside [0, 1], not a number, or
            given without ``offload``; ``store_param_remainders=True`` with ``offload``, or
            ``capturable=True`` with some state offloaded (``offload_fraction`` > 0; each message
            says why and the fix).
    """
    if not (offload is None or (isinstance(offload, str) and offload in OFFLOAD_VALUES)):
        raise ValueError(
            f"offload={offload!r}: expected None (the state on the params' device) or 'cpu' (each rank's "
            f"owned fp32 master and moments in host memory); offloading to NVMe is not planned ({_DESIGN})")
    if offload is None:
        if offload_fraction is not None:
            raise ValueError(
                f"offload_fraction={offload_fraction!r} without offload: it is the share of the owned "
                "state kept in host memory; pass offload='cpu' with it, or drop offload_fraction")
        return OffloadOptions()
    fraction = DEFAULT_FRACTION if offload_fraction is None else offload_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
            math.isfinite(fraction) and 0.0 <= fraction <= 1.0):
        raise ValueError(
            f"offload_fraction={offload_fraction!r}: expected a number from 0 to 1 (the share of each "
            "rank's owned state bytes kept in host memory, rounded to whole buckets; default 1.0)")
    if store_param_remainders:
        raise ValueError(
            f"store_param_remainders=True with offload={offload!r}: the host keeps the fp32 master of the "
            "owned shard, so there is no master on the device to split into the bf16 param and a 16-bit "
            "remainder, and nothing left to save there; pass store_param_remainders=False")
    if capturable and fraction > 0:  # 0: no bucket goes to the host (choose_buckets), nothing to refuse
        raise ValueError(
            f"capturable=True with offload={offload!r}: an offloaded step reads its grad coefficient on the "
            "host and updates the state on the CPU, which a CUDA graph cannot capture; pass capturable=False "
            "to offload, or offload=None to capture the step")
    return OffloadOptions(offload, float(fraction))


# cgroup v2, then v1: (limit, usage) files of this process's memory controller
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) or unreadable: None


def host_memory_available(meminfo: str = "/proc/meminfo",
                          cgroup_files: Tuple[Tuple[str, str], ...] = _CGROUP_FILES) -> Tuple[Optional[int], str]:
    """The bytes of host memory this process may still allocate, and where the number comes from.

    ``MemAvailable`` of ``meminfo``, capped by the memory cgroup's limit less its usage (v2's
    ``memory.max`` - ``memory.current``, else v1's ``memory.limit_in_bytes`` -
    ``memory.usage_in_bytes``; an unlimited cgroup caps nothing). Local; reads files only.

    Returns:
        ``(bytes, source)``; ``(None, "")`` where nothing can be read (the check is then skipped).
    """
    available: Optional[int] = None
    source = ""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available, source = int(line.split()[1]) * 1024, "MemAvailable"
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in cgroup_files:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is None or usage is None or limit >= 1 << 60:  # v1 writes a huge number for "no limit"
            continue
        room = max(limit - usage, 0)
        if available is None or room < available:
            available, source = room, f"the cgroup limit {limit_file} less its usage"
        break
    return available, source


def local_ranks(environ: Optional[Dict[str, str]] = None) -> int:
    """The ranks sharing this host: ``LOCAL_WORLD_SIZE`` (torchrun sets it), else 1."""
    env = os.environ if environ is None else environ
    value = env.get("LOCAL_WORLD_SIZE", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 1


def host_cores() -> int:
    """The CPU cores this process may run on (its affinity where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def memory_verdict(needed_per_rank: int, ranks: int, available: Optional[int], source: str) -> str:
    """``"fits"``, or the shortfall as the ranks compare it at construction (short: it is named
    in the agreement's error beside each rank's value)."""
    needed = needed_per_rank * ranks
    if available is None or needed <= available:
        return "fits"
    return f"needs {needed} B ({ranks} rank(s) x {needed_per_rank} B) > {available} B available ({source})"
