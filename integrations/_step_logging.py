"""What the integrations log of each DistributedFusedAdam's steps, in one place: the values a
framework's logger receives each logged step (``grad_norm``, ``loss_scale``, ``skipped_steps``),
read from ``opt.step_stats()`` (one host read per call: call it at logging steps only)."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List

from shardamp.optim import DistributedFusedAdam

KEYS = ("grad_norm", "loss_scale", "skipped_steps")


def fused_adams(optimizers: Iterable[Any]) -> List[DistributedFusedAdam]:
    """The DistributedFusedAdam behind each of ``optimizers`` (framework wrappers unwrapped)."""
    found = []
    for opt in optimizers:
        inner = opt
        for attr in ("_optimizer", "optimizer"):  # LightningOptimizer, AcceleratedOptimizer
            if not isinstance(inner, DistributedFusedAdam):
                inner = getattr(inner, attr, inner)
        if isinstance(inner, DistributedFusedAdam) and inner not in found:
            found.append(inner)
    return found


def step_values(optimizers: Iterable[Any]) -> Dict[str, float]:
    """``{"grad_norm", "loss_scale", "skipped_steps"}`` of the last step of each
    DistributedFusedAdam among ``optimizers`` (suffixed ``_<i>`` when there are several); a value
    not known yet (no step, no scaler) is left out. The same on every rank; one host read per
    optimizer; not a collective."""
    values: Dict[str, float] = {}
    opts = fused_adams(optimizers)
    for i, opt in enumerate(opts):
        stats = opt.step_stats()
        suffix = f"_{i}" if len(opts) > 1 else ""
        if stats["last_grad_norm"] is not None:
            values["grad_norm" + suffix] = float(stats["last_grad_norm"])
        if stats["loss_scale"] is not None:
            values["loss_scale" + suffix] = float(stats["loss_scale"])
        values["skipped_steps" + suffix] = float(stats["skipped_steps"])
    return values
