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
import operator
import warnings
from itertools import repeat
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import config
from . import reference
from ..layout import SegmentTable
from .launch_config import chunk_table, store

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
    ``record``, ``ranks``, ``record_host``, ``spare``: optim/step/health.py), the same launch
    decides the step's skip (found-inf or a norm spike), advances the steps by it, updates the
    health counters and record (and its host copy) and zeroes ``spare``."""
    ext = _native(coef_out.device)
    h = health or {}
    if scalars_native(ext, coef_out, base, norm, found_inf, steps, touched, h):
        ext.step_scalars(coef_out, base, float(scale), norm, float(max_norm), found_inf, steps, touched, **h)
    else:
        reference.step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, **h)


_dtype_of = operator.attrgetter("dtype")


def fp32_on(tensors: Sequence[Tensor], device: int, contiguous: bool = False) -> bool:
    """Every tensor is a float32 one (and ``contiguous``: a contiguous one) on the device of index
    ``device`` (-1: the CPU); C-level iteration (no Python frame per tensor: the step asks every
    step)."""
    return (all(map(operator.is_, map(_dtype_of, tensors), repeat(torch.float32)))
            and all(map(operator.eq, map(Tensor.get_device, tensors), repeat(device)))
            and (not contiguous or all(map(Tensor.is_contiguous, tensors))))


def scalars_native(ext: Optional[Any], coef_out: Tensor, base: Tensor, norm: Optional[Tensor], found_inf: Tensor,
                   steps: Tensor, touched: Tensor, h: Dict[str, Any]) -> bool:
    """Whether the compiled ``step_scalars`` takes these arguments (``h``: its health keywords);
    raises on a ``record_host`` it could never take."""
    tensors = [coef_out, base, found_inf, steps, touched] + ([] if norm is None else [norm]) + [
        h[k] for k in ("skip_out", "raw_norm", "inv_scale", "record", "ranks", "spare") if h.get(k) is not None]
    # once per step: the device as its index (-1 the CPU; .device makes a new object per tensor)
    device, f32 = coef_out.get_device(), torch.float32
    host = h.get("record_host")
    if host is not None and not (host.dtype is f32 and host.is_cpu and host.is_contiguous()):
        raise ValueError("step_scalars: record_host must be a contiguous float32 CPU tensor")
    return ext is not None and hasattr(ext, "step_scalars") and fp32_on(tensors, device, contiguous=True) and (
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
    chunks = group_chunk_map(ext, segments, grad.device, grad.numel(), n_params, out.numel())
    ext.group_partials(grad, segments.table, out, float(norm_type), chunks)


def group_partials_all(holders: Sequence[Any], order: Sequence[int], grads: Sequence[Tensor], out: Tensor,
                       norm_type: float, n_params: int) -> None:
    """:func:`group_partials` of ``grads[i]`` over ``holders[i].segments`` (a bucket or its step
    launch) for each ``i`` of ``order``, added into ``out`` in that order (the step's one native
    call adds them in the same order: fused_step.stats_step); over the grads held in place
    where ``grads`` (``shards.buffers.ShardGrads``) holds a bucket's, so no shard is made."""
    held_of = getattr(grads, "held", None)
    for i in order:
        segments = holders[i].segments
        held = held_of(i) if held_of is not None else None
        if held is None or not group_partials_held(held, segments, out, norm_type, n_params):
            group_partials(grads[i], segments, out, norm_type, n_params)


def group_chunk_map(ext: Any, segments: SegmentTable, device: torch.device, numel: int, n_params: int,
                  n_groups: int) -> Optional[Tensor]:
    """The blocks' map of the CUDA group partials over ``segments`` (built once from the
    host-side segments); None on the CPU."""
    if device.type != "cuda":
        return None
    key = f"group_chunks_{device}"
    if key not in segments.extra:
        store(segments, key, chunk_table(segments, numel, n_params, n_groups, ext.CUDA_CHUNK), device)
    return segments.extra[key]


def holds_grads(device: torch.device, segment_counts: Sequence[int]) -> List[bool]:
    """Per bucket of ``segment_counts`` segments, whether the compiled kernels for ``device`` read
    its grads where autograd left them (the zero-copy landing, ``shards.buffers.HeldGrads``): on
    the CPU every bucket; on CUDA a bucket of at most ``HELD_SEGMENTS`` segments (their addresses
    travel in the launches' arguments), where the kernels have the in-place reads; nowhere
    without the compiled kernels."""
    if device.type == "cpu":
        ext = _native(device)
        return [ext is not None and hasattr(ext, "bucket_stats_parts")] * len(segment_counts)
    bound = held_bucket_params(device)  # None: no in-place reads (no kernels, or no HELD_SEGMENTS)
    return [bound is not None and n <= bound for n in segment_counts]


def held_bucket_params(device: torch.device) -> Optional[int]:
    """The most grads a bucket may hold for the compiled kernels on ``device`` to read them where
    autograd left them (their addresses travel in the launches' arguments: ``HELD_SEGMENTS`` on
    CUDA); None where there is no such bound (the CPU) or nothing is read in place."""
    ext = _native(device)
    if device.type != "cuda" or ext is None or not hasattr(ext, "bucket_stats_parts"):
        return None
    return getattr(ext, "HELD_SEGMENTS", None)


def group_partials_held(held: Any, segments: SegmentTable, out: Tensor, norm_type: float, n_params: int) -> bool:
    """:func:`group_partials` over a bucket's grads held where autograd left them
    (``shards.buffers.HeldGrads``: one process; only the compiled stager holds them), the same
    sums as over its landed shard. Returns False, doing nothing, where the compiled kernels are
    no longer in use (``SHARDAMP_KERNELS=reference`` set since): the caller reads the shard."""
    device = held.marker.device
    ext = _native(device)
    if ext is None:
        return False
    if segments.segments:  # CUDA reads each segment through its chunk map and host-side span
        cuda = device.type == "cuda"
        ext.group_partials_held(held.parts, held.numel, segments.table, out, float(norm_type),
                                group_chunk_map(ext, segments, device, held.numel, n_params, out.numel()),
                                segments.spans if cuda else None)
    return True


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

def _host_rows(segments: SegmentTable) -> Tensor:
    """The segments as a host int64 ``[S, 4]`` tensor, built from the host-side rows once (cached):
    no device-to-host copy."""
    host = segments.extra.get("host")
    if host is None:
        rows = [[s.start, s.length, s.param_index, s.group] for s in segments.segments]
        host = segments.extra["host"] = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 4)
    return host

