"""The backward state GradSync (grad_sync.py) keeps: one :class:`ParamGrad` per param (where its
grad lands), one :class:`BucketGrads` per bucket (readiness, its full-size buffer, its shard,
its statistics row, and the landing of its staged grads there) and one :class:`Reduction` per
bucket reduction in flight.

A grad walks down: the hook stages it (grad_stager.py), GradSync decides when its bucket lands
and launches (grad_sync.py), the bucket lands it into its buffer here (``BucketGrads.flush``),
into the shard shards/buffers.py holds; nothing below calls back up."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import kernels
from ..layout import Bucket, ParamSlot
from ..shards.buffers import BucketBuffers


@dataclass(eq=False)
class ParamGrad:
    """One param's backward state: where its grad lands, and whether it is staged or landed."""

    index: int  # in the optimizer's param order
    param: torch.nn.Parameter  # shape and strides of its view in the bucket buffer
    offset: int  # its first element in the bucket buffer
    nbytes: int  # bytes its staged grad holds
    # its BucketGrads' index in GradSync.states (an index, not the object: a reference back to
    # the bucket, which lists its params, would be a cycle, and the bucket's buffers would
    # outlive the optimizer until Python's cyclic collector ran)
    bucket: int


@dataclass(eq=False)
class BucketGrads:
    """One bucket's backward state: readiness, staged grads, its full-size buffer, its shard."""

    index: int  # position in the reduction order (layout.backward_order)
    bucket: Bucket
    buffers: BucketBuffers  # ``grad_shard``: where the reduced shard lands
    expected: int  # params that fire in a backward (those requiring grad)
    flush_bytes: int  # staged bytes that trigger a copy into the buffer
    partial: Tensor  # GradSync.partials, which every bucket adds its shard's [sum g^2, non-finite flag] into
    params: List[ParamGrad] = field(default_factory=list)  # every param of the bucket
    # (its staged grads and the count of params that fired in this backward: the stager's)
    # stager indices of the params whose grad is in the buffer, not reduced yet (a second grad
    # of one of them is added, not copied)
    in_buffer: set = field(default_factory=set)
    full: Optional[Tensor] = None  # the full-size grad buffer (one process: the shard itself)
    dirty: bool = False  # ``full`` holds stale grads: zero before use
    shard_valid: bool = False  # the shard holds grads since zero_grad (a reduction adds to them)
    partial_valid: bool = False  # ``partial`` is current for the shard

    def clear_round(self) -> None:
        """Forget which params' grads are in the buffer (zero_grad; the stager clears its own)."""
        self.in_buffer.clear()
        self.partial_valid = False

    # ------------------------------------------------------------ landing staged grads
    def new_full(self, zeroed: bool = True) -> Tensor:
        """A full-size buffer for this bucket: zeros, or uninitialized for a landing that zeroes
        what it does not write."""
        make = torch.zeros if zeroed else torch.empty
        return make(self.bucket.numel, dtype=self.buffers.grad_dtype, device=self.bucket.device)

    def writable_full(self, in_place: bool) -> Tensor:
        """This bucket's full-size buffer, allocated (zeros) or zeroed if stale. ``in_place``:
        one process, the buffer is the shard."""
        full = self.full
        if full is None:
            full = self.full = self.buffers.grad_shard if in_place else self.new_full()  # zeros if released
        elif self.dirty:
            full.zero_()
        self.dirty = False
        return full

    def flush(self, stager: Any, in_place: bool, by_stager_index: Sequence[ParamGrad]) -> None:
        """Copy (or add) this bucket's staged grads (``stager``'s) into its buffer
        (``kernels.land_grads``). ``by_stager_index``: the params by their stager index."""
        if not stager.staged_count(self.index):
            return
        self.partial_valid = False
        # one process: the buffer is the shard, so a valid shard is accumulated into, as param.grad is
        acc_all = in_place and self.shard_valid
        if not acc_all and not self.in_buffer:  # the common case: all copies, the first into this buffer
            self.land_first(stager, in_place)
            return
        full = self.writable_full(in_place)
        indices, grads = stager.take(self.index)
        for accumulate in (False, True):  # first grads are copied, later ones added
            pick = [(k, g) for k, g in zip(indices, grads) if (acc_all or k in self.in_buffer) == accumulate]
            if pick:
                params = [by_stager_index[k] for k, _ in pick]
                kernels.land_grads(full, [g for _, g in pick], [p.param for p in params], [p.offset for p in params],
                                   accumulate=accumulate)
        self.in_buffer.update(indices)

    def land_first(self, stager: Any, in_place: bool) -> None:
        """The staged grads copied into a buffer that holds none of this round's: one allocated
        uninitialized (or holding stale values) has the rest zeroed in the same pass
        (``land_grads``' ``zero_rest``: no zero fill launch of its own)."""
        fresh = False
        if self.full is None:
            if in_place:
                self.full, fresh = self.buffers.landing_shard()
            else:
                self.full, fresh = self.new_full(zeroed=False), True
        stale, self.dirty = fresh or self.dirty, False
        try:
            self.in_buffer.update(stager.land(self.index, self.full, stale))
        except BaseException:
            if fresh and in_place:  # released again: read as zeros, as before this landing
                self.buffers.release_grad_shard()
                self.full = None
            elif stale:  # zeroed before its next write
                self.dirty = True
            raise


@dataclass(eq=False)
class Reduction:
    """One bucket's reduction in flight."""

    bucket: BucketGrads
    work: Any  # the collective to wait for: the reduce-scatter, then the replicas' all-reduce
    full: Optional[Tensor]  # the full-size input, held (CPU) until the reduce-scatter has landed
    out: Optional[Tensor]  # where the reduced shard lands: the shard, or a temporary to add to it
    accumulate: bool  # add ``out`` into the shard once landed
    scattered: bool  # the reduce-scatter has landed (or is waited for on the side stream)


# World > 1: staged (not yet copied) grads a bucket may hold, as a fraction of the bucket, on
# top of its full-size buffer: ZeRO-2's O(bucket_cap_mb) backward memory grows by at most this.
STAGE_FRACTION = 4


def grad_states(buckets: Sequence[Bucket], buffers: Sequence[BucketBuffers], params: Sequence[torch.nn.Parameter],
                slots: Dict[int, ParamSlot], partial: Tensor, staged: bool
                ) -> Tuple[List[BucketGrads], Dict[int, ParamGrad], List[ParamGrad]]:
    """The backward state of an optimizer's buckets and params: a :class:`BucketGrads` per bucket
    (``staged``: grads wait for their bucket's copy, up to 1 / ``STAGE_FRACTION`` of it; else each
    lands at once), and a :class:`ParamGrad` per param with a slot, by ``id(param)`` and in the
    params' order (the grad stager's indexing). ``partial``: the shared stats row every bucket
    adds its norm partial into."""
    divisor = STAGE_FRACTION if staged else 1
    states = [BucketGrads(i, b, buffers[i], expected=sum(s.requires_grad for s in b.slots),
                          flush_bytes=b.numel * buffers[i].grad_dtype.itemsize // divisor, partial=partial)
              for i, b in enumerate(buckets)]
    record: Dict[int, ParamGrad] = {}
    ordered: List[ParamGrad] = []
    for i, p in enumerate(params):
        if i in slots:
            slot = slots[i]
            entry = ParamGrad(i, p, slot.offset, slot.numel * p.element_size(), states[slot.bucket].index)
            states[slot.bucket].params.append(entry)
            record[id(p)] = entry
            ordered.append(entry)
    return states, record, ordered
