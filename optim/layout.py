"""Who owns which slice: params laid out in flat buckets, each bucket split into one contiguous
shard per rank.

Pure bookkeeping (no tensors are allocated here). A param occupies ``numel`` consecutive bucket
elements in its own MEMORY order (what ``as_strided(buffer, shape, stride, offset)`` addresses),
so a channels_last weight is stored exactly as it lies in memory and never needs ``.view(-1)``.
Every param starts at a multiple of ``ALIGN`` elements and every shard is a multiple of
``ALIGN`` long, so vectorised kernels see aligned segment starts; the padding is never updated.
With a blockwise moment format (``"8bit"`` / ``"4bit"``, ``state_formats.py``) every shard is
also a multiple of the format's block (``block``, a multiple of ``ALIGN``): shard boundaries fall
on the bucket's block grid, so no block straddles two ranks and a block holds the same bucket
elements at every world size. Param offsets never depend on the world size or the block (but
for one process on CUDA, whose large buckets are also cut at the grads its launches read in
place: never with a blockwise moment).

Two steps: :func:`plan_buckets` is the bucket POLICY (which params share a bucket, in which
order), :func:`pack` the mechanics (offsets, alignment, shards, segment tables). A new policy
touches only the first.

THE ORDER (stated here only): buckets are planned in BACKWARD order, the reverse of param_groups
order, which is the order backward usually produces grads; so bucket 0 fills first and is
reduced first (:func:`backward_order`), and the LAST bucket holds the first layers. The step
updates and all-gathers buckets in :func:`forward_order`, so the first module's params land first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ._compat import is_dense_non_overlapping

ALIGN = 16  # elements; 64 bytes of fp32, the widest vector the kernels load


@dataclass
class ParamSlot:
    """Where one param lives: bucket, offset in the bucket, and its memory layout."""

    index: int  # position of the param in param_groups order
    group: int  # param group index
    bucket: int
    offset: int  # first element in the bucket
    numel: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    requires_grad: bool


@dataclass
class Segment:
    """The part of one param that falls in one rank's shard."""

    start: int  # first element in the shard
    length: int
    param_index: int
    group: int
    param_offset: int  # first element within the param (memory order)


@dataclass
class SegmentTable:
    """The segments of one shard, host-side (for the reference and state dicts) and as an int64
    ``[S, 4]`` tensor of ``(start, length, param_index, group)`` that kernels read. ``extra``
    caches tables a kernel derives from it (e.g. a block-to-chunk map), keyed by the kernel."""

    segments: List[Segment]
    table: torch.Tensor
    extra: Dict[str, torch.Tensor] = field(default_factory=dict)
    spans: List[int] = field(init=False, repr=False)  # (start, length) of each segment, flat

    def __post_init__(self) -> None:
        self.spans = [n for s in self.segments for n in (s.start, s.length)]

    @classmethod
    def build(cls, segments: List[Segment], device: torch.device) -> "SegmentTable":
        rows = [[s.start, s.length, s.param_index, s.group] for s in segments]
        table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 4).to(device)
        return cls(segments, table)


@dataclass
class Bucket:
    """One flat buffer's worth of params of a single dtype and device."""

    index: int
    dtype: torch.dtype
    device: torch.device
    slots: List[ParamSlot]
    numel: int = 0  # padded: shard_size * shard_numel
    shard_numel: int = 0
    shard_start: int = 0  # this rank's shard: [shard_start, shard_start + shard_numel)
    segments: SegmentTable | None = None


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def grouped_params(param_groups: Sequence[Dict[str, Any]]) -> List[Tuple[torch.nn.Parameter, int]]:
    """Every param with the index of its group, in ``param_groups`` order (the optimizer's order)."""
    return [(p, g) for g, group in enumerate(param_groups) for p in group["params"]]


def params_device(params: Sequence[torch.nn.Parameter]) -> torch.device:
    """The one device every param is on.

    Raises:
        ValueError: params on several devices, on the meta device, or not floating point.
    """
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"params: all parameters must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "meta":
        raise ValueError("params: parameters are on the meta device; materialise the model first")
    for i, p in enumerate(params):
        if not p.is_floating_point() or p.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"params: parameter {i} has dtype {p.dtype}; expected a floating-point dtype")
    return device


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def backward_order(n_buckets: int) -> range:
    """The order buckets fill and are reduced in (bucket 0 first)."""
    return range(n_buckets)


def forward_order(n_buckets: int) -> range:
    """The order the step updates and all-gathers buckets in (the first layers' bucket first)."""
    return range(n_buckets - 1, -1, -1)


