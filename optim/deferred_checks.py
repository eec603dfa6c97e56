"""Host-side reads of per-step device flags without a host sync on the step path.

After each step the optimizer records ``[found_inf, agreement flags...]`` here. On the CPU the
values are read at once (reading is free). On CUDA they are copied, non-blocking, into pinned
memory behind an event, and read at the start of the NEXT step's stats, when that copy finished
long ago (``event.query()``; only a host that ran a whole step ahead of its GPU waits), and
every rank reads at the same point, so every rank raises (or warns) alike. During CUDA-graph
capture nothing is recorded (the device still skips mismatched steps; only the host-side
message is lost).
"""
from __future__ import annotations

import warnings
from typing import Any, List, Optional

import torch
from torch import Tensor

from . import agreement

SKIPS_BEFORE_WARNING = 3  # consecutive skipped steps without a scaler before the warning



class DeferredChecks:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: Optional[tuple] = None  # (host buffer, event or None, context)

    def push(self, flags: Tensor, context: dict) -> None:
        """Record ``flags`` (float32 ``[found_inf, invalid, mismatch per category...]`` on the
        device; only found_inf where nothing was checked)."""
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending = (host, event, context)
        else:
            self.pending = (flags.detach().clone(), None, context)

    def ready(self, force: bool) -> Optional[tuple]:
        """The recorded ``(values, context)`` if they may be read now: always on the CPU; on
        CUDA only when ``force`` (the next step), never during graph capture."""
        if self.pending is None:
            return None
        host, event, context = self.pending
        if event is not None:
            if not force or torch.cuda.is_current_stream_capturing():
                return None
            if not event.query():  # recorded a step ago: practically always complete already
                event.synchronize()
        self.pending = None
        values: List[float] = host.tolist()
        return {"found_inf": values[0], "flags": values[1:]}, context


def record_step(opt: Any, stats: Any) -> None:
    """Queue this step's flags for the host (no sync on CUDA), and act on them where readable."""
    found = stats.found_inf.reshape(1)
    flags = found if stats.disagreement is None else torch.cat([found, stats.disagreement])
    opt._deferred.push(flags, {"scaled": opt._inv_scale is not None, "names": opt._step_names,
                               "problem": opt._step_problem})
    check_last_step(opt, force=False)


def check_last_step(opt: Any, force: bool) -> None:
    """Act on a recorded step's flags once readable: raise on disagreement or an invalid value
    (on CUDA at the next step: the device skipped that step already), and warn when steps
    without a scaler keep being skipped."""
    got = opt._deferred.ready(force)
    if got is None:
        return
    values, context = got
    if values["flags"]:
        agreement.raise_if_disagree(values["flags"][0], values["flags"][1:], context["names"], context["problem"])
    if values["found_inf"] > 0 and not context["scaled"]:
        opt._consecutive_skips += 1
    else:
        opt._consecutive_skips = 0
    if opt._consecutive_skips >= SKIPS_BEFORE_WARNING and not opt._warned_skips:
        opt._warned_skips = True
        fp16 = any(b.grad_shard.dtype == torch.float16 for b in opt._buffers)
        warnings.warn(
            f"DistributedFusedAdam: the last {opt._consecutive_skips} steps were all skipped because the "
            "gradients (summed over the ranks) held inf/NaN, and no grad scaler is in use"
            + (" (grads are reduced in float16, whose max is 65504)" if fp16 else "") + ". Nothing is "
            "training. Reduce the grads in float32 (grad_sync_dtype=torch.float32) or use "
            "shardamp.scaler.ShardedGradScaler, which lowers the loss scale when this happens.",
            RuntimeWarning, stacklevel=4,
        )
