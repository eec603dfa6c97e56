"""Backward-time gradient plumbing: grads into bucket buffers, buckets reduce-scattered in a
fixed order.

A hook on each param's grad accumulator takes its grad (``param.grad = None``) and STAGES it
(grad_stager.py: in C++ where the kernels are built, calling Python a few times per bucket, not per
param); a bucket's grads land in its full-size buffer together (``kernels.land_grads``: a batched
byte-range copy) once it is complete or its staged bytes reach ``flush_bytes``. Buckets are
reduce-scattered in index order on every rank: a bucket whose params have all produced their grad
is launched as soon as every bucket before it has been, so the collectives overlap the rest of
backward, and the buckets left over (params that got no grad on this rank) are flushed by an
end-of-backward callback. Every rank therefore issues the same collectives in the same order
whatever its unused params. Several optimizers over one process group keep one order between
them too (backward_order.py: a backward reaching two of them launches at its end, in build
order). The reduced shard lands in ``BucketBuffers.grad_shard``; a second
reduction before the next ``zero_grad`` accumulates into it, as ``param.grad`` accumulates in
torch.

With hybrid sharding (comm.py: a replicate dim) each reduced shard is then all-reduced over the
replicas: launched as soon as its reduce-scatter has landed, waited for where the shard is
consumed (``sync``). Only the shard, 1/shard_size of the bucket, crosses the replicate links.

Where nothing is reduced (``Comm.reduces_grads`` False: a single process) there is no separate
full-size buffer: the bucket buffer IS the shard, and backward sums grads into it in place. It
exists only from the first flush of a backward to ``zero_grad`` (unless capturable): a staged
grad is held exactly as torch holds ``param.grad``, so peak memory stays torch's. There, with the
native stager, a complete bucket that is next to launch is allocated, landed and passed over for
its flags and norm partial inside the grad hook, under a landing plan (merged_landings.py), so
such a bucket calls no Python at all (its grads are not even copied where the kernels read them
in place: held, ``HeldGrads``; kernels.holds_grads). The plan is set at ``zero_grad`` for the
whole next backward (``prearm``: the hook queues that backward's end itself, ``quiet_end``, and
Python catches its begin up at its first entry point), and by Python inside a backward after any
event that called it (``_arm_plan``).
"""
from __future__ import annotations

import contextlib
import operator
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _compat, kernels, norms, param_tags
from ..checks.misuse import warn_backward_without_zero_grad
from . import backward_order, grad_stager
from ..shards.buffers import BucketBuffers, HeldGrads
from ..comm.collectives import Comm
from ..layout import Bucket, ParamSlot
from .grad_state import BucketGrads, ParamGrad, grad_states
from .merged_landings import MergedLandings, fresh_shard, may_hold
from .reductions import Reductions

# read every step over the buckets: C-level iteration (map), no Python frame per bucket
_IN_BUFFER = operator.attrgetter("in_buffer")
_PARTIAL_VALID = operator.attrgetter("partial_valid")

if TYPE_CHECKING:  # the cycle is handed in; only its type is named here
    from ..step.cycle import StepCycle



