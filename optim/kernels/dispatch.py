"""The one dispatcher between the reference math (``reference.py``) and the fused kernels in
csrc/ (C++ for CPU tensors, CUDA for GPU tensors), both implementing the contract written at the
top of ``reference.py``; the CUDA step's chunk sizes, tuning knobs and chunk tables are
``launch_config.py``'s.

``SHARDAMP_KERNELS=native`` forces the compiled kernels (a failed build raises),
``SHARDAMP_KERNELS=reference`` forces the reference; unset, native kernels are used where they
build, and a failed build warns once and falls back to the reference.

Blockwise moments (``quant.QuantizedShard``) take ``blockwise.py``'s launch (its own kernel).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import config
from . import blockwise, reference
from ..layout import SegmentTable
from ..state_formats import native_moment
from .quant import QuantizedShard
from .launch_config import chunk_size, chunk_table, knobs, light_state, shard_chunks, store

_ENV = "SHARDAMP_KERNELS"
# What the compiled kernels take for grads and model-dtype outputs; anything else (fp64) runs
# the reference. Checked here, before the call: an error raised inside an extension is not
# always survivable (csrc/NOTES.md).
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_native_cache: Dict[str, Any] = {}
_warned = set()


def requested_backend() -> str:
    """``"auto"``, ``"native"`` or ``"reference"``: the backend asked for (``SHARDAMP_KERNELS``)."""
    return config.settings().kernels


# device type -> (the load cache it came from, what _native returns under the settings in force)
_resolved: Dict[str, Tuple[Dict[str, Any], Any]] = {}


def _native(device: torch.device) -> Optional[Any]:
    """The compiled extension for ``device``'s type, or None to use the reference."""
    hit = _resolved.get(device.type)  # called several times per step: one lookup once resolved
    if hit is not None and hit[0] is _native_cache:  # (a replaced load cache resolves again)
        return hit[1]
    ext = _resolve(device)
    _resolved[device.type] = (_native_cache, ext)
    return ext


