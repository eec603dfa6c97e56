"""Norm partials of shards, computed by the kernels: ``sum |g|^p`` (``max |g|`` for ``inf``)
and a non-finite flag per shard, accumulated into a float32 ``[PARTIAL]`` slice (the layout and
how partials combine: ``norms.py``)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ..norms import PARTIAL
from . import dispatch as kernels


def accumulate_partial(shard: Tensor, out: Tensor, norm_type: float) -> None:
    """Add ``shard``'s partial into ``out[:PARTIAL]`` (max into it for ``inf``)."""
    kernels.grad_stats(shard, out, norm_type)


def partial(shards: Sequence[Tensor], norm_type: float, out: Optional[Tensor] = None,
            device: Optional[torch.device] = None, zeroed: bool = False) -> Tensor:
    """Fill ``out[:PARTIAL]`` (a new float32 tensor on ``device`` if None) with the partial of
    all ``shards`` (this rank's); return ``out``. ``zeroed``: ``out[:PARTIAL]`` already holds
    zeros (the step's stats buffer is built so), no op to zero it again."""
    if out is None:
        out = torch.zeros(PARTIAL, dtype=torch.float32, device=device)
    elif not zeroed:
        out[:PARTIAL].zero_()
    for g in shards:
        kernels.grad_stats(g, out[:PARTIAL], norm_type)
    return out