def plan_buckets(params: Sequence[Tuple[torch.Tensor, int]], bucket_cap_mb: float,
                 max_params: Optional[int] = None, cut_bytes: int = 0) -> List[List[int]]:
    """The bucket policy: param indices per bucket, each in backward order (see the module
    docstring). A bucket holds one dtype and device and at most ``bucket_cap_mb`` of it (a
    larger param gets a bucket of its own); where ``max_params`` is given, a bucket that holds
    that many params and at least ``cut_bytes`` is closed too (one process on CUDA: the most
    grads a bucket's launches read where autograd left them, sync/merged_landings.py
    ``held_bucket_bound``; a bucket past it is copied into its shard)."""
    if max_params is not None and max_params < 1:
        raise ValueError(f"plan_buckets: max_params={max_params} must be >= 1 (or None)")
    cap_bytes = max(int(bucket_cap_mb * 2**20), 1)
    open_plan: Dict[Tuple[torch.dtype, torch.device], int] = {}  # key -> plan index
    open_bytes: Dict[Tuple[torch.dtype, torch.device], int] = {}
    plan: List[List[int]] = []
    for index in reversed(range(len(params))):
        p, _group = params[index]
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        b = open_plan.get(key)
        if b is not None and (open_bytes[key] + nbytes > cap_bytes
                              or (max_params is not None and len(plan[b]) >= max_params
                                  and open_bytes[key] >= cut_bytes)):
            b = None
        if b is None:
            b = open_plan[key] = len(plan)
            plan.append([])
            open_bytes[key] = 0
        plan[b].append(index)
        open_bytes[key] += nbytes
    return plan


def build_layout(
    params: Sequence[Tuple[torch.Tensor, int]],
    bucket_cap_mb: float,
    shard_size: int,
    shard_rank: int,
    block: int = ALIGN,
    max_params: Optional[int] = None,
    cut_bytes: int = 0,
) -> List[Bucket]:
    """Assign ``params`` (each ``(param, group_index)``, in param_groups order) to buckets
    (:func:`plan_buckets`) and pack them (:func:`pack`). The result is identical on every rank,
    which is what makes the fixed collective order possible. ``block``: every shard is a
    multiple of it (``MomentFormats.grid``: the blockwise moments' block, else ``ALIGN``).
    ``max_params``, ``cut_bytes``: :func:`plan_buckets`'."""
    for index, (p, _group) in enumerate(params):
        if not is_dense_non_overlapping(p):
            raise ValueError(
                f"params: parameter {index} (shape {tuple(p.shape)}, stride {p.stride()}) is not "
                "dense and non-overlapping; make it contiguous (or channels_last) before building "
                "the optimizer"
            )
    return pack(plan_buckets(params, bucket_cap_mb, max_params, cut_bytes), params, shard_size, shard_rank, block)


def pack(plan: List[List[int]], params: Sequence[Tuple[torch.Tensor, int]], shard_size: int,
         shard_rank: int, block: int = ALIGN) -> List[Bucket]:
    """Lay out each planned bucket: aligned offsets in plan order, split into ``shard_size``
    shards (the shard dim of the optimizer's comm.py span) of a multiple of ``block`` elements
    each; this rank's segment table.

    Raises:
        ValueError: ``block`` is not a positive multiple of ``ALIGN``.
    """
    if block <= 0 or block % ALIGN:
        raise ValueError(f"block={block}: expected a positive multiple of ALIGN={ALIGN}")
    buckets: List[Bucket] = []
    for indices in plan:
        first = params[indices[0]][0]
        bucket = Bucket(index=len(buckets), dtype=first.dtype, device=first.device, slots=[])
        buckets.append(bucket)
        for index in indices:
            p, group = params[index]
            offset = _round_up(sum(s_end(s) for s in bucket.slots[-1:]), ALIGN)
            bucket.slots.append(ParamSlot(index, group, bucket.index, offset, p.numel(), tuple(p.shape),
                                          tuple(p.stride()), p.requires_grad))
    for bucket in buckets:
        used = _round_up(s_end(bucket.slots[-1]), ALIGN)
        # the padding after the last param adds whole blocks (or fills the last one), the same
        # elements at every world size: at most block * shard_size of them
        bucket.shard_numel = _round_up(max(used, 1), block * shard_size) // shard_size
        bucket.numel = bucket.shard_numel * shard_size
        bucket.shard_start = shard_rank * bucket.shard_numel
        bucket.segments = SegmentTable.build(shard_segments(bucket, shard_rank), bucket.device)
    return buckets


def s_end(slot: ParamSlot) -> int:
    return slot.offset + slot.numel


def shard_segments(bucket: Bucket, rank: int) -> List[Segment]:
    """The segments of ``rank``'s shard of ``bucket``, in shard order."""
    lo = rank * bucket.shard_numel
    hi = lo + bucket.shard_numel
    out = []
    for slot in bucket.slots:
        a, b = max(slot.offset, lo), min(s_end(slot), hi)
        if a < b:
            out.append(Segment(a - lo, b - a, slot.index, slot.group, a - slot.offset))
    return out
