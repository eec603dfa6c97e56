"""One process: the landing plan under which the native grad hook lands a complete bucket itself,
with no Python call: its shard allocated, its grads landed and its flags' and norm partial's pass
run in one native call on the autograd thread (grad_stager's ``land_planned``), where
``_flush`` and ``_launch`` (grad_sync.py) would make three from Python and an allocation (tens of
microseconds of host time each on a GPU host).

The plan names, per bucket from the next one to launch, what the landing needs (size, a dtype
template, the flag rows, the round's flags, the shared partial row) and whether its first landing
assigns the partial. It is set at ``zero_grad`` for the whole next backward, from a standing plan
set once (:meth:`MergedLandings.prearm`: that backward's first grad is then staged by the hook
and Python hears nothing until that backward's end, which the hook queues), and again inside a backward after an event that called Python
(:meth:`MergedLandings.arm`). Whatever calls Python ends it: :meth:`MergedLandings.take` hands
back the shards the hook landed, in order, for grad_sync.py to adopt.

Why this one path (docs/performance.md, "shardamp variant, against the default build"): the
same landings made from a Python call measured 1.023 / 1.020 of this path's iteration time (clip
loop / plain step, H200, the examples' MLP), the separate native calls 1.019 and 1.031 in the
clip loop (the step's calls alone, then also each bucket's);
the plan set at ``zero_grad`` against one set at each backward's first grad was within the runs'
spread, with one Python decision less inside the backward. A bucket completing ahead of its
launch order (the first layer's weight before its bias, where the param groups split them: the
Trainer's and Lightning's decay groups) stays staged and lands in the hook after the buckets
before it, as Python's launches would wait. A bucket Python completes (a grad the hook hands to
Python) lands the separate way (grad_sync.py's ``_flush`` and ``_launch``), as at world > 1 and
with the Python hooks."""
from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import config, kernels
from ..shards.buffers import HeldGrads
from .grad_state import BucketGrads

# grad dtypes the compiled flags' pass takes (kernels.bucket_stats: others run the reference)
NATIVE_GRADS = (torch.float32, torch.bfloat16, torch.float16)


# A bucket is cut at the held bound only once its grads reach this many bytes: below it the copy
# into its shard costs the GPU microseconds and the memory of a few MB, while each more bucket
# costs the host a launch or two a step (host-bound models of many small params keep theirs).
HELD_CUT_BYTES = 16 * 2**20


class HeldCut(NamedTuple):
    """``layout.build_layout``'s ``max_params`` and ``cut_bytes`` (see :func:`held_bucket_bound`)."""

    max_params: Optional[int] = None
    cut_bytes: int = 0


def may_hold(reduces_grads: bool, capturable: bool, overlap: bool, offloaded: bool) -> bool:
    """Whether an optimizer's options let a complete bucket's grads stay where autograd left them
    (the zero-copy landing): one process (nothing reduces them), not capturable (CUDA graphs keep
    their buffers and take the Python hooks), ``overlap_grad_sync`` on (buckets land inside the
    backward) and not offloaded (the host copy reads every landed shard). The one place this is
    decided: the layout's cut (:func:`held_bucket_bound`) and GradSync's plan both ask it."""
    return not (reduces_grads or capturable or not overlap or offloaded)


def held_bucket_bound(comm: Any, capturable: bool, overlap: bool, offloaded: bool, formats: Any,
                      grad_dtypes: Sequence[torch.dtype], param_dtypes: Sequence[torch.dtype],
                      device: torch.device) -> HeldCut:
    """Where a bucket is cut for its grads to be held where autograd left them: at one process a
    complete bucket's are, as long as its launches carry every grad's address
    (``kernels.held_bucket_params``: CUDA), so a bucket of that many params holding
    ``HELD_CUT_BYTES`` or more is closed there. No cut (``HeldCut()``) where nothing is held:
    more ranks, capturable, ``overlap_grad_sync=False`` or offloaded optimizers (their grads are
    landed), grads in another dtype than their params' or one the hook's pass does not take; nor
    with a blockwise moment (its block grid stays the bucket's at every world size); none on the
    CPU (no bound). ``SHARDAMP_COPY_GRADS=1`` cuts as without it (its A/B keeps the layout)."""
    if (not may_hold(comm.reduces_grads, capturable, overlap, offloaded)
            or any(f.blockwise for _, f in formats.items())
            or any(g not in NATIVE_GRADS or g != p for g, p in zip(grad_dtypes, param_dtypes))):
        return HeldCut()
    return HeldCut(kernels.held_bucket_params(device), HELD_CUT_BYTES)


def fresh_shard(s: BucketGrads) -> bool:
    """One process: bucket ``s`` holds no grad of this round (nothing landed or added, its shard
    released since zero_grad) and its grad dtype is one the hook's flags pass takes."""
    return (s.full is None and not s.in_buffer and not s.shard_valid and s.buffers.released
            and s.buffers.grad_dtype in NATIVE_GRADS)


