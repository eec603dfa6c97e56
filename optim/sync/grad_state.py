"""The backward state GradSync (grad_sync.py) keeps: one :class:`ParamGrad` per param (where its
grad lands), one :class:`BucketGrads` per bucket (readiness, its full-size buffer, its shard,
its statistics row) and one :class:`Reduction` per bucket reduction in flight."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from torch import Tensor

from ..layout import Bucket
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


@dataclass(eq=False)
class Reduction:
    """One bucket's reduction in flight."""

    bucket: BucketGrads
    work: Any  # the collective to wait for: the reduce-scatter, then the replicas' all-reduce
    full: Optional[Tensor]  # the full-size input, held (CPU) until the reduce-scatter has landed
    out: Optional[Tensor]  # where the reduced shard lands: the shard, or a temporary to add to it
    accumulate: bool  # add ``out`` into the shard once landed
    scattered: bool  # the reduce-scatter has landed (or is waited for on the side stream)
