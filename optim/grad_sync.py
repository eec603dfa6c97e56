"""Backward-time gradient plumbing: grads into bucket buffers, buckets reduce-scattered in a
fixed order.

A post-accumulate-grad hook takes each param's grad (``param.grad = None``) and STAGES it: the
grads of a bucket are copied into its full-size buffer together, with one multi-tensor copy
(``torch._foreach_copy_``) when the bucket is complete (or its staged bytes reach
``flush_bytes``), not one copy launch and one view per param. Buckets are reduce-scattered in
index order on every rank: a bucket whose params have all produced their grad is launched as
soon as every bucket before it has been, so the collectives overlap the rest of backward, and
the buckets left over (params that got no grad on this rank) are flushed by an end-of-backward
callback. Every rank therefore issues the same collectives in the same order whatever its
unused params. The reduced shard lands in ``BucketBuffers.grad_shard``; a second reduction
before the next ``zero_grad`` accumulates into it, as ``param.grad`` accumulates in torch.

With hybrid sharding (comm.py: a replicate dim) each reduced shard is then all-reduced over the
replicas: launched as soon as its reduce-scatter has landed, waited for where the shard is
consumed (``sync``). Only the shard, 1/shard_size of the bucket, crosses the replicate links.

A single process (comm.py's ``Comm``: nothing to communicate) keeps no separate full-size buffer:
the bucket buffer IS the shard. It exists only from the first flush of a backward to
``zero_grad`` (unless capturable): a staged grad is held exactly as torch holds ``param.grad``,
so peak memory stays torch's.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence

import torch
from torch import Tensor

from . import _compat, kernels
from .buffers import BucketBuffers
from .comm import Comm
from .layout import Bucket, ParamSlot


MAX_IN_FLIGHT = 2  # reductions whose full-size input a CPU rank holds at once
# World > 1: staged (not yet copied) grads a bucket may hold, as a fraction of the bucket, on
# top of its full-size buffer: ZeRO-2's O(bucket_cap_mb) backward memory grows by at most this.
STAGE_FRACTION = 4


@dataclass
class Reduction:
    """One bucket's reduction in flight."""

    bucket: int
    work: Any  # the collective to wait for: the reduce-scatter, then the replicas' all-reduce
    full: Optional[Tensor]  # the full-size input, held (CPU) until the reduce-scatter has landed
    out: Optional[Tensor]  # where the reduced shard lands: the shard, or a temporary to add to it
    accumulate: bool  # add ``out`` into the shard once landed
    scattered: bool  # the reduce-scatter has landed (or is waited for on the side stream)