class MergedLandings:
    """The landing plan of one GradSync's buckets (see the module docstring).

    Args:
        stager: the GradSync's stager (the native one has ``set_plan``, ``prearm``, ...).
        states: the GradSync's buckets, in launch order.
        release_shards: one process, shards released at ``zero_grad`` (else no plan).
        landing_flags: health.py's ``StepHealth.landing_flags``.
        landing_rows: ``StepHealth.landing_rows``.
        device: the buckets' device.
        hold: per bucket, whether a complete bucket's grads may stay where autograd left them
            (the zero-copy landing, see below): none where something must read every landed shard
            (offload), and not a bucket the kernels cannot read in place (``kernels.holds_grads``).
            None: no bucket.
    """

    def __init__(self, stager: Any, states: Sequence[BucketGrads], release_shards: bool,
                 landing_flags: Callable[[int], Tuple[Tensor, Tensor]],
                 landing_rows: Callable[[int], Tensor], device: torch.device,
                 hold: Optional[Sequence[bool]] = None) -> None:
        self.stager = stager
        self.states = states
        self.landing_flags = landing_flags
        self.landing_rows = landing_rows
        # False: no plan here (more than one process, shards kept, or the Python hooks)
        self.plans = release_shards and hasattr(stager, "set_plan")
        # a zero-element tensor per bucket: its grad dtype and device, for the shard's allocation
        self.like = ([torch.empty(0, dtype=s.buffers.grad_dtype, device=device) for s in states]
                     if self.plans else [])
        self.planned = False  # a plan is set: the stager may hold landed shards Python has not adopted
        self.prearms = self.plans and all(s.buffers.grad_dtype in NATIVE_GRADS for s in states)
        if self.prearms:
            stager.set_standing(self.standing_entries())
        # The zero-copy landing: a complete bucket whose grads are dense in their params' layouts
        # (on the CPU: and finite) is not copied into its shard; the flags' pass reads the grads
        # where they are and they are held (shards/buffers.py HeldGrads) for the step to read in
        # place. The copy of ~1 MB of grads was ~50 us of a ~1.2 ms small-model iteration on the
        # CPU; on CUDA it is an allocation and a launch on the autograd thread, a read and a write
        # of every grad byte on the GPU and the shard's memory on top of the grads' (docs/performance.md).
        if self.plans and hold is not None and any(hold) and not config.settings().copy_grads:
            stager.set_hold(list(hold))

    def arm(self, next_launch: int, assign: bool) -> None:
        """Inside a backward: hand the stager the landings it may run itself, each bucket from
        ``next_launch`` on whose shard is fresh (``assign``: the first one starts the partial row).
        When such a bucket completes the hook lands it without calling Python, in launch order
        (one completing ahead waits, staged, for the ones before it)."""
        entries = [(s.index, s.buffers.shard_numel, self.like[s.index], *self.landing_flags(s.index), s.partial)
                   for s in self.states[next_launch:] if fresh_shard(s)]
        if entries:
            self.stager.set_plan(next_launch, assign, entries)
            self.planned = True

    def prearm(self) -> None:
        """At ``zero_grad``, every shard fresh: the whole next backward's plan from the standing
        one, every bucket from the first (whose landing assigns the partial). The round's flags
        are started over now, as its first landing would (``landing_flags``)."""
        assert self.prearms
        _, flags = self.landing_flags(0)
        self.stager.prearm(flags)
        self.planned = True

    def standing_entries(self) -> List[Tuple[int, int, Tensor, Tensor, Tensor]]:
        """The standing plan (``set_standing``): each bucket's ``(index, numel, like, rows,
        partial)``, the plan's entries without the round's flags."""
        rows = self.landing_rows
        return [(s.index, s.buffers.shard_numel, self.like[s.index], rows(s.index), s.partial) for s in self.states]

    def dropped(self) -> None:
        """``zero_grad``: the stager's ``clear`` drops the plan and what it landed."""
        self.planned = False

    def take(self) -> Tuple[List[Tuple[int, "Tensor | HeldGrads"]], str]:
        """End the plan: the buckets the hook landed under it, in landing order, each ``(bucket,
        shard)`` or, held in place, ``(bucket, HeldGrads)`` (the caller adopts them); and the error
        of a landing that failed after it took its bucket's grads (``""`` if none; the caller
        raises it); nothing where no plan was set."""
        if not self.planned:
            return [], ""
        self.planned = False
        landed, error = self.stager.finish_plan()
        return self._landed(landed), error

    def end_quiet(self) -> Tuple[bool, List[Tuple[int, "Tensor | HeldGrads"]], str, bool]:
        """A quietly begun backward's end (the plan is set): ``(began, landed, error, complete)``:
        whether a backward began quietly since Python last asked, :meth:`take`'s two, and whether
        the plan landed every bucket with nothing left staged (the stager then disarmed itself and
        reset its fired counts: the round is over)."""
        self.planned = False
        began, landed, error, complete = self.stager.end_quiet()
        return began, self._landed(landed), error, complete

    def _landed(self, landed: Sequence[Tuple[int, Optional[Tensor], Any]]) -> List[Tuple[int, "Tensor | HeldGrads"]]:
        out: List[Tuple[int, "Tensor | HeldGrads"]] = []
        for index, full, parts in landed:
            if full is None:  # held in place: the shard is made only if something reads it
                full = HeldGrads(parts, self.like[index], self.states[index].buffers.shard_numel)
            out.append((index, full))
        return out
