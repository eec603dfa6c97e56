"""Norm math, in one place: plain functions over device tensors, no communication, no sync.

A norm of order ``p`` over grads spread across shards (and buckets, and ranks) is built from
PARTIALS: ``sum |g|^p`` for finite ``p``, ``max |g|`` for ``p = inf``, each with a non-finite
flag, computed in one pass per shard (``kernels.partials``, over ``kernels.grad_stats``).
Partials combine by SUM (finite ``p``) or MAX (``inf``): ``reduce_op`` names the collective's op,
and a max (or sum) of 0/1 flags is still their "any". The norm is the ``p``-th root of the
combined partial (``root``). Norms of disjoint sets of grads combine into the norm of their
union (``combine``), as ``torch.nn.utils.get_total_norm`` does. Clipping to ``max_norm``
multiplies grads by ``clip_coef``; clipping twice clips the already-clipped grads
(``chained_clip_coef``).

Plain math over tensors, importing nothing of shardamp: the reference kernels use it as their
spec; the partials themselves are computed by the kernels (``kernels/partials.py``).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

PARTIAL = 2  # a partial's length: [sum |g|^p (or max |g|), non-finite flag]


def reduce_op(norm_type: float):
    """The op partials combine by across ranks: MAX for ``inf``, SUM otherwise."""
    return dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM


def root(combined: Tensor, norm_type: float) -> Tensor:
    """The norm from a combined (all-reduced) partial's first entry ``combined`` (0-d)."""
    # one op at most: on a GPU each is a launch the host pays for before the step kernel
    if math.isinf(norm_type):
        return combined
    if norm_type == 2.0:
        return combined.sqrt()
    return combined.pow(1.0 / norm_type)


def combine(norms: Sequence[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """The norm of the union of disjoint sets of grads whose norms are ``norms``:
    ``(sum n_i^p)^(1/p)``, or the max for ``inf``; float32 on ``device``."""
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def torch_clip_coef(max_norm: float, norm: Tensor) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient exactly (NaN for a NaN norm, as torch):
    what plain params (not an optimizer's shards) are multiplied by."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_coef(max_norm: float, norm: Tensor) -> Tensor:
    """torch's coefficient, but never NaN: 0-d float32 in [0, 1] (a non-finite norm skips the
    step through found-inf instead of writing NaN params)."""
    coef = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
    return torch.nan_to_num(coef, nan=1.0, posinf=1.0, neginf=1.0)


def chained_clip_coef(clips: Sequence[Tuple[float, Tensor]]) -> Optional[Tensor]:
    """The product of the coefficients of clipping, in order, to each ``(max_norm, norm)``:
    each later clip sees the grads (so the norm) the earlier ones have already scaled down.
    None when there is no clip."""
    coef = None
    for max_norm, norm in clips:
        c = clip_coef(max_norm, norm if coef is None else norm * coef)
        coef = c if coef is None else coef * c
    return coef