def _resolve(device: torch.device) -> Optional[Any]:
    mode = requested_backend()
    if mode == "reference":
        return None
    kind = device.type
    if kind not in _native_cache:
        try:
            from .build import load_extension

            _native_cache[kind] = load_extension(cuda=(kind == "cuda"), device=device if kind == "cuda" else None)
            _apply_settings(_native_cache[kind], config.settings())
        except Exception as exc:  # a toolchain problem, or prebuilt kernels that do not fit
            cause = failure_cause(kind, exc)
            if mode == "native":
                raise RuntimeError(
                    f"{cause} {_ENV}=native demands the compiled kernels, so this is an error: fix the cause above, "
                    f"or unset {_ENV} to run the pure-PyTorch reference kernels instead ({REFERENCE_COST.get(kind, 'slower')})."
                ) from exc
            _native_cache[kind] = None
            if kind not in _warned:
                _warned.add(kind)
                warnings.warn(
                    f"{cause} Running the pure-PyTorch reference kernels instead: the same results, "
                    f"{REFERENCE_COST.get(kind, 'slower')}. Set {_ENV}=reference to silence this; python -m shardamp.report "
                    "--build shows the details (SHARDAMP_BUILD_VERBOSE=1: the compiler's output).",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _native_cache[kind]


# What running the reference instead costs (the README's "Kernel builds" section has the timings).
REFERENCE_COST: Dict[str, str] = {
    "cpu": "over 20x slower per optimizer step",
    "cuda": "several times slower per optimizer step, with more launches and host time",
}


def failure_cause(kind: str, exc: BaseException) -> str:
    """The first sentence of a failed load's message: which kernels, and why (a build error's
    own cause, or the prebuilt kernels' mismatch), ending with a full stop."""
    from .build import BuildError, diagnose
    from .prebuilt import PrebuiltMismatch

    if isinstance(exc, PrebuiltMismatch):
        text = f"shardamp: the {kind} kernels could not be loaded: {exc}"
    elif isinstance(exc, BuildError):
        text = f"shardamp: the {kind} kernels could not be built: {exc.cause}"
    else:
        text = f"shardamp: the {kind} kernels could not be built: {diagnose(exc)}"
    return text.rstrip(". ") + "."


def _apply_settings(ext: Optional[Any], settings: config.Settings) -> None:
    """Push the settings a loaded extension keeps itself (the release thread's on/off)."""
    if ext is not None and hasattr(ext, "set_async_release"):
        ext.set_async_release(settings.async_grad_release)


def _settings_changed(settings: config.Settings) -> None:
    _resolved.clear()  # SHARDAMP_KERNELS may have changed
    for ext in _native_cache.values():
        _apply_settings(ext, settings)


config.on_change(_settings_changed)


def native_module(device: torch.device) -> Optional[Any]:
    """The built extension serving ``device`` (its ``GradStager`` among others), or None."""
    return _native(device)


def backend(device: torch.device) -> str:
    """'native' or 'reference': what runs for tensors on ``device``."""
    return "reference" if _native(device) is None else "native"


def grad_stats(grad: Tensor, out: Tensor, norm_type: float) -> None:
    """Accumulate ``sum|g|^p`` (or max) and the non-finite flag of ``grad`` into ``out``."""
    ext = _native(grad.device)
    if ext is None or grad.dtype not in _NATIVE_DTYPES:
        reference.grad_stats(grad, out, norm_type)
    else:
        ext.grad_stats(grad, out, float(norm_type))


def land_grads(full: Tensor, grads: List[Tensor], like: List[Tensor], offsets: List[int], accumulate: bool,
               zero_rest: bool = False) -> None:
    """Copy (``accumulate=False``) or add ``grads[i]`` into the view of the flat ``full`` with
    ``like[i]``'s shape and strides at element ``offsets[i]`` (contract: ``reference.py``).
    ``zero_rest`` (copies into a contiguous ``full`` only): the elements no copy writes are
    zeroed, in the same launch where the kernels are built (``full`` may be uninitialized)."""
    ext = _native(full.device)
    if ext is None or not hasattr(ext, "land_grads"):
        reference.land_grads(full, grads, like, offsets, accumulate, zero_rest)
    else:
        ext.land_grads(full, grads, like, offsets, accumulate, zero_rest)


def step_scalars(coef_out: Tensor, base: Tensor, scale: float, norm: Optional[Tensor], max_norm: float,
                 found_inf: Tensor, steps: Tensor, touched: Tensor, health: Optional[Dict[str, Any]] = None) -> None:
    """``coef_out = base * scale * clip_coef(max_norm, norm)`` (no clip without ``norm``) and
    ``steps += touched * (1 - found_inf)``, in one launch (contract: ``reference.py``). With
    ``health`` (``skip_out``, ``raw_norm``, ``inv_scale``, ``avg``, ``skip_above``, ``counters``,
    ``record``, ``ranks``, ``record_host``: optim/step/health.py), the same launch decides the
    step's skip (found-inf or a norm spike), advances the steps by it and updates the health
    counters and record (and its host copy)."""
    ext = _native(coef_out.device)
    h = health or {}
    if scalars_native(ext, coef_out, base, norm, found_inf, steps, touched, h):
        ext.step_scalars(coef_out, base, float(scale), norm, float(max_norm), found_inf, steps, touched, **h)
    else:
        reference.step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, **h)


def scalars_native(ext: Optional[Any], coef_out: Tensor, base: Tensor, norm: Optional[Tensor], found_inf: Tensor,
                   steps: Tensor, touched: Tensor, h: Dict[str, Any]) -> bool:
    """Whether the compiled ``step_scalars`` takes these arguments (``h``: its health keywords);
    raises on a ``record_host`` it could never take."""
    tensors = [coef_out, base, found_inf, steps, touched] + ([] if norm is None else [norm]) + [
        h[k] for k in ("skip_out", "raw_norm", "inv_scale", "record", "ranks") if h.get(k) is not None]
    # once per step: the device as its index (-1 the CPU; .device makes a new object per tensor)
    device, f32 = coef_out.get_device(), torch.float32
    host = h.get("record_host")
    if host is not None and not (host.dtype is f32 and host.is_cpu and host.is_contiguous()):
        raise ValueError("step_scalars: record_host must be a contiguous float32 CPU tensor")
    return ext is not None and hasattr(ext, "step_scalars") and all(
        t.dtype is f32 and t.get_device() == device and t.is_contiguous() for t in tensors) and (
        coef_out.numel() == base.numel() == found_inf.numel() == 1 and (norm is None or norm.numel() == 1)
        and touched.numel() == steps.numel()
        and (h.get("ranks") is None or (h["ranks"].numel() == 1 and h.get("record") is not None
                                        and h["record"].numel() == 4))
        and (h.get("record") is None or h["record"].numel() in (2, 4))
        and (host is None or (h.get("record") is not None and host.numel() == h["record"].numel()))) and (
        h.get("counters") is None or (h["counters"].dtype is torch.float64 and h["counters"].get_device() == device
                                      and h["counters"].is_contiguous()))


