"""The Adam step's launches: each bucket's :class:`AdamLaunch` (its shard's state and step
arguments by name), its compiled launch object prepared once (chunk map, launch shape), the
step's launches of every bucket in one native call (:func:`launch_adam_all`), and the CUDA step's
per-segment records of all buckets in one launch (:class:`StepRecords`). Which backend runs is
``dispatch.py``'s; blockwise moments take ``blockwise.py``'s launch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import blockwise, reference
from ..layout import SegmentTable
from ..state_formats import native_moment
from .dispatch import _NATIVE_DTYPES, _host_rows, _native
from .quant import QuantizedShard
from .launch_config import chunk_size, chunk_table, knobs, light_state, shard_chunks, store


_NO_GRAD = torch.empty(0)  # what a native launch holds between steps in place of the released grad shard


@dataclass(eq=False)
class AdamLaunch:
    """One shard's fused Adam/AdamW step, its arguments by name (contract: ``reference.py``).

    Built once per bucket (the shard's state, the step counts, the grad coefficient and the
    hyperparameter table persist across steps); what is new each step is given to the run:
    ``grad`` (the grad shard is released between steps), ``hparams``, ``touched``,
    ``found_inf`` and ``records`` (:meth:`StepRecords.compute` over several shards, CUDA; this
    shard's rows start at ``record_offset``; without them the CUDA step forms its scalars
    itself, one more launch). :func:`launch_adam_all` runs several with them, :func:`launch_adam` one.
    """

    grad: Optional[Tensor]  # the grad shard, assigned before each launch and dropped after it
    master: Tensor
    exp_avg: Union[Tensor, QuantizedShard]  # QuantizedShard: a blockwise moment's codes and scales
    exp_avg_sq: Union[Tensor, QuantizedShard]
    model_out: Optional[Tensor]
    segments: SegmentTable
    hparams: Tensor
    steps: Tensor
    touched: Tensor
    grad_coef: Tensor
    found_inf: Tensor
    adam_w_mode: bool
    bias_correction: bool
    records: Optional[Tensor] = None
    record_offset: int = 0
    _native: Any = field(default=None, repr=False)  # the extension's AdamLaunch, made at the first native launch
    _tuned: Any = field(default=None, repr=False)  # the tuning knobs its chunk map and shape were set for
    _grad_dtype: Any = field(default=None, repr=False)  # the grads' dtype they were set for
    # the blockwise moments' native descriptions, made at the first launch (blockwise.py)
    blockwise_natives: Any = field(default=None, repr=False)

    def native_state(self, grad_dtype: Optional[torch.dtype] = None) -> bool:
        """Whether the compiled kernels take this shard's state: an fp32 master (or int16
        remainders under a bf16 ``model_out``), fp32 or bf16 moments (``StateFormat.native``),
        fp32/bf16/fp16 grads (``grad_dtype``, else ``grad``'s) and params. fp64 state takes the
        reference path; a blockwise ``QuantizedShard`` its own launch (``blockwise.py``)."""
        master, out = self.master, self.model_out
        state = (master.dtype == torch.float32 or (master.dtype == torch.int16 and out is not None and out.dtype
                 == torch.bfloat16)) and native_moment(self.exp_avg.dtype) and native_moment(self.exp_avg_sq.dtype)
        grad_dtype = self.grad.dtype if grad_dtype is None else grad_dtype
        return state and grad_dtype in _NATIVE_DTYPES and (out is None or out.dtype in _NATIVE_DTYPES)


def launch_adam(launch: AdamLaunch) -> None:
    """Run one shard's step: the compiled kernel where it takes the state, else the reference.
    The launch lets go of its grad shard afterwards (it is released between steps)."""
    try:
        _launch_adam(launch)
    finally:
        launch.grad = None


def _launch_adam(launch: AdamLaunch) -> None:
    segments = launch.segments
    if not segments.segments:
        return
    ext = _native(launch.grad.device)
    if blockwise.takes(launch.exp_avg, launch.exp_avg_sq):
        blockwise.launch(ext, launch, _host_rows(segments))
        return
    cuda = launch.grad.is_cuda
    native = None if ext is None else _prepared(ext, launch, launch.grad, launch.hparams, knobs() if cuda else None)
    if native is None:
        reference.adam_step(launch.grad, launch.master, launch.exp_avg, launch.exp_avg_sq, launch.model_out,
                            _host_rows(segments), launch.hparams, launch.steps, launch.touched, launch.grad_coef,
                            launch.found_inf, launch.adam_w_mode, launch.bias_correction)
        return
    native.grad, native.touched, native.found_inf, native.grad_coef, native.hparams = (
        launch.grad, launch.touched, launch.found_inf, launch.grad_coef, launch.hparams)
    native.records = launch.records if cuda else None
    try:
        ext.adam_launch(native)
    finally:  # the grad shard is released between steps: holding it here would keep its memory alive
        native.grad = _NO_GRAD


def _prepared(ext: Any, launch: AdamLaunch, grad: Tensor, hparams: Tensor, tuned: Optional[tuple]) -> Optional[Any]:
    """The extension's launch object of ``launch`` for a step over ``grad`` (made at its first
    native launch), its chunk map and launch shape set for the tuning knobs in force (``tuned``:
    ``knobs()`` on CUDA, None on the CPU) and the grads' dtype (again only when either changes);
    None where the compiled kernels do not take the shard's state (``native_state``)."""
    native = launch._native
    if native is not None and launch._tuned is tuned and launch._grad_dtype is grad.dtype:
        return native  # the common case: its state kinds were checked when it was prepared
    if not launch.native_state(grad.dtype):
        return None
    if native is None:
        native = launch._native = ext.AdamLaunch(
            grad=_NO_GRAD, master=launch.master, exp_avg=launch.exp_avg, exp_avg_sq=launch.exp_avg_sq,
            model_out=launch.model_out, segments=launch.segments.table, hparams=hparams, steps=launch.steps,
            touched=launch.touched, grad_coef=launch.grad_coef, found_inf=launch.found_inf,
            adam_w_mode=launch.adam_w_mode, bias_correction=launch.bias_correction)
        native.record_offset = launch.record_offset
        native.segment_spans = launch.segments.spans  # where a segment's held grads are read (CUDA)
    light = light_state(launch.master, launch.exp_avg, launch.exp_avg_sq, grad.dtype)
    native.chunks = shard_chunks(ext, launch.segments, grad.device, launch.master.numel(), launch.steps, hparams, light)
    native.shape = tuned[0] if tuned is not None else 0
    launch._tuned, launch._grad_dtype = tuned, grad.dtype
    return native


