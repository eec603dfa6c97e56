"""Host-side reads of per-step device flags without a host sync on the step path.

After each step the optimizer records ``[mismatch, invalid lr, found_inf]`` here. On the CPU the
values are read at once (reading is free). On CUDA they are copied, non-blocking, into pinned
memory behind an event, and read at the start of the NEXT step's stats, when that copy finished
long ago: ``event.synchronize()`` then returns at once, and every rank reads at the same point,
so every rank raises (or warns) alike. During CUDA-graph capture nothing is recorded (the device
still skips mismatched steps; only the host-side message is lost).
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

NAMES = ("mismatch", "invalid", "found_inf")  # then one mismatch flag per agreement category


class DeferredChecks:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: Optional[tuple] = None  # (host buffer, event or None, context)

    def push(self, flags: Tensor, context: dict) -> None:
        """Record ``flags`` (float32 ``[3 + categories]`` on the device, ``NAMES`` first)."""
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
            event.synchronize()  # recorded a step ago: already complete
        self.pending = None
        values: List[float] = host.tolist()
        named = dict(zip(NAMES, values))
        named["categories"] = values[len(NAMES):]
        return named, context
