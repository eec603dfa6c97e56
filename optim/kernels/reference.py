"""The math, as plain functions over flat tensors: the specification the fused kernels in csrc/
are tested against, and the fallback where no compiler is available.

Written for clarity, not speed. Nothing here reads a device value on the host: skipping an
update (found-inf, or a param no rank touched) is a ``torch.where`` on device tensors, so these
functions are as free of host syncs as the kernels.

Shared contract (``kernels.py`` dispatches to either implementation):

``grad_stats(grad, out, norm_type)``
    ``grad``: flat shard, fp32 / bf16 / fp16. ``out``: fp32 ``[2]`` on the same device,
    ACCUMULATED into: ``out[0] += sum(|g|**p)`` for finite ``p`` (``out[0] = max(out[0],
    max|g|)`` for ``p = inf``), computed in fp32 from the raw values; ``out[1] = max(out[1],
    1.0 if any element of grad is inf or NaN else 0.0)``. An empty ``grad`` leaves ``out``
    unchanged.

``adam_step(grad, master, exp_avg, exp_avg_sq, model_out, segments, hparams, steps, touched,
grad_coef, found_inf, adam_w_mode, bias_correction)``
    Over every segment ``(start, length, param_index, group)`` of ``segments`` (int64 ``[S, 4]``;
    elements outside all segments are padding and are not touched), with
    ``lr, beta1, beta2, eps, wd = hparams[group]`` (fp64 ``[G, 5]``), ``step = steps[param_index]``
    (fp32, already counting this step) and ``g = grad * grad_coef`` (fp32):

    * if ``found_inf != 0`` or ``touched[param_index] == 0``: nothing is written;
    * ``p`` = the fp32 master: ``master`` itself, or, when ``master`` is int16 (param
      remainders), ``join_remainders(model_out, master)``: ``model_out`` (bf16) holds the high
      16 bits and ``master`` the low 16 bits of the fp32 master;
    * Adam (``adam_w_mode=False``): ``g += wd * p``; AdamW: ``p *= 1 - lr * wd``;
    * ``m = lerp(m, g, w)``, ``w = 1 - beta1``, in torch.lerp's two formulas with every operation
      rounded: ``m + w * (g - m)`` for ``w < 0.5``, else ``g - (g - m) * (1 - w)`` (torch's own
      CPU lerp fuses them into an FMA in its vector body and not in its tail, so its bits depend
      on an element's position; spelled out, the kernels give these bits exactly);
      ``v = v * beta2 + (1 - beta2) * g * g``;
    * with ``bias_correction``: ``bc1 = 1 - beta1**step``, ``bc2 = 1 - beta2**step``, else 1;
    * ``p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)``, ``sqrt(v)`` correctly rounded (torch's
      CPU ``sqrt`` of fp32 can be 1 ulp off; through fp64 it is rounded once, exactly);
    * ``exp_avg`` / ``exp_avg_sq`` (fp32 or bf16 each, read as fp32) are written back rounded
      to their dtype, to nearest even (``Tensor.to``); the math of a step is fp32 throughout;
    * with an fp32 ``master``: ``master = p`` and, when ``model_out`` is given,
      ``model_out[i] = p`` rounded to its dtype (round to nearest even);
    * with int16 remainders: ``model_out, master = split_remainders(p)`` (exact: the next step
      reconstructs ``p`` bit for bit). ``model_out`` is then ``p`` rounded to nearest with ties
      away from zero, which differs from round-to-nearest-even only where the low 16 bits of
      ``p`` are exactly 0x8000: that is what makes 16 bits enough to restore every fp32 value.

    Scalars (bias corrections, ``lr / bc1``, ``1 - lr * wd``) are formed in fp64 as torch.optim
    forms them from Python floats; the element-wise math is fp32.

    A blockwise moment (``"8bit"`` / ``"4bit"``: a ``quant.QuantizedShard`` of codes and block
    scales in place of the tensor) is read dequantized (``map[code] * scale``), updated by the
    same fp32 math, and stored again block by block against each block's new absmax (the
    nearest code, ties to the lower one: ``quant.quantize``), codes and scales in place. Every
    element of a block is re-encoded, those of untouched params and padding too (from their
    dequantized values: one more rounding, the same at every world size, since a block's codes
    depend on its elements alone and the layout puts shard boundaries on the block grid). With
    ``found_inf != 0`` codes and scales are left as they are. The fp32 values exist only for the
    call's duration: no fp32 copy of a quantized moment is kept between steps.

``land_grads(full, grads, like, offsets, accumulate)``
    For every i: ``v = full.as_strided(like[i].shape, like[i].stride(), full.storage_offset() +
    offsets[i])``; ``v.copy_(grads[i])``, or ``v.add_(grads[i])`` with ``accumulate`` (the grads
    are converted to ``full``'s dtype). Nothing else in ``full`` is written.
``step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, skip_out=None,
raw_norm=None, inv_scale=None, avg=1.0, skip_above=inf, counters=None, record=None, ranks=None,
record_host=None, spare=None)``
    All fp32 on one device (``counters`` fp64). ``coef_out[0] = base * scale`` times, with ``norm`` given,
    ``clip_grad_norm_``'s coefficient ``min(1, max_norm / (norm + 1e-6))`` formed as torch forms
    it (``(norm + 1e-6).reciprocal() * max_norm``), NaN and infinities read as 1; then
    ``steps += touched * (1 - found_inf)``. One launch for the ~9 scalar ops this replaces.
    With ``skip_out`` (the step's health, optim/step/health.py): ``unscaled = raw_norm * avg``
    (times ``inv_scale`` if given: the norm ``grad_norm()`` hands out), ``spike = unscaled >
    skip_above`` compared exactly (as float64; never for NaN), ``skip = found_inf != 0 or spike``;
    ``skip_out[0] = skip`` (0.0 / 1.0) and ``steps += touched * (1 - skip)`` instead; with
    ``counters`` (fp64 ``[applied, skipped non-finite, skipped spike, consecutive skips]``)
    ``counters += [not skip, found, spike and not found, -]``, ``counters[3] = skip ?
    counters[3] + 1 : 0``; with ``record`` (fp32 [2]) ``record = [reason, unscaled]``, the
    reason 0 (applied), 1 (found-inf) or 2 (spike); a record of 4 elements also holds ``ranks``
    (fp32 [1], 0 if not given) and ``inv_scale`` (1 if not given): the whole report the host reads
    back after the step. ``record_host`` (a CPU fp32 tensor of the record's size): the record is
    written there too, ordered after the launch on its stream (page-locked memory: the native
    kernel writes it through its mapped address, no copy of its own; other memory is copied).
    ``spare`` (fp32, any size; with ``skip_out`` only): set to zero in the same launch, nothing
    reading it (the step health's spare round flags, started over for the next round here).
``nonfinite_flags(full, rows, flags)``
    ``full``: a flat grad buffer (fp32 / bf16 / fp16); ``rows``: int64 ``[k, 3]`` of ``(start,
    length, index)`` on ``full``'s device, sorted by start, not overlapping; ``flags``: fp32 on
    the same device. For every row whose elements ``full[start:start + length]`` hold an inf or
    NaN: ``flags[index] = 1.0`` and ``flags[-1] = 1.0``. Nothing else is written (elements in no
    row, padding, are not looked at).
``group_partials(grad, segments, out, norm_type)``
    ``grad``: a flat shard; ``segments``: its ``(start, length, param_index, group)`` rows
    (int64 ``[S, 4]``); ``out``: fp32 ``[G]``, ACCUMULATED into: ``out[group] += sum |g|**p``
    over the group's segments (``max`` for ``p = inf``), in fp32 from the raw values, as
    ``grad_stats`` forms a partial (summation order free: compared with a tolerance).
``stats_finish(stats, end, norm_type)``
    ``stats``: the reduced fp32 stats ``[partial, nonfinite, touched counts up to end, ...]``.
    Returns 0-d ``(norm, found_inf)``: the norm is the partial's root (``sqrt`` for 2, the
    partial itself for inf; the native kernel takes only these two), correctly rounded in the
    kernels (this reference's torch ``sqrt`` is too on CUDA; on the CPU it can be 1 ulp off,
    e.g. for 3e38); ``found_inf`` is
    exactly 1.0 where the flag is non-zero or the partial is inf/NaN, else 0.0. In place:
    ``stats[2:end]`` clamped to at most 1 (NaN stays NaN); nothing else is written.
``join_remainders(hi, lo)`` / ``split_remainders(p)``
    The fp32 master as a bf16 high half ``hi`` and an int16 low half ``lo``: the master's bit
    pattern is ``(bits(hi) << 16) + lo`` modulo 2**32 (``lo`` signed), so ``hi`` is the fp32
    bit pattern rounded half-up at bit 16, i.e. the value rounded to nearest, ties away from
    zero, and ``lo`` is what that rounding removed. A bijection: every fp32 bit pattern, inf
    and NaN included, splits and joins back exactly.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from .. import _compat
from ..norms import PARTIAL, clip_coef, root  # torch's coefficient, never NaN: the kernels' spec too
from .quant import QuantizedShard


def grad_stats(grad: Tensor, out: Tensor, norm_type: float) -> None:
    if grad.numel() == 0:
        return
    g = grad.float()
    nonfinite = (~torch.isfinite(g)).any().float()
    if math.isinf(norm_type):
        out[0] = torch.maximum(out[0], g.abs().max())
    elif norm_type == 2.0:
        out[0] += torch.dot(g, g)
    elif norm_type == 1.0:
        out[0] += g.abs().sum()
    else:
        out[0] += g.abs().pow(norm_type).sum()
    out[1] = torch.maximum(out[1], nonfinite)


def adam_step(
    grad: Tensor,
    master: Tensor,
    exp_avg: Union[Tensor, QuantizedShard],
    exp_avg_sq: Union[Tensor, QuantizedShard],
    model_out: Optional[Tensor],
    segments: Tensor,
    hparams: Tensor,
    steps: Tensor,
    touched: Tensor,
    grad_coef: Tensor,
    found_inf: Tensor,
    adam_w_mode: bool,
    bias_correction: bool,
) -> None:
    # a quantized moment: dequantized for this call only, stored again after the update
    m = exp_avg.dequantize() if isinstance(exp_avg, QuantizedShard) else exp_avg
    v = exp_avg_sq.dequantize() if isinstance(exp_avg_sq, QuantizedShard) else exp_avg_sq
    _adam_segments(grad, master, m, v, model_out, segments, hparams, steps, touched, grad_coef, found_inf,
                   adam_w_mode, bias_correction)
    keep = found_inf.reshape(()) != 0  # the device skip flag: no host read
    for stored, values in ((exp_avg, m), (exp_avg_sq, v)):
        if isinstance(stored, QuantizedShard):
            stored.store(values, keep)


def _adam_segments(grad: Tensor, master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, model_out: Optional[Tensor],
                   segments: Tensor, hparams: Tensor, steps: Tensor, touched: Tensor, grad_coef: Tensor,
                   found_inf: Tensor, adam_w_mode: bool, bias_correction: bool) -> None:
    """``adam_step`` over float moments (fp32 / bf16 / fp64 tensors), segment by segment."""
    coef = grad_coef.float()
    skip_all = found_inf != 0
    remainders = master.dtype == torch.int16
    if remainders and (model_out is None or model_out.dtype != torch.bfloat16):
        raise ValueError("adam_step: int16 master remainders need model_out in bfloat16 (the high halves)")
    for start, length, param_index, group in segments.tolist():
        sl = slice(start, start + length)
        lr, beta1, beta2, eps, wd = hparams[group].unbind()
        step = steps[param_index].double()
        skip = skip_all | (touched[param_index] == 0)

        g = grad[sl].float() * coef
        p = join_remainders(model_out[sl], master[sl]) if remainders else master[sl].float()
        m = exp_avg[sl].float()
        v = exp_avg_sq[sl].float()
        if adam_w_mode:
            p = p * (1 - lr * wd).float()
        else:
            g = g + wd.float() * p
        w = (1 - beta1).float()
        d = g - m
        m = torch.where(w < 0.5, m + w * d, g - d * (1 - w))  # torch.lerp's formulas, unfused
        v = v * beta2.float() + (1 - beta2).float() * g * g
        if bias_correction:
            bc1 = 1 - beta1**step
            bc2_sqrt = (1 - beta2**step).sqrt()
        else:
            bc1 = bc2_sqrt = torch.ones((), dtype=torch.float64, device=hparams.device)
        step_size = (lr / bc1).float()
        denom = v.double().sqrt().float() / bc2_sqrt.float() + eps.float()  # sqrt(v) rounded once
        p = p - step_size * (m / denom)

        exp_avg[sl] = torch.where(skip, exp_avg[sl], m.to(exp_avg.dtype))
        exp_avg_sq[sl] = torch.where(skip, exp_avg_sq[sl], v.to(exp_avg_sq.dtype))
        if remainders:
            hi, lo = split_remainders(p)
            model_out[sl] = torch.where(skip, model_out[sl], hi)
            master[sl] = torch.where(skip, master[sl], lo)
            continue
        master[sl] = torch.where(skip, master[sl], p.to(master.dtype))
        if model_out is not None:
            model_out[sl] = torch.where(skip, model_out[sl], p.to(model_out.dtype))


def step_scalars(coef_out: Tensor, base: Tensor, scale: float, norm: Optional[Tensor], max_norm: float,
                 found_inf: Tensor, steps: Tensor, touched: Tensor, skip_out: Optional[Tensor] = None,
                 raw_norm: Optional[Tensor] = None, inv_scale: Optional[Tensor] = None, avg: float = 1.0,
                 skip_above: float = math.inf, counters: Optional[Tensor] = None,
                 record: Optional[Tensor] = None, ranks: Optional[Tensor] = None,
                 record_host: Optional[Tensor] = None, spare: Optional[Tensor] = None) -> None:
    if ranks is not None and (record is None or record.numel() != 4):
        raise ValueError("step_scalars: ranks needs a record of 4 elements")
    if record_host is not None and (record is None or record_host.numel() != record.numel()):
        raise ValueError("step_scalars: record_host needs a record of its size")
    coef = base * scale
    if norm is not None:
        coef = coef * clip_coef(max_norm, norm)
    coef_out.copy_(coef.reshape(coef_out.shape))
    if skip_out is None:
        if spare is not None:
            raise ValueError("step_scalars: spare needs skip_out")
        steps.addcmul_(touched, 1.0 - found_inf)
        return
    if spare is not None:
        spare.zero_()
    unscaled = raw_norm.reshape(()) * avg
    if inv_scale is not None:
        unscaled = unscaled * inv_scale.reshape(())
    spike = unscaled.double() > skip_above  # False for NaN
    found = found_inf.reshape(()) != 0
    skip = (found | spike).float()
    skip_out.copy_(skip.reshape(skip_out.shape))
    steps.addcmul_(touched, 1.0 - skip)
    if counters is not None:
        spike_only = spike & ~found
        counters[:3] += torch.stack([1.0 - skip.double(), found.double(), spike_only.double()])
        counters[3] = (counters[3] + 1.0) * skip.double()
    if record is not None:
        reason = torch.where(found, 1.0, torch.where(spike, 2.0, 0.0)).float()
        parts = [reason, unscaled.float()]
        if record.numel() == 4:
            f32 = dict(dtype=torch.float32, device=record.device)
            parts += [torch.zeros((), **f32) if ranks is None else ranks.reshape(()).float(),
                      torch.ones((), **f32) if inv_scale is None else inv_scale.reshape(()).float()]
        record.copy_(torch.stack(parts))
        if record_host is not None:  # where the host reads it: a non-blocking copy into page-locked memory
            record_host.copy_(record, non_blocking=True)


def nonfinite_flags(full: Tensor, rows: Tensor, flags: Tensor) -> None:
    # rows: host-side (a CPU tensor or list), so no device value is read; one check per row
    hits = []
    for start, length, index in (rows.tolist() if isinstance(rows, Tensor) else rows):
        if length:
            hit = (~torch.isfinite(full[start:start + length])).any().to(flags.dtype).reshape(1)
            flags[index:index + 1].copy_(torch.maximum(flags[index:index + 1], hit))
            hits.append(hit)
    if hits:
        flags[-1:].copy_(torch.maximum(flags[-1:], torch.cat(hits).amax().reshape(1)))


def bucket_stats(full: Tensor, rows: Tensor, flags: Tensor, out: Tensor, assign: bool) -> None:
    if assign:
        out.zero_()
    nonfinite_flags(full, rows, flags)
    grad_stats(full, out, 2.0)


def group_partials(grad: Tensor, segments: Tensor, out: Tensor, norm_type: float) -> None:
    for start, length, _param, group in segments.tolist():  # host-side rows: no device read
        partial = torch.zeros(PARTIAL, dtype=torch.float32, device=grad.device)
        grad_stats(grad[start:start + length], partial, norm_type)
        if math.isinf(norm_type):
            out[group] = torch.maximum(out[group], partial[0])
        else:
            out[group] += partial[0]


def stats_finish(stats: Tensor, end: int, norm_type: float) -> Tuple[Tensor, Tensor]:
    """From the reduced stats ``[partial, nonfinite, touched counts (to end), ...]``: the norm
    ``root(partial)`` and found-inf (exactly 0.0 or 1.0: the flag is set, or the partial is
    inf/NaN), both 0-d; the touched counts are clamped to <= 1 in place (0/1 flags)."""
    partial = stats[0]
    raw = root(partial, norm_type)
    # flag + 0 * partial is NaN when the partial is inf/NaN, so "!= 0" covers both causes
    found_inf = torch.add(stats[1], partial, alpha=0.0).ne_(0.0)
    stats[PARTIAL:end].clamp_(max=1.0)
    return raw, found_inf


def land_grads(full: Tensor, grads: List[Tensor], like: List[Tensor], offsets: List[int], accumulate: bool,
               zero_rest: bool = False) -> None:
    if zero_rest:
        if accumulate or not full.is_contiguous():
            raise RuntimeError("land_grads: zero_rest is for copies (accumulate=False) into a contiguous buffer")
        full.zero_()
    base = full.storage_offset()
    views = [full.as_strided(t.shape, t.stride(), base + off) for t, off in zip(like, offsets)]
    if accumulate:
        _compat.foreach_add_(views, grads)
    else:
        _compat.foreach_copy_(views, grads)


def _wrap(x: Tensor, bits: int) -> Tensor:
    """int64 values in [0, 2**bits) as the signed ``bits``-wide integers with the same bits."""
    return x - ((x >> (bits - 1)) << bits)


def join_remainders(hi: Tensor, lo: Tensor) -> Tensor:
    """The fp32 masters whose high halves are ``hi`` (bf16) and low halves ``lo`` (int16)."""
    bits = ((hi.view(torch.int16).to(torch.int64) & 0xFFFF) << 16) + lo.to(torch.int64)
    return _wrap(bits & 0xFFFFFFFF, 32).to(torch.int32).view(torch.float32)


def split_remainders(p: Tensor) -> Tuple[Tensor, Tensor]:
    """``(hi, lo)``: ``p`` (fp32) rounded to bf16 to nearest with ties away from zero, and the
    int16 remainder that ``join_remainders`` adds back to restore ``p`` exactly."""
    bits = p.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = ((bits + 0x8000) >> 16) & 0xFFFF
    return _wrap(hi, 16).to(torch.int16).view(torch.bfloat16), _wrap(bits & 0xFFFF, 16).to(torch.int16)