def launch_adam_all(launches: Sequence[AdamLaunch], order: Sequence[int], grads: Sequence[Tensor],
                    hparams: Tensor, touched: Tensor, found_inf: Tensor, records: Optional[Tensor] = None,
                    prepare: Optional["StepRecords"] = None) -> None:
    """Run ``launches[i]`` for each ``i`` of ``order`` with ``grads[i]`` and the step's
    ``hparams``, ``touched``, ``found_inf`` (the skip flag) and ``records``, as
    :func:`launch_adam` each: in ONE native call where every launch takes the compiled kernels
    (a launch from Python costs tens of microseconds of host time on a GPU host), else one by
    one. ``prepare`` (instead of ``records``): the records are formed first from it, over the
    step counts, grad coefficient and bias correction the launches share, in the same native
    call where it can. The launches let go of their grad shards afterwards."""
    if not order:
        return
    held = getattr(grads, "held", None)  # shards.buffers.ShardGrads: a bucket's grads may be read in place
    first = held(order[0]) if held is not None else None
    device = first.marker.device if first is not None else grads[order[0]].device
    ext = _native(device)
    cuda = device.type == "cuda"
    natives: Optional[List[Any]] = None  # every launch's native object, if all take the compiled kernels
    shards: List[Tensor] = []
    if ext is not None and hasattr(ext, "adam_launch_all"):
        natives, shards = native_launches(ext, launches, order, grads, hparams)
    if natives and prepare is not None and prepare.table is not None and cuda:
        ext.adam_launch_all(natives, shards, hparams, touched, found_inf, prepare.records, prepare.table)
        return
    if prepare is not None:
        first = launches[order[0]]
        records = prepare.compute(hparams, first.steps, touched, first.grad_coef, found_inf, first.bias_correction)
    if natives is not None:
        if natives:
            ext.adam_launch_all(natives, shards, hparams, touched, found_inf, records if cuda else None)
        return
    for i in order:
        launch = launches[i]
        launch.grad, launch.hparams, launch.records = grads[i], hparams, records
        launch.touched, launch.found_inf = touched, found_inf
        launch_adam(launch)


def native_launches(ext: Any, launches: Sequence[AdamLaunch], order: Sequence[int], grads: Sequence[Tensor],
                    hparams: Tensor) -> Tuple[Optional[List[Any]], List[Tensor]]:
    """The extension's launch objects of ``launches[i]`` for each ``i`` of ``order`` that has
    segments, and their grad shards; ``(None, [])`` if some launch does not take the compiled
    kernels (its state kinds). Where ``grads`` holds a bucket's grads in place
    (``shards.buffers.ShardGrads.for_step``: one process) its launch is handed them
    (``set_held``, the launch then drops them) and an empty tensor stands in for its shard, so
    no shard is made for the step; the caller must launch what this returns."""
    natives, shards, parts = [], [], []
    order = [i for i in order if launches[i].segments.segments]
    for_step = getattr(grads, "for_step", None)  # shards.buffers.ShardGrads: the shards, or grads held in place
    read = for_step(order) if for_step is not None else [(grads[i], None) for i in order]
    tuned = knobs() if read and read[0][0].is_cuda else None
    for i, (grad, held) in zip(order, read):
        launch = launches[i]
        native = launch._native
        if native is None or launch._tuned is not tuned or launch._grad_dtype is not grad.dtype:
            native = _prepared(ext, launch, grad, hparams, tuned)  # the first step, or knobs or dtype changed
            if native is None:
                return None, []
        if held is not None:
            parts.append((native, held))
        natives.append(native)
        shards.append(grad)
    for native, held in parts:  # only once every launch is native: none is left holding them
        native.set_held(held.parts)
    return natives, shards