def nonfinite_flags(full: Tensor, rows: Tensor, flags: Tensor, host_rows: Optional[List[List[int]]] = None) -> None:
    """``flags[index] = 1`` (and ``flags[-1] = 1``) for each ``(start, length, index)`` row of
    ``rows`` (on ``full``'s device) whose elements of ``full`` hold an inf or NaN: one launch
    (contract: ``reference.py``, which reads ``host_rows``, the same rows on the host, if given)."""
    ext = _native(full.device)
    if (ext is None or not hasattr(ext, "nonfinite_flags") or full.dtype not in _NATIVE_DTYPES
            or not full.is_contiguous() or flags.dtype != torch.float32):
        reference.nonfinite_flags(full, rows if host_rows is None else host_rows, flags)
    else:
        ext.nonfinite_flags(full, rows, flags)


def bucket_stats(full: Tensor, rows: Tensor, flags: Tensor, out: Tensor, assign: bool,
                 host_rows: Optional[List[List[int]]] = None) -> None:
    """``nonfinite_flags(full, rows, flags)`` and ``full``'s L2 partial into ``out`` (float32
    ``[2]``: assigned if ``assign``, else accumulated as ``grad_stats`` does), in one read pass
    and one launch where the kernels are built (contract: ``reference.py``)."""
    ext = _native(full.device)
    if (ext is None or not hasattr(ext, "bucket_stats") or full.dtype not in _NATIVE_DTYPES
            or not full.is_contiguous() or flags.dtype != torch.float32):
        reference.bucket_stats(full, rows if host_rows is None else host_rows, flags, out, assign)
    else:
        ext.bucket_stats(full, rows, flags, out, assign)


def group_partials(grad: Tensor, segments: SegmentTable, out: Tensor, norm_type: float, n_params: int) -> None:
    """Accumulate each param group's partial (``sum |g|^p``, ``max`` for inf) of the shard
    ``grad`` into ``out[group]``, over ``segments`` (contract: ``reference.py``)."""
    if not segments.segments:
        return
    ext = _native(grad.device)
    if ext is None or not hasattr(ext, "group_partials") or grad.dtype not in _NATIVE_DTYPES:
        reference.group_partials(grad, _host_rows(segments), out, norm_type)
        return
    chunks = None
    if grad.device.type == "cuda":  # the blocks' map, built once from the host-side segments
        key = f"group_chunks_{grad.device}"
        if key not in segments.extra:
            store(segments, key, chunk_table(segments, grad.numel(), n_params, out.numel(), ext.CUDA_CHUNK),
                   grad.device)
        chunks = segments.extra[key]
    ext.group_partials(grad, segments.table, out, float(norm_type), chunks)


def group_partials_held(held: Any, segments: SegmentTable, out: Tensor, norm_type: float) -> None:
    """:func:`group_partials` over a bucket's grads held where autograd left them
    (``shards.buffers.HeldGrads``: one process, CPU; only the compiled stager holds them, so the
    compiled kernels are there), the same sums as over its landed shard."""
    if segments.segments:
        _native(held.marker.device).group_partials_parts(held.grads, held.offsets, held.numel, segments.table, out,
                                                         float(norm_type))


