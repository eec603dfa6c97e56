"""One process: a complete bucket's shard allocated, its grads landed and its flags' and norm
partial's pass run in ONE native call (grad_stager's ``land_checked``), where ``_flush`` and
``_launch`` (grad_sync.py) would make three and an allocation (tens of microseconds of host time
each on a GPU host); with the native stager, by its grad hook itself under a landing plan, with
no Python call at all.

The plan names, per bucket from the next one to launch, what the landing needs (size, a dtype
template, the flag rows, the round's flags, the shared partial row) and whether its first landing
assigns the partial. It is set either inside a backward, after an event that called Python
(:meth:`MergedLandings.arm`), or at ``zero_grad`` for the whole next backward, from a standing
plan set once (:meth:`MergedLandings.prearm`: that backward's first grad is then staged by the
hook and Python only hears ``BEGAN``). Whatever calls Python ends it: :meth:`MergedLandings.take`
hands back the shards the hook landed, in order, for grad_sync.py to adopt."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .grad_state import BucketGrads

# grad dtypes the compiled flags' pass takes (kernels.bucket_stats: others run the reference)
NATIVE_GRADS = (torch.float32, torch.bfloat16, torch.float16)


def fresh_shard(s: BucketGrads) -> bool:
    """One process: bucket ``s`` holds no grad of this round (nothing landed or added, its shard
    released since zero_grad) and its grad dtype is one the merged landing's flags pass takes."""
    return (s.full is None and not s.in_buffer and not s.shard_valid and s.buffers.released
            and s.buffers.grad_dtype in NATIVE_GRADS)


class MergedLandings:
    """The merged landings of one GradSync's buckets (see the module docstring).

    Args:
        stager: the GradSync's stager (the native one has ``land_checked``, ``set_plan``, ...).
        states: the GradSync's buckets, in launch order.
        release_shards: one process, shards released at ``zero_grad`` (else nothing merges).
        landing_flags: health.py's ``StepHealth.landing_flags`` (None: no merged landings).
        landing_rows: ``StepHealth.landing_rows`` (None: no plan set at ``zero_grad``).
        hook_landings: the hook lands under a plan (``SHARDAMP_HOOK_LANDINGS``).
        device: the buckets' device.
    """

    def __init__(self, stager: Any, states: Sequence[BucketGrads], release_shards: bool,
                 landing_flags: Optional[Callable[[int], Tuple[Tensor, Tensor]]],
                 landing_rows: Optional[Callable[[int], Tensor]], hook_landings: bool, device: torch.device) -> None:
        self.stager = stager
        self.states = states
        self.landing_flags = landing_flags
        self.landing_rows = landing_rows
        land_checked = getattr(stager, "land_checked", None)
        # None: no merged landing here (more than one process, shards kept, or no native stager)
        self.land_checked = land_checked if release_shards and landing_flags is not None else None
        # a zero-element tensor per bucket: its grad dtype and device, for the shard's allocation
        self.like = ([torch.empty(0, dtype=s.buffers.grad_dtype, device=device) for s in states]
                     if self.land_checked is not None else [])
        self.plans = hook_landings and self.land_checked is not None and hasattr(stager, "set_plan")
        self.planned = False  # a plan is set: the stager may hold landed shards Python has not adopted
        self.prearms = (self.plans and landing_rows is not None and hasattr(stager, "prearm")
                        and all(s.buffers.grad_dtype in NATIVE_GRADS for s in states))
        if self.prearms:
            stager.set_standing(self.standing_entries())

    def land(self, s: BucketGrads, assign: bool) -> Tensor:
        """Bucket ``s`` (complete, next to launch, its shard fresh) allocated, landed and checked
        in one call from Python; its new shard. ``assign``: its partial starts the shared row."""
        assert self.land_checked is not None and self.landing_flags is not None
        rows, flags = self.landing_flags(s.index)
        full, _ = self.land_checked(s.index, s.buffers.shard_numel, self.like[s.index], rows, flags, s.partial, assign)
        return full

    def arm(self, next_launch: int, assign: bool) -> None:
        """Inside a backward: hand the stager the landings it may run itself, each bucket from
        ``next_launch`` on whose shard is fresh (``assign``: the first one starts the partial row).
        When such a bucket completes in launch order the hook lands it without calling Python."""
        assert self.landing_flags is not None
        entries = [(s.index, s.buffers.shard_numel, self.like[s.index], *self.landing_flags(s.index), s.partial)
                   for s in self.states[next_launch:] if fresh_shard(s)]
        if entries:
            self.stager.set_plan(next_launch, assign, entries)
            self.planned = True

    def prearm(self) -> None:
        """At ``zero_grad``, every shard fresh: the whole next backward's plan from the standing
        one, every bucket from the first (whose landing assigns the partial). The round's flags
        are started over now, as its first landing would (``landing_flags``)."""
        assert self.prearms and self.landing_flags is not None
        _, flags = self.landing_flags(0)
        self.stager.prearm(flags)
        self.planned = True

    def standing_entries(self) -> List[Tuple[int, int, Tensor, Tensor, Tensor]]:
        """The standing plan (``set_standing``): each bucket's ``(index, numel, like, rows,
        partial)``, the plan's entries without the round's flags."""
        rows = self.landing_rows
        assert rows is not None
        return [(s.index, s.buffers.shard_numel, self.like[s.index], rows(s.index), s.partial) for s in self.states]

    def dropped(self) -> None:
        """``zero_grad``: the stager's ``clear`` drops the plan and what it landed."""
        self.planned = False

    def take(self) -> Tuple[List[Tuple[int, Tensor]], str]:
        """End the plan: the ``(bucket, shard)`` pairs the hook landed under it, in landing order
        (the caller adopts them), and the error of a landing that failed after it took its
        bucket's grads (``""`` if none; the caller raises it); nothing where no plan was set."""
        if not self.planned:
            return [], ""
        self.planned = False
        landed, error = self.stager.finish_plan()
        return list(landed), error
