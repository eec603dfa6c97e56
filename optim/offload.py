"""Where the optimizer state lives: the one declaration of the ``offload`` options.

``offload="cpu"`` will keep each rank's owned fp32 master and Adam moments in pinned host memory
and step them with the CPU kernels (docs/offload.md has the design: which buckets go to the host
under ``offload_fraction``, the step's one host read, the copies on side streams). This module
validates the constructor's two arguments into one frozen :class:`OffloadOptions`, which the
ranks compare at construction (``checks/agreement.py``) and the constructor asks whether the
option can run yet.

The host state and the CPU step are not implemented yet: an ``offload="cpu"`` that passes every
check here and agrees on every rank is refused at construction (``NotImplementedError``,
:meth:`OffloadOptions.refuse_unavailable`), after the agreement so that ranks passing different
values all raise the agreement's error instead of some of them waiting in it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

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

    def refuse_unavailable(self) -> None:
        """Refuse an offload the optimizer cannot run yet; nothing otherwise.

        Called at construction after the ranks' agreement and before any state is allocated.

        Raises:
            NotImplementedError: ``offload`` is given (every value but ``None``).
        """
        if self.enabled:
            raise NotImplementedError(
                f"offload={self.offload!r}: optimizer state in host memory is not available yet (the "
                f"options are validated, but the host state and the CPU step are not implemented; "
                f"{_DESIGN} has the design); pass offload=None (the default) to keep the state on the "
                "params' device")


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
            given without ``offload``; ``store_param_remainders=True`` or ``capturable=True``
            with ``offload`` (each message says why and the fix).
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
    if capturable:
        raise ValueError(
            f"capturable=True with offload={offload!r}: an offloaded step reads its grad coefficient on the "
            "host and updates the state on the CPU, which a CUDA graph cannot capture; pass capturable=False "
            "to offload, or offload=None to capture the step")
    return OffloadOptions(offload, float(fraction))
