"""The one small all-reduce per step, and the scalars derived from it.

Each rank fills a float32 tensor ``[norm_partial, nonfinite, touched_0 .. touched_{P-1}, health
entries, agreement entries]`` (health.py: ranks whose own grads held inf/NaN, per-group norm
partials; agreement.py: what the ranks must agree on): the
partial norm of its grad shards (``sum |g|^p``, or ``max |g|`` for ``p = inf``) and its
non-finite flag in one pass per shard, plus which params got a grad on this rank. ONE
all-reduce (SUM for finite ``p``; MAX for ``inf``, where a max of 0/1 flags is still the "any")
gives the global norm, the global found-inf and the set of params touched on some rank.
Everything stays on the device. The norm math (partials, root, clip coefficients) is norms.py's.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

from .. import kernels, norms

HEADER = norms.PARTIAL  # norm partial, non-finite flag


@dataclass
class GradStats:
    """Global stats of the landed (still scaled, still summed) grads of one step."""

    norm_type: float
    raw_norm: Tensor  # norm of the grad shards as stored: before averaging and unscaling
    found_inf: Tensor  # 0-d float32, exactly 0.0 or 1.0, agreed by every rank
    touched: Tensor  # float32 [P], 1.0 where some rank produced a grad for the param
    # float32 0/1 [invalid value on some rank, ranks disagree on category 0, 1, ...] (agreement.py)
    disagreement: Optional[Tensor] = None


def finish(stats: Tensor, norm_type: float, n_params: Optional[int] = None, fingerprint=None,
           n_health: int = 0) -> GradStats:
    """Turn the all-reduced ``stats`` into a :class:`GradStats`. The ``n_health`` entries of the
    step's health (health.py) follow the touched flags; with ``fingerprint``
    (agreement.StepFingerprint), ``stats[HEADER + n_params + n_health:]`` holds its entries: a
    mismatch or an invalid lr sets found-inf, so the kernel skips the step on every rank."""
    end = stats.numel() if n_params is None else HEADER + n_params
    # one launch (kernels.stats_finish): on a GPU each op is a launch the host pays for before
    # the step kernel; the touched counts (SUM-reduced, or MAX-reduced flags) become 0/1
    raw, found_inf = kernels.stats_finish(stats, end, norm_type)
    touched = stats[HEADER:end]
    if fingerprint is None:
        return GradStats(norm_type, raw, found_inf, touched)
    disagreement = fingerprint.check(stats[end + n_health:], math.isinf(norm_type))
    found_inf = torch.maximum(found_inf, disagreement.reshape(()) if disagreement.numel() == 1 else disagreement.amax())
    return GradStats(norm_type, raw, found_inf, touched, disagreement=disagreement)


class TouchedPatterns:
    """Device copies of the host-side "got a grad" masks and of the step's agreement entries,
    each cached on its own, so that a training loop whose mask repeats copies nothing to the
    device after its first step (no sync, capturable), and a float lr changing every step (an LR
    scheduler) re-uploads only its few agreement floats, not the mask of every param."""

    def __init__(self, device: torch.device, capacity: int = 8) -> None:
        self.device = device
        self.capacity = capacity
        self.masks: "OrderedDict[bytes, Tensor]" = OrderedDict()
        self.tails: "OrderedDict[tuple, Tensor]" = OrderedDict()
        self.header = torch.zeros(HEADER, dtype=torch.float32, device=device)  # the norm header's start

    def get(self, mask: Union[bytes, Sequence[bool]]) -> Tensor:
        """``mask`` (0/1 bytes, or bools) as float32 0/1 on the device."""
        return self._cached(self.masks, bytes(mask), lambda: [float(m) for m in mask])

    def get_tail(self, tail: Sequence[float]) -> Tensor:
        """The agreement entries ``tail`` as float32 on the device."""
        return self._cached(self.tails, tuple(tail), lambda: list(tail))

    def _cached(self, cache: "OrderedDict", key: Any, values: Any) -> Tensor:
        t = cache.get(key)
        if t is None:
            host = torch.tensor(values(), dtype=torch.float32)
            if self.device.type == "cuda":
                # pinned + non_blocking: a new pattern (e.g. MoE routing) costs no host sync; the
                # caching host allocator keeps the pinned buffer alive until the copy is done
                t = host.pin_memory().to(self.device, non_blocking=True)
            else:
                t = host
            cache[key] = t
            if len(cache) > self.capacity:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return t