def stats_finish(stats: Tensor, end: int, norm_type: float,
                 views: Sequence[Tuple[int, int]] = ()) -> List[Tensor]:
    """``[norm, found_inf, *views]`` from the reduced stats, their touched counts ``stats[2:end]``
    clamped to 0/1 in place (contract: ``reference.py``), and ``stats[start:start + length]``
    for each ``(start, length)`` of ``views``: one native call and one launch where the kernels
    are built (norm types 2 and inf; each view made there costs the host no Python call), the
    reference's four torch ops otherwise."""
    ext = _native(stats.device)
    if (ext is None or not hasattr(ext, "stats_finish") or stats.dtype != torch.float32
            or not stats.is_contiguous() or not (norm_type == 2.0 or math.isinf(norm_type))):
        raw, found_inf = reference.stats_finish(stats, end, norm_type)
        return [raw, found_inf, *(stats[start:start + length] for start, length in views)]
    return ext.stats_finish(stats, int(end), float(norm_type), views)


def view_check(refs: List[Tensor]) -> Optional[Any]:
    """A native check holding ``refs``: ``.intact(params)`` (a list) is True iff every
    ``params[i]`` still has ``refs[i]``'s data pointer, dtype, shape and strides and no ``.grad``;
    None where there is none (the caller then checks in Python)."""
    ext = _native(refs[0].device) if refs else None
    if ext is None or not hasattr(ext, "ViewCheck"):
        return None
    return ext.ViewCheck(refs)


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
    native = None if ext is None else _prepared(ext, launch, launch.grad, launch.hparams)
    if native is None:
        reference.adam_step(launch.grad, launch.master, launch.exp_avg, launch.exp_avg_sq, launch.model_out,
                            _host_rows(segments), launch.hparams, launch.steps, launch.touched, launch.grad_coef,
                            launch.found_inf, launch.adam_w_mode, launch.bias_correction)
        return
    native.grad, native.touched, native.found_inf, native.grad_coef, native.hparams = (
        launch.grad, launch.touched, launch.found_inf, launch.grad_coef, launch.hparams)
    native.records = launch.records if launch.grad.device.type == "cuda" else None
    try:
        ext.adam_launch(native)
    finally:  # the grad shard is released between steps: holding it here would keep its memory alive
        native.grad = _NO_GRAD


def _host_rows(segments: SegmentTable) -> Tensor:
    """The segments as a host int64 ``[S, 4]`` tensor, built from the host-side rows once (cached):
    no device-to-host copy."""
    host = segments.extra.get("host")
    if host is None:
        rows = [[s.start, s.length, s.param_index, s.group] for s in segments.segments]
        host = segments.extra["host"] = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 4)
    return host


_UNTUNED = object()  # _prepared's tuned, not read by the caller


def _prepared(ext: Any, launch: AdamLaunch, grad: Tensor, hparams: Tensor, tuned: Any = _UNTUNED) -> Optional[Any]:
    """The extension's launch object of ``launch`` for a step over ``grad`` (made at its first
    native launch), its chunk map and launch shape set for the tuning knobs in force (``tuned``:
    ``knobs()`` on CUDA, None on the CPU; read here if not given) and the grads' dtype (again
    only when either changes); None where the compiled kernels do not take the shard's state
    (``native_state``)."""
    if tuned is _UNTUNED:
        tuned = knobs() if grad.device.type == "cuda" else None  # one cached tuple until the settings change
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
        ext.adam_launch_all(natives, shards, hparams, touched, found_inf, None, prepare.table)
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
    (``shards.buffers.ShardGrads.for_step``: one process, CPU) its launch is handed them
    (``set_parts``, the launch then drops them) and an empty tensor stands in for its shard, so
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
        native.set_parts(held.grads, held.offsets)
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
    validated and copied to the device once, here."""

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
        if self.ext is not None:
            host = torch.tensor(rows, dtype=torch.int64).pin_memory()
            self._pinned = host  # alive until the non-blocking copy is done (and for graph replays)
            self.table = host.to(device, non_blocking=True)

    def compute(self, hparams: Tensor, steps: Tensor, touched: Tensor, grad_coef: Tensor, found_inf: Tensor,
                bias_correction: bool) -> Optional[Tensor]:
        if self.table is None:
            return None
        return self.ext.adam_prepare(self.table, hparams, steps, touched, grad_coef, found_inf, bias_correction)