class GradSync:
    def __init__(
        self,
        buckets: List[Bucket],
        buffers: List[BucketBuffers],
        params: Sequence[torch.nn.Parameter],
        comm: Comm,
        overlap: bool,
        keep_buffers: bool,
    ) -> None:
        self.buckets = buckets
        self.buffers = buffers
        self.comm = comm
        # one process: the bucket buffer is the shard, grads land in it directly
        self.local = comm.world_size == 1
        self.overlap = overlap
        # one process, not capturable: the shard (= bucket buffer) is released at zero_grad
        self.release_shards = self.local and not keep_buffers
        self.keep_buffers = keep_buffers or self.local
        # backwards begun so far: a new one starts the optimizer's next step round (it compares)
        self.backwards = 0
        self.stepped_since_zero = False  # a backward now adds to the grads the last step used
        self.warned_no_zero_grad = False
        self.n_params = len(params)
        self.params = list(params)  # shape and strides of each param's view in a bucket buffer

        self.slots: dict[int, ParamSlot] = {}
        for bucket in buckets:
            for slot in bucket.slots:
                self.slots[slot.index] = slot
        # backward readiness: params still to fire in the current backward, per bucket
        self.expected = [sum(s.requires_grad for s in b.slots) for b in buckets]
        self.fired = [0] * len(buckets)
        self.next_launch = 0  # buckets [0, next_launch) have been launched in the current round
        self.enabled = True  # False inside no_sync()
        self.callback_queued = False
        self.rounds_since_step = 0
        self.grad_since_zero = False
        # host-side truth of "this param got a grad on this rank since zero_grad"
        self.local_touched = [False] * self.n_params
        # grads in a bucket buffer not reduced yet (accumulate vs overwrite)
        self.in_buffer = [False] * self.n_params
        # staged grads: taken from param.grad, not yet copied into the bucket buffer
        self.staged_idx: List[List[int]] = [[] for _ in buckets]
        self.staged_grads: List[List[Tensor]] = [[] for _ in buckets]
        self.bucket_in_buffer = [False] * len(buckets)  # some in_buffer flag of the bucket is set
        self.staged_bytes = [0] * len(buckets)
        self.is_staged = [False] * self.n_params
        self.flush_bytes = [
            b.numel * buffers[i].grad_dtype.itemsize // (1 if self.local else STAGE_FRACTION)
            for i, b in enumerate(buckets)
        ]
        self.offsets = [0] * self.n_params
        for i, slot in self.slots.items():
            self.offsets[i] = slot.offset
        self.shard_valid = [False] * len(buckets)
        self.full: List[Optional[Tensor]] = [None] * len(buckets)
        if self.local:
            for i, buf in enumerate(buffers):
                if self.release_shards:
                    buf.release_grad_shard()
                else:
                    self.full[i] = buf.grad_shard  # the shard is the whole bucket
        elif keep_buffers:
            for i, b in enumerate(buckets):
                self.full[i] = self._new_full(i)
        self.dirty = [False] * len(buckets)  # full buffer holds stale grads: zero before use
        self.pending: List[Reduction] = []
        # On CUDA each bucket's stats partial (sum g^2, non-finite flag) is computed on a side
        # stream as soon as its reduce-scatter lands, hidden under the rest of backward; after
        # backward only the one small all-reduce remains (grad_stats.py sums the partials).
        device = buckets[0].device if buckets else torch.device("cpu")
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.partials = torch.zeros(len(buckets), 2, dtype=torch.float32, device=device)
        self.partial_valid = [False] * len(buckets)
        self.partials_zeroed = False  # zeroed once per round, not once per bucket
        # A param belongs to the LAST optimizer built over it: an older one's hook stands aside.
        self.owner_token = object()
        for p in params:
            p._shardamp_owner = self.owner_token
        ref = weakref.ref(self)  # hooks live as long as the params; they must not pin the buffers
        # per param, what the hook needs: (index, bucket, bytes its staged grad holds)
        self.record = {id(p): (i, self.slots[i].bucket, self.slots[i].numel * p.element_size())
                       for i, p in enumerate(params) if i in self.slots}

        def hook(param: torch.nn.Parameter) -> None:
            me = ref()
            if me is not None:
                me._hook(param)

        self.handles = [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]

    # ---------------------------------------------------------------- backward
    def _hook(self, param: torch.nn.Parameter) -> None:
        # Runs once per param per backward: keep it to a few attribute and list operations.
        grad = param.grad
        if grad is None:
            return
        if getattr(param, "_shardamp_owner", None) is not self.owner_token:
            return  # a newer optimizer took this param over; its own hook handles the grad
        if grad.is_sparse:
            raise RuntimeError("DistributedFusedAdam does not support sparse gradients")
        param.grad = None
        if not self.callback_queued:  # first grad of this backward
            self.callback_queued = True
            self.backwards += 1
            if self.stepped_since_zero:
                self._warn_no_zero_grad()
            self.grad_since_zero = True
            _compat.queue_backward_callback(self._end_of_backward)
        i, b, nbytes = self.record[id(param)]
        if self.is_staged[i]:  # a second grad before the flush: land the first one
            self._flush(b)
        self.is_staged[i] = True
        self.local_touched[i] = True
        self.staged_idx[b].append(i)
        self.staged_grads[b].append(grad)
        staged = self.staged_bytes[b] = self.staged_bytes[b] + nbytes
        fired = self.fired[b] = self.fired[b] + 1
        if fired >= self.expected[b]:
            self._flush(b)
            if self.enabled and self.overlap:
                self._launch_ready()
        elif staged >= self.flush_bytes[b]:
            self._flush(b)

    def _warn_no_zero_grad(self) -> None:
        self.stepped_since_zero = False
        if not self.warned_no_zero_grad:
            self.warned_no_zero_grad = True
            warnings.warn(
                "DistributedFusedAdam: backward after step() without opt.zero_grad(): the new "
                "grads are ADDED to the last step's, as torch does when grads are not zeroed. "
                "model.zero_grad() cannot clear them (they live in the optimizer's shards, "
                "param.grad is None): call opt.zero_grad() every step.",
                UserWarning,
                stacklevel=2,
            )

    def _writable_full(self, b: int) -> Tensor:
        """Bucket ``b``'s full-size buffer, allocated (zeros) or zeroed if stale."""
        full = self.full[b]
        if full is None:
            if self.local:
                full = self.full[b] = self.buffers[b].grad_shard  # allocated as zeros if released
            else:
                full = self.full[b] = self._new_full(b)
        elif self.dirty[b]:
            full.zero_()
        self.dirty[b] = False
        return full

    def _flush(self, b: int) -> None:
        """Copy (or add) bucket ``b``'s staged grads into its buffer: one multi-tensor op each."""
        idx = self.staged_idx[b]
        if not idx:
            return
        grads = self.staged_grads[b]
        self.staged_idx[b], self.staged_grads[b], self.staged_bytes[b] = [], [], 0
        full = self._writable_full(b)
        self.partial_valid[b] = False
        params, offsets, in_buffer, is_staged = self.params, self.offsets, self.in_buffer, self.is_staged
        for i in idx:
            is_staged[i] = False
        # one process: the buffer is the shard, so a valid shard is accumulated into, as param.grad is
        acc_all = self.local and self.shard_valid[b]
        if acc_all or not self.bucket_in_buffer[b]:  # the common cases: all adds, or all copies
            for i in idx:
                in_buffer[i] = True
            self.bucket_in_buffer[b] = True
            kernels.land_grads(full, grads, [params[i] for i in idx], [offsets[i] for i in idx], accumulate=acc_all)
            return
        copy = ([], [], [])  # grads, like (the param: shape and strides), offsets
        add = ([], [], [])
        for i, grad in zip(idx, grads):
            lists = add if in_buffer[i] else copy
            in_buffer[i] = True
            lists[0].append(grad)
            lists[1].append(params[i])
            lists[2].append(offsets[i])
        if copy[0]:
            kernels.land_grads(full, *copy, accumulate=False)
        if add[0]:
            kernels.land_grads(full, *add, accumulate=True)

    def flush_all(self) -> None:
        for b in range(len(self.buckets)):
            self._flush(b)

    def _new_full(self, b: int) -> Tensor:
        bucket = self.buckets[b]
        return torch.zeros(bucket.numel, dtype=self.buffers[b].grad_shard.dtype, device=bucket.device)

    def _launch_ready(self) -> None:
        # in layout.backward_order: bucket 0 (the last layers) first
        while self.next_launch < len(self.buckets) and self.fired[self.next_launch] >= self.expected[self.next_launch]:
            self._launch(self.next_launch)

    def _end_of_backward(self) -> None:
        self.callback_queued = False
        self.flush_all()
        if self.overlap and self.enabled:
            self._finish_round()
        self.fired = [0] * len(self.buckets)

    def _finish_round(self) -> None:
        while self.next_launch < len(self.buckets):
            self._launch(self.next_launch)
        self.next_launch = 0
        self.fired = [0] * len(self.buckets)
        self.rounds_since_step += 1
        self.partials_zeroed = False  # the next round recomputes (and first zeroes) them all

    def _launch(self, b: int) -> None:
        """Reduce-scatter bucket ``b`` (every rank calls this for every bucket, in order)."""
        self.next_launch = b + 1
        self._flush(b)
        bucket = self.buckets[b]
        for s in bucket.slots:
            self.in_buffer[s.index] = False
        self.bucket_in_buffer[b] = False
        full = self._writable_full(b)  # no grad here on this rank: contribute zeros
        if self.local:
            self.shard_valid[b] = True
            if self.side is not None:
                self._land_on_side_stream(b, None, None, False)
            return
        accumulate = self.shard_valid[b]
        out = torch.empty_like(self.buffers[b].grad_shard) if accumulate else self.buffers[b].grad_shard
        work = self.comm.reduce_scatter(out, full)
        if self.side is not None:
            self._land_on_side_stream(b, work, out, accumulate, None if self.keep_buffers else full)
            self.pending.append(Reduction(b, None, None, None, False, True))
        else:
            self.pending.append(Reduction(b, work, full, out, accumulate, False))
            self._retire(MAX_IN_FLIGHT)
        if self.keep_buffers:
            self.dirty[b] = True  # holds this round's grads until the next round overwrites them
        else:
            self.full[b] = None  # freed once the reduction has been waited for
        self.shard_valid[b] = True

    def _land_on_side_stream(
        self, b: int, work, out: Optional[Tensor], accumulate: bool, full: Optional[Tensor] = None
    ) -> None:
        """Queue, on the side stream: wait for bucket ``b``'s reduction, accumulate it, and
        compute its stats partial. The host does not wait; ``wait()`` joins the streams."""
        self.side.wait_stream(torch.cuda.current_stream())
        shard = self.buffers[b].grad_shard
        with torch.cuda.stream(self.side):
            if work is not None:
                work.wait()
                # issued on the side stream: it starts once the reduce-scatter has landed
                replicas = self.comm.reduce_replicas(out)
                if replicas is not None:
                    replicas.wait()
            if accumulate:
                shard.add_(out)
            if not self.partials_zeroed:
                self.partials.zero_()  # every bucket's partial is recomputed in this round
                self.partials_zeroed = True
            kernels.grad_stats(shard, self.partials[b], 2.0)
        for t in (full, out):
            if t is not None:
                # freed by the caller right away: the allocator reuses the memory only once the
                # side stream (which waited for the collective) has passed this point
                t.record_stream(self.side)
        self.partial_valid[b] = True
        if work is None:
            self.pending.append(Reduction(b, None, None, None, False, True))

    def landed_stats(self, out: Tensor) -> bool:
        """Write the summed 2-norm partials of all buckets into ``out[:2]`` if every bucket's
        partial is current (then return True); the caller computes them itself otherwise."""
        if self.side is None or not all(self.partial_valid):
            return False
        torch.sum(self.partials, dim=0, out=out[:2])  # a sum of 0/1 flags is still "any" (> 0)
        return True

    # ---------------------------------------------------------------- explicit sync
    def sync(self) -> None:
        """Finish the gradient reduction: launch what is left, then wait for every bucket.

        A step always consumes at least one complete round, so a rank whose backward touched
        none of the params still joins the collectives the other ranks issued.
        """
        self.flush_all()
        if self.next_launch > 0 or self.rounds_since_step == 0 or any(self.in_buffer):
            self._finish_round()
        self.wait()

    def _retire(self, keep: int) -> None:
        """Wait (on the host: CPU/gloo) for the oldest reduce-scatters until at most ``keep``
        hold a full-size buffer, so backward keeps O(bucket_cap_mb) of unreduced grads, not the
        model's. A landed shard's all-reduce over the replicas is launched here, waited in ``wait``."""
        held = [r for r in self.pending if not r.scattered]
        for r in held[: max(len(held) - keep, 0)]:
            r.work.wait()
            r.full, r.scattered = None, True
            r.work = self.comm.reduce_replicas(r.out)
            if r.work is None:
                self._land(r)

    def _land(self, r: Reduction) -> None:
        if r.accumulate:
            self.buffers[r.bucket].grad_shard.add_(r.out)
        r.work, r.out, r.accumulate = None, None, False

    def wait(self) -> None:
        self._retire(0)
        for r in self.pending:
            if r.work is not None:
                r.work.wait()
                self._land(r)
        if self.side is not None and self.pending:
            # join: the compute stream resumes after every landing; only then may the
            # buffers the side stream read be freed (they are dropped with ``pending``)
            torch.cuda.current_stream().wait_stream(self.side)
        self.pending.clear()

    def alive_full_buffers(self) -> List[Tensor]:
        """The full-size bucket buffers alive now (not counting a shard that IS its bucket)."""
        shard_ptrs = {buf.grad_store.data_ptr() for buf in self.buffers if buf.grad_store is not None}
        held = [f for f in self.full if f is not None and f.data_ptr() not in shard_ptrs]
        held += [r.full for r in self.pending if r.full is not None]
        return list({id(t): t for t in held}.values())

    def step_done(self) -> None:
        self.rounds_since_step = 0
        self.stepped_since_zero = True

    def zero(self, set_to_none: bool) -> None:
        """``zero_grad``: drop local and reduced grads (not yet reduced ones too)."""
        self.wait()
        self.stepped_since_zero = False
        self.next_launch = 0
        self.fired = [0] * len(self.buckets)
        self.in_buffer = [False] * self.n_params
        self.partial_valid = [False] * len(self.buckets)
        self.partials_zeroed = False
        self.callback_queued = False  # a backward that raised never ran its callback
        self.staged_idx = [[] for _ in self.buckets]
        self.staged_grads = [[] for _ in self.buckets]
        self.bucket_in_buffer = [False] * len(self.buckets)
        self.staged_bytes = [0] * len(self.buckets)
        self.is_staged = [False] * self.n_params
        if set_to_none:
            self.local_touched = [False] * self.n_params
            self.shard_valid = [False] * len(self.buckets)
            self.grad_since_zero = False
        else:
            for buf in self.buffers:
                buf.grad_shard.zero_()
        if self.release_shards and set_to_none:
            # one process: no grads exist until the next backward, as in torch (peak memory)
            for buf in self.buffers:
                buf.release_grad_shard()
            self.full = [None] * len(self.buckets)
            self.dirty = [False] * len(self.buckets)
        elif self.keep_buffers:
            # one process: the buffer is the shard; zeroed lazily before the next write
            self.dirty = [set_to_none or not self.local] * len(self.buckets)
        else:
            self.full = [None] * len(self.buckets)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def __del__(self) -> None:
        self.remove_hooks()

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