def adam_step(grad: Tensor, master: Tensor, exp_avg: Union[Tensor, QuantizedShard],
              exp_avg_sq: Union[Tensor, QuantizedShard], model_out: Optional[Tensor], segments: SegmentTable,
              hparams: Tensor, steps: Tensor, touched: Tensor, grad_coef: Tensor, found_inf: Tensor,
              adam_w_mode: bool, bias_correction: bool, records: Optional[Tensor] = None, record_offset: int = 0) -> None:
    """One step of one shard from its arguments as the reference states them (the kernels' tests
    and benchmarks call it so); the optimizer keeps an :class:`AdamLaunch` per bucket instead."""
    launch_adam(AdamLaunch(grad, master, exp_avg, exp_avg_sq, model_out, segments, hparams, steps, touched,
                           grad_coef, found_inf, adam_w_mode, bias_correction, records, record_offset))


def prepare(segment_tables: List[SegmentTable], numels: List[int], device: torch.device, n_params: int,
            n_groups: int, light: Optional[List[int]] = None) -> StepRecords:
    """At construction: build every shard's chunk table for the native kernels from the host-side
    layout and copy it to the device (non-blocking), so no step ever reads the device table.
    ``light[i]``: ``light_state()`` of shard ``i`` (its kind's chunk size, 0 for fp32 states).
    Returns the shards' :class:`StepRecords` (one prepare launch per step for all of them)."""
    records = StepRecords(segment_tables, device, n_params, n_groups)
    ext = _native(device)
    if ext is None:
        return records
    for i, (segments, numel) in enumerate(zip(segment_tables, numels)):
        size = chunk_size(ext, device, light[i] if light is not None else 0)
        key = f"native_chunks_{size}_{device}"
        if segments.segments and key not in segments.extra:
            store(segments, key, chunk_table(segments, numel, n_params, n_groups, size), device)
    return records


class StepRecords:
    """The CUDA step's per-segment scalars (bias corrections, lr / bc1, skip flag) of several
    shards (the optimizer's buckets) in ONE launch per step instead of one per shard:
    ``compute`` returns them for ``adam_step(records=..., record_offset=offsets[i])``, or None
    where the step forms its scalars itself (CPU, reference). The concatenated segment table is
    validated and copied to the device once, here, and the records are formed every step into
    one buffer made here (``records``): an allocation per step is microseconds of host time
    right after a backward on a GPU host. Reusing it is ordered as the state it steps is: on
    the step's stream, each step's records written after the last step's kernels read them."""

    def __init__(self, tables: List[SegmentTable], device: torch.device, n_params: int, n_groups: int) -> None:
        self.offsets: List[int] = []
        rows: List[List[int]] = []
        for t in tables:
            self.offsets.append(len(rows))
            for i, s in enumerate(t.segments):
                if not (0 <= s.param_index < n_params and 0 <= s.group < n_groups):
                    raise ValueError(f"segment {i}: param_index {s.param_index} / group {s.group} out of range "
                                     f"[0, {n_params}) / [0, {n_groups})")
                rows.append([s.start, s.length, s.param_index, s.group])
        ext = _native(device) if device.type == "cuda" and rows else None
        self.ext = ext if ext is not None and hasattr(ext, "adam_prepare") else None
        self.table: Optional[Tensor] = None
        self.records: Optional[Tensor] = None
        if self.ext is not None:
            host = torch.tensor(rows, dtype=torch.int64).pin_memory()
            self._pinned = host  # alive until the non-blocking copy is done (and for graph replays)
            self.table = host.to(device, non_blocking=True)
            self.records = torch.empty(len(rows) * self.ext.RECORD_FLOATS, dtype=torch.float32, device=device)

    def compute(self, hparams: Tensor, steps: Tensor, touched: Tensor, grad_coef: Tensor, found_inf: Tensor,
                bias_correction: bool) -> Optional[Tensor]:
        """This step's records formed into :attr:`records` (one launch), which is returned: the
        next call overwrites it, in stream order; None where there is nothing to prepare (CPU)."""
        if self.table is None:
            return None
        return self.ext.adam_prepare(self.table, hparams, steps, touched, grad_coef, found_inf, bias_correction,
                                     self.records)