class GradSync:
    """The backward plumbing of one optimizer: a :class:`ParamGrad` per param (what its hook
    needs), a :class:`BucketGrads` per bucket (``states``, in reduction order), the reductions
    in flight (``pending``); it tells the optimizer's step cycle (step/cycle.py), which owns the
    round counters, when a backward begins and when a round is launched."""

    def __init__(
        self,
        buckets: List[Bucket],
        buffers: List[BucketBuffers],
        params: Sequence[torch.nn.Parameter],
        comm: Comm,
        overlap: bool,
        keep_buffers: bool,
        native_hooks: bool = True,
        *,
        cycle: "StepCycle",
        check_landed: Callable[..., None],
        landing_flags: Callable[[int], Tuple[Tensor, Tensor]],
        landing_rows: Callable[[int], Tensor],
        host: Any,
    ) -> None:
        self.comm = comm
        # the step cycle: told when a backward begins and a round is launched; read for the rounds
        self.cycle = cycle
        # health.py's StepHealth.check_landed: called with (bucket, buffer) just before a bucket's
        # grads are reduced; at one process also with the shared partial row, to form it in the
        # same pass
        self.check_landed = check_landed
        # nothing to reduce (one process, comm.py): the bucket buffer is the shard, grads land in it
        self.in_place = not comm.reduces_grads
        self.overlap = overlap
        # one process, not capturable: the shard (= bucket buffer) is released at zero_grad
        self.release_shards = self.in_place and not keep_buffers
        self.keep_buffers = keep_buffers or self.in_place
        self.warned_no_zero_grad = False
        self.n_params = len(params)

        self.slots: dict[int, ParamSlot] = {}
        for bucket in buckets:
            for slot in bucket.slots:
                self.slots[slot.index] = slot
        self.next_launch = 0  # buckets [0, next_launch) have been launched in the current round
        self._enabled = True  # False inside no_sync()
        self.callback_queued = False
        # backward_order.py: this backward reaches another optimizer over the group too, so the
        # launches wait for its end (``_defer_launches``); or its launches are held to the step
        # (``_hold_launches``) and the step raises ``refusal`` (backward passes of two threads at
        # once). Set only by the methods backward_order.py calls (``defer_launches_to_end``, ...)
        self._defer_launches = False
        self._hold_launches = False
        self._refusal = ""
        cycle.watch(self)  # its gate asks whether no_sync holds and what waits for a reduction
        self.order_group: Optional[backward_order.GroupOrder] = None
        self.build_index = 0
        # Each bucket's stats partial (sum g^2, non-finite flag) is added into one shared row
        # (the round's first bucket starts it over): after backward that row is the stats'
        # header, with no op to combine the buckets' partials before the one small all-reduce.
        # Where grads are reduced on CUDA it is computed on a side stream as soon as the bucket's
        # reduce-scatter lands, hidden under the rest of backward; at one process (nothing
        # reduced, on any device) in the flags' pass over the landed bucket (``check_landed``).
        # The buckets add in their launch order, which is the order the step's own fallback
        # (grad_stats.reduce_step_stats) adds the shards in.
        device = buckets[0].device if buckets else torch.device("cpu")
        side = torch.cuda.Stream(device) if device.type == "cuda" and not self.in_place else None
        self.partials = torch.zeros(norms.PARTIAL, dtype=torch.float32, device=device)
        self.partials_started = False  # a bucket of this round wrote the row: the next ones add to it
        # per bucket its grads' state; per param (by id) what the hook needs; the params in the
        # stager's indexing (the optimizer's order, params with a slot)
        self.states, self.record, self.by_stager_index = grad_states(buckets, buffers, params, self.slots,
                                                                     self.partials, staged=not self.in_place)
        for s in self.states:
            if self.in_place:
                if self.release_shards:
                    s.buffers.release_grad_shard()
                else:
                    s.full = s.buffers.grad_shard  # the shard is the whole bucket
            elif keep_buffers:
                s.full = s.new_full()
        # the optimizer's HostState (shards/host_state.py): each landed shard of an offloaded bucket is
        # copied to the host as it lands (``landed``); zero_grad makes no copy current (``dropped``)
        self.host = host
        self.reductions = Reductions(comm, side, self.partials, host)
        # A param belongs to the LAST optimizer built over it: an older one's hook stands aside.
        self.owner_token = object()
        self.hook_error: Optional[BaseException] = None  # met by a native hook's callback
        self.stager_index = {e.index: k for k, e in enumerate(self.by_stager_index)}
        # CUDA graphs (capturable) take the Python hooks: a native hook holds each param's grad
        # accumulator, which keeps the stream it was made on, and a capture on another stream
        # would then wait on it (grad_stager.py)
        self.stager = grad_stager.for_grad_sync(self, kernels.native_module(device) if native_hooks else None)
        # one process, shards released at zero_grad, native stager: a complete bucket's allocation,
        # landing and flags' pass in one call in the grad hook under a landing plan (``_arm_plan``,
        # ``prearm``; adopted by ``_take_planned``). landing_flags / landing_rows: health.py's
        # StepHealth methods
        holds = may_hold(comm.reduces_grads, keep_buffers, overlap, host.active)
        self.landings = MergedLandings(self.stager, self.states, self.release_shards, landing_flags, landing_rows,
                                       device, hold=kernels.holds_grads(
                                           device, [len(b.segments.segments) if b.segments else 0 for b in buckets])
                                       if holds else None)
        # the plan pre-armed at zero_grad (one process): the stager queues that backward's end
        # itself at its first grad (``quiet_end``) and calls no Python there; Python catches the
        # begin up at its first entry point (``_take_planned``)
        if self.landings.prearms:
            self.stager.set_quiet_begin(grad_stager.quiet_end_callback(self))
        # the grad accumulators backward_order.py asks autograd about, kept where the native
        # stager holds them anyway (the Python hooks' are made by each forward: looked up each time)
        self.accumulators: Optional[List[Any]] = (
            None if isinstance(self.stager, grad_stager.PyStager) else [None] * len(self.by_stager_index))

    # ---------------------------------------------------------------- backward
    def on_grad(self, entry: ParamGrad) -> None:
        """A grad was accumulated into ``entry``'s param (the Python hook: every grad; the native
        one: the SLOW cases only, see grad_stager.py). Runs once per param per backward."""
        param = entry.param
        grad = param.grad
        if grad is None:
            return
        if param_tags.owner_token(param) is not self.owner_token:
            return  # a newer optimizer took this param over; its own hook handles the grad
        if not self.callback_queued:  # first grad of this backward
            self._begin()
            self.stager.set_armed(True)
        if grad.is_sparse:
            raise RuntimeError("DistributedFusedAdam does not support sparse gradients")
        k = self.stager_index[entry.index]
        if self.stager.is_staged(k):  # a second grad before the flush: land the first one
            self._flush(self.states[entry.bucket])
        self._staged(self.states[entry.bucket], self.stager.stage(k))

    def _begin(self, queue_end: bool = True) -> None:
        """A backward's first grad reached this optimizer: count the backward, queue its end
        (``queue_end`` False: the stager queued it, a quiet begin)."""
        self.callback_queued = True
        stepped = self.cycle.backward_began()
        if queue_end:
            backward_order.begin(self)  # queues the end of this backward (the group's, if shared)
        if stepped:
            self._warn_no_zero_grad()

    def quiet_end(self) -> None:
        """A quietly begun backward finished (the stager queued this at its first grad): its begin
        caught up (unless an entry point inside it did), then its end, as a queued end would.
        Where the plan landed every bucket, the round ends here without end_of_backward's calls
        (the stager made them: ``end_quiet``)."""
        if self.landings.planned:
            began, landed, error, complete = self.landings.end_quiet()
            if began and not self.callback_queued:
                self._begin(queue_end=False)
            self._adopt_all(landed, error)
            if (complete and self.callback_queued and self.hook_error is None and self.next_launch == len(self.states)
                    and self.overlap and self._enabled and not self._hold_launches):
                self.callback_queued = False
                self._finish_round(fired_reset=True)  # nothing left to launch; the stager disarmed itself
                self.cycle.backward_ended()
                return
        if self.callback_queued:
            self.end_of_backward()

    def on_event(self, event: int, arg: int) -> None:
        self._take_planned()
        if event == grad_stager.SLOW:
            self.on_grad(self.by_stager_index[arg])
        else:
            self._staged(self.states[arg], event)
        if self.landings.plans and self.callback_queued:
            self._arm_plan()

    def _arm_plan(self) -> None:
        """Hand the native stager the landings it may run itself (one process, inside a
        backward): each bucket from ``next_launch`` on whose shard is still fresh.
        When such a bucket completes the hook lands it without calling Python, in launch order
        (a GIL round trip and this module's bookkeeping, tens of microseconds a bucket on a GPU
        host); the plan ends at the first event that does call Python."""
        if not self._enabled or not self.overlap or self._defer_launches or self._hold_launches:
            return
        self.landings.arm(self.next_launch, not self.partials_started)

    def prearm(self) -> None:
        """``zero_grad`` released every shard (one process): set the next backward's landing plan
        now, for every bucket from the first, so that backward's grads are staged and its
        complete buckets landed in the native hook without Python deciding its first grad or
        arming a plan there. Any Python entry point before that backward undoes it
        (``_take_planned``), and the first grad then arms as without it."""
        if (not self.landings.prearms or not self._enabled or not self.overlap or self.callback_queued
                or self.next_launch or self.partials_started or not all(map(fresh_shard, self.states))):
            return
        self.landings.prearm()

    def _take_planned(self) -> None:
        """Adopt the shards the stager landed under its plan (``_arm_plan``, ``prearm``), and end
        the plan: every other entry point calls this first, so Python's state is the stager's again."""
        if not self.landings.planned:
            return
        if self.landings.prearms and not self.callback_queued and self.stager.take_quiet_begin():
            self._begin(queue_end=False)
        self._adopt_all(*self.landings.take())

    def _adopt_all(self, landed: List[Tuple[int, "Tensor | HeldGrads"]], error: str) -> None:
        for index, full in landed:
            self._adopt_landed(self.states[index], full)
        if error:
            raise RuntimeError(f"DistributedFusedAdam: landing the grads of {error}")

    def _staged(self, s: BucketGrads, event: int) -> None:  # event: NONE, FLUSH or COMPLETE
        if event != grad_stager.NONE:
            self._flush(s)
        if event == grad_stager.COMPLETE and self._enabled and self.overlap and not self._defer_launches:
            self._launch_ready()

    def _adopt_landed(self, s: BucketGrads, full: "Tensor | HeldGrads") -> None:
        """Bucket ``s`` was allocated, landed and checked as ``full`` by the grad hook under the
        plan (its flags and partial formed), or its grads were checked where they are and held
        (``HeldGrads``: no offload then): it is launched, its shard is ``full`` or made from them
        when read."""
        if isinstance(full, HeldGrads):
            s.buffers.hold_grads(full)
            s.full, s.dirty = None, False
        else:
            s.buffers.adopt_grad_shard(full)
            s.full, s.dirty = full, False
            if self.host.shards:  # an offloaded bucket's host copy starts here
                self.host.landed(s.index, full)
        s.shard_valid = s.partial_valid = self.partials_started = True
        self.next_launch = s.index + 1

    def raise_hook_error(self) -> None:
        """Raise the error a native hook's callback met (once)."""
        exc, self.hook_error = self.hook_error, None
        if exc is not None:
            raise exc

    def _warn_no_zero_grad(self) -> None:
        if not self.warned_no_zero_grad:
            self.warned_no_zero_grad = True
            warn_backward_without_zero_grad()

    def _writable_full(self, s: BucketGrads) -> Tensor:
        """Bucket ``s``'s full-size buffer, allocated (zeros) or zeroed if stale."""
        return s.writable_full(self.in_place)

    def _flush(self, s: BucketGrads) -> None:
        """Land bucket ``s``'s staged grads in its buffer (grad_state.py's ``BucketGrads.flush``)."""
        s.flush(self.stager, self.in_place, self.by_stager_index)

    def shard(self, index: int) -> Tensor:
        """Bucket ``index``'s grad shard as landed so far, also inside a backward: what the grad
        hook landed under its plan is adopted first (reading the released shard directly would
        allocate zeros beside the hook's landing)."""
        self._take_planned()
        return self.states[index].buffers.grad_shard

    @property
    def local_touched(self) -> bytes:
        """Host-side truth of "this param got a grad on this rank since zero_grad", per param of
        the optimizer (0/1 bytes)."""
        flags = self.stager.touched()  # per stager index
        if len(self.by_stager_index) == self.n_params:  # every param has a slot: the same order
            return bytes(flags)
        out = bytearray(self.n_params)
        for k, entry in enumerate(self.by_stager_index):
            if flags[k]:
                out[entry.index] = 1
        return bytes(out)

    def flush_all(self) -> None:
        """Land every bucket's staged grads (the caller adopted the stager's planned landings
        first: ``_take_planned``)."""
        staged = self.stager.staged_count  # asked here: a bucket with nothing staged costs no Python call
        for s in self.states:
            if staged(s.index):
                self._flush(s)

    def _launch_ready(self) -> None:
        # in layout.backward_order: bucket 0 (the last layers) first
        states = self.states
        fired = self.stager.fired
        while self.next_launch < len(states) and fired(self.next_launch) >= states[self.next_launch].expected:
            self._launch(states[self.next_launch])

    def end_of_backward(self) -> None:
        self.callback_queued = False
        self.stager.set_armed(False)  # first: the next backward's first grad calls Python even if this raises
        self._take_planned()
        self.raise_hook_error()
        self.flush_all()
        if self.overlap and self._enabled and not self._hold_launches:
            self._finish_round()  # resets the fired counts too
        else:
            self.stager.reset_fired()
        self.cycle.backward_ended()

    def _finish_round(self, fired_reset: bool = False) -> None:
        """Launch what is left of the round and end it (``fired_reset``: the stager reset its
        fired counts itself, ``end_quiet``)."""
        while self.next_launch < len(self.states):
            self._launch(self.states[self.next_launch])
        self.next_launch = 0
        if not fired_reset:
            self.stager.reset_fired()
        self.cycle.round_launched()
        self.partials_started = False  # the next round recomputes them all

    def _launch(self, s: BucketGrads) -> None:
        """Reduce-scatter bucket ``s`` (every rank calls this for every bucket, in order)."""
        self.next_launch = s.index + 1
        self._flush(s)
        s.in_buffer.clear()
        full = self._writable_full(s)  # no grad here on this rank: contribute zeros
        if self.in_place:
            s.shard_valid = True
            # nothing to reduce: the flags and the L2 partial in one pass over the shard, on this
            # stream (a side stream would only add a join; the flags pass reads the shard anyway)
            self.check_landed(s.index, full, s.partial, not self.partials_started)
            self.partials_started = s.partial_valid = True
            self.host.landed(s.index, full)
            return
        self.check_landed(s.index, full)
        if self.reductions.launch(s, full, accumulate=s.shard_valid, free_full=not self.keep_buffers,
                                  first_partial=not self.partials_started):
            self.partials_started = s.partial_valid = True
        if self.keep_buffers:
            s.dirty = True  # holds this round's grads until the next round overwrites them
        else:
            s.full = None  # freed once the reduction has been waited for
        s.shard_valid = True

    def landed_stats(self) -> Optional[Tensor]:
        """The 2-norm partial of all buckets (float32 ``[2]``: the stats' header, read before the
        next round's first bucket zeroes it) if every bucket added its current partial; None
        otherwise (the caller computes it)."""
        self._take_planned()
        if not self.states or not all(map(_PARTIAL_VALID, self.states)):
            return None
        return self.partials  # the non-finite flags added up: a count, still "any" where > 0

    def holds_unreduced(self) -> bool:
        """This rank holds grads no reduction has consumed yet (landed in a bucket, staged, or a
        round half launched)."""
        self._take_planned()
        return self.next_launch > 0 or any(map(_IN_BUFFER, self.states)) or any(
            self.stager.staged_count(s.index) for s in self.states)

    # ---------------------------------------------------------------- explicit sync
    def sync(self) -> None:
        """Finish the gradient reduction: launch what is left, then wait for every bucket.

        A step always consumes at least one complete round, so a rank whose backward touched
        none of the params still joins the collectives the other ranks issued.
        """
        self._take_planned()
        if self.hook_error is not None:
            self.raise_hook_error()
        self.flush_all()
        if self.next_launch > 0 or self.cycle.rounds_since_step == 0 or any(map(_IN_BUFFER, self.states)):
            self._finish_round()
        if self.reductions.pending:  # the common case at the step: everything landed in backward
            self.wait()

    def wait(self) -> None:
        """Every reduction in flight has landed (``Reductions.wait``)."""
        self.reductions.wait()

    def alive_full_buffers(self) -> List[Tensor]:
        """The full-size bucket buffers alive now (not counting a shard that IS its bucket)."""
        self._take_planned()
        shard_ptrs = {s.buffers.grad_store.data_ptr() for s in self.states if s.buffers.grad_store is not None}
        held = [s.full for s in self.states if s.full is not None and s.full.data_ptr() not in shard_ptrs]
        held += self.reductions.held_inputs()
        return list({id(t): t for t in held}.values())

    enabled = property(lambda self: self._enabled, doc="Grads are reduced (False inside ``no_sync()``).")
    refusal = property(lambda self: self._refusal, doc="Why the next step is refused (backward_order.py), or \"\".")

    def step_done(self) -> None:
        self._refusal = ""  # the step that consumed the refused grads was flagged (backward_order.py)

    # ---------------------------------------------------------------- launch order (backward_order.py)
    def joined_group(self, group: "backward_order.GroupOrder", index: int) -> None:
        """Registered over ``group`` as the ``index``-th optimizer built over it."""
        self.order_group, self.build_index = group, index

    def launches_in_backward(self) -> bool:
        """This optimizer launches reduce-scatters during backward (not at ``grad_sync``/``step``)."""
        return self.overlap and self._enabled

    def defer_launches_to_end(self, defer: bool) -> None:
        """This backward reaches another optimizer of the group too (``defer``): launch at its
        end, in the group's order; else launch as buckets complete."""
        self._defer_launches = defer

    def hold_launches_to_step(self, refusal: str) -> None:
        """Backward passes of two threads at once over the group: this backward launches nothing
        (the step reduces, in program order) and the next step raises ``refusal``."""
        self._refusal, self._hold_launches = refusal, True

    def refuse_next_step(self, refusal: str) -> None:
        """Another thread's backward met this one's round: the next step raises (the first
        ``refusal`` kept)."""
        self._refusal = self._refusal or refusal

    def round_ended(self) -> None:
        """The group's round of this backward ends: this optimizer's end of backward, in the
        group's order; later rounds launch again."""
        self._defer_launches = False
        try:
            self.end_of_backward()
        finally:
            self._hold_launches = False  # a refused round's buckets wait for the step

    def zero(self, set_to_none: bool) -> None:
        """``zero_grad``: drop local and reduced grads (not yet reduced ones too)."""
        self.comm.check()  # collectives found stuck (collective_watchdog.py) raise here too
        self.landings.dropped()  # what a plan landed is dropped with the rest (stager.clear below)
        if self.reductions.pending:
            self.wait()
        if self.host.shards:  # offloaded buckets' host copies are stale from here
            self.host.dropped()
        self.next_launch = 0
        self.partials_started = False
        self.callback_queued = False  # a backward that raised never ran its callback
        self._defer_launches = self._hold_launches = False
        self._refusal = ""
        backward_order.forget(self)
        self.stager.set_armed(False)
        self.stager.clear()
        self.stager.drain()  # the landed grads are freed by now, as torch's are by zero_grad
        self.hook_error = None
        for s in self.states:
            s.clear_round()
        if set_to_none:
            self.stager.clear_touched()
            for s in self.states:
                s.shard_valid = False
        else:
            for s in self.states:
                s.buffers.zero_grads()
        if self.release_shards and set_to_none:
            # one process: no grads exist until the next backward, as in torch (peak memory)
            for s in self.states:
                s.buffers.release_grad_shard()
                s.full, s.dirty = None, False
        elif self.keep_buffers:
            # one process: the buffer is the shard; zeroed lazily before the next write
            dirty = set_to_none or not self.in_place
            for s in self.states:
                s.dirty = dirty
        else:
            for s in self.states:
                s.full = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._take_planned()  # a plan set at zero_grad launches what no_sync holds back: undone
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        if _finalizing():  # module globals are being torn down (``sys`` too); the hooks go with the params
            return
        self.remove_hooks()

    def take_over(self, params: Sequence[torch.nn.Parameter]) -> None:
        """The optimizer's construction is done: the grad hooks go on, ``params``' grads are this
        grad sync's from now on (param_tags.py: the older grad sync of one stands aside) and, over
        peers, it joins its group's order. Last, so that a construction that raises leaves the
        params with the optimizer that had them, untouched."""
        try:
            self.stager.attach()
        except BaseException:
            self.remove_hooks()
            raise
        for p in params:
            older = param_tags.own(p, self, self.owner_token)
            if older is not None:
                older.disown(p)
        if self.comm.has_peers:
            backward_order.register(self)

    def disown(self, p: torch.nn.Parameter) -> None:
        """A newer grad sync took ``p`` over: this one's native hook stands aside (a Python hook
        checks the owner token itself)."""
        entry = self.record.get(id(p))
        if entry is not None:
            self.stager.disown(self.stager_index[entry.index])

    def remove_hooks(self) -> None:
        stager = getattr(self, "stager", None)
        if stager is not None:  # inside a backward its hooks may be iterated: only disarm them
            stager.remove(not _compat.in_backward())

