"""What state-dict and checkpoint code may touch of a DistributedFusedAdam besides its public
API (``param_groups``, ``param_sync()``, the option attributes such as ``dtype``): the layout,
the buffers of this rank's shard, the step counts, the params, the device, the comm seam, what
the last step clipped and what the moments are stored as.

``opt.shard_view()`` returns it; nothing else of the optimizer's private state is read there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List

import torch
from torch import Tensor

from .buffers import BucketBuffers
from ..comm.collectives import Comm
from ..hparams import HparamTable
from ..layout import Bucket
from ..state_formats import MomentFormats


@dataclass(frozen=True)
class ShardView:
    buckets: List[Bucket]  # the layout (layout.py): slots, this rank's segments
    buffers: List[BucketBuffers]  # per bucket: params, master, moments of this rank's shard
    steps: Tensor  # float32 [num_params] per-param step counts (written in place on load)
    params: List[torch.nn.Parameter]  # in param_groups order
    device: torch.device
    comm: Comm  # every collective (comm.py)
    hparams: HparamTable  # invalidate() after changing param_groups' values
    # what the last step clipped (the step cycle's; the ranks agree on it before a state read)
    last_clips: Callable[[], Any]
    formats: MomentFormats  # what the moments are stored as (state_formats.py)
