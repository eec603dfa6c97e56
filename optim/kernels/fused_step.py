"""The step's native calls merged where nothing has to happen between them.

On a GPU host each Python-to-C++ call costs tens of microseconds before its kernel is even
launched, and a small model's iteration is bound by that host time. Where the optimizer has one
shard rank, two pairs of the step's calls have nothing between them and are made as one:

- ``stats_cat_finish``: the stats tensor's assembly (``torch.cat``) and its finish
  (``stats_finish``), when nothing reduces the stats in between (one process);
- ``step_launch``: the step's scalar launch (``step_scalars``) and every bucket's step kernel
  (``launch_adam_all``), when no all-gather runs between the buckets' kernels;
- ``stats_step``: both of the above in one, where nothing asked for the stats before the step
  (no clip, no unscale: the stats' finish is then the step's first launch), with the param
  groups' norm partials of every bucket (several groups) formed in the same call. A clipped
  step's stats are finished by the clip, whose norm is handed out before the step: its step is
  ``step_launch``.

The native calls are csrc/fused_step.cpp's.

:func:`launch_step` is the step's launches for every case: merged at one shard rank, bucket by
bucket with each bucket's all-gather after its kernel otherwise. Each falls back to the separate
calls (``dispatch.py``) wherever those would not take the
compiled kernels, so the results are the same bit for bit: the same kernels run in the same
order on the same stream.
"""
from __future__ import annotations

import math
import operator
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .adam_launch import AdamLaunch, StepRecords, launch_adam_all, native_launches
from .dispatch import _native, fp32_on, group_chunk_map, group_partials_all, scalars_native, stats_finish, step_scalars


def stats_cat_finish(parts: Sequence[Tensor], end: int, norm_type: float,
                     views: Sequence[Tuple[int, int]] = ()) -> List[Tensor]:
    """``[stats, norm, found_inf, *views]``: ``stats = torch.cat(parts)`` finished as
    :func:`stats_finish` finishes it. Only where nothing reduces ``stats`` between the two (one
    process). No host sync."""
    device = parts[0].device
    ext = _native(device)
    if (ext is not None and hasattr(ext, "stats_cat_finish") and (norm_type == 2.0 or math.isinf(norm_type))
            and all(p.dtype == torch.float32 for p in parts)):
        return ext.stats_cat_finish(list(parts), int(end), float(norm_type), list(views))
    stats = torch.cat(list(parts))
    return [stats, *stats_finish(stats, end, norm_type, views)]


def step_launch(coef_out: Tensor, coef_parts: Tuple[Tensor, float, Optional[Tensor], float], found_inf: Tensor,
                steps: Tensor, touched: Tensor, health: Dict[str, Any], launches: Sequence[AdamLaunch],
                order: Sequence[int], grads: Sequence[Tensor], hparams: Tensor, prepare: StepRecords) -> None:
    """``step_scalars(coef_out, *coef_parts, found_inf, steps, touched, health)`` and then
    ``launch_adam_all(launches, order, grads, hparams, touched, health["skip_out"],
    prepare=prepare)``: in one native call where both take the compiled kernels. Only where no
    all-gather runs between the buckets' kernels (one shard rank). No host sync."""
    base, scale, norm, max_norm = coef_parts
    ext = _native(coef_out.device)
    skip = health["skip_out"]
    if (ext is not None and hasattr(ext, "step_launch") and skip is not None and order
            and health.get("counters") is not None and health.get("record") is not None
            and scalars_native(ext, coef_out, base, norm, found_inf, steps, touched, health)):
        natives, shards = native_launches(ext, launches, order, grads, hparams)
        if natives is not None:
            h = health
            table, records = (prepare.table, prepare.records) if coef_out.is_cuda else (None, None)
            ext.step_launch(coef_out, base, float(scale), norm, float(max_norm), found_inf, steps, touched, skip,
                            h["raw_norm"], h.get("inv_scale"), float(h.get("avg", 1.0)),
                            float(h.get("skip_above", math.inf)), h["counters"], h["record"], h.get("ranks"),
                            h.get("record_host"), h.get("spare"), natives, shards, hparams, table, records)
            return
    step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, health)
    launch_adam_all(launches, order, grads, hparams, touched, skip, prepare=prepare)


def launch_step(coef_out: Tensor, coef_parts: Tuple[Tensor, float, Optional[Tensor], float], found_inf: Tensor,
                steps: Tensor, touched: Tensor, health: Dict[str, Any], launches: Sequence[AdamLaunch],
                order: Sequence[int], grads: Sequence[Tensor], hparams: Tensor, prepare: StepRecords,
                bias_correction: bool, after_bucket: Optional[Callable[[int], None]] = None) -> None:
    """The step's launches: the scalar launch, the step records and each bucket's step kernel in
    ``order``. ``after_bucket(i)`` (the all-gather of bucket ``i``'s params, param_sync.py) runs
    after each bucket's kernel; without it (one shard rank) everything is one call where the
    compiled kernels take it (:func:`step_launch`). No host sync."""
    if after_bucket is None:
        step_launch(coef_out, coef_parts, found_inf, steps, touched, health, launches, order, grads, hparams, prepare)
        return
    base, scale, norm, max_norm = coef_parts
    step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, health)
    skip = health["skip_out"]  # what the step kernels skip on, written by the scalar launch
    records = prepare.compute(hparams, steps, touched, coef_out, skip, bias_correction)
    for i in order:  # the next bucket's step kernel
        launch_adam_all(launches, (i,), grads, hparams, touched, skip, records)
        after_bucket(i)


class _Accepted:
    """Argument sets a check accepted, held weakly and matched by identity: the plain step hands
    :func:`stats_step` the same persistent tensors every step (the grad coefficient, the step
    counts, the health's skip flag, counters and record, one of the two record slots of
    checks/deferred.py, one of its two round flags as the spare), so ``scalars_native`` checks
    them once per set, not at every step (its checks cost microseconds of host time a step; the
    native call checks its arguments again anyway).
    A tensor freed and another made at its address never matches: its weak reference is dead.
    An absent optional argument is passed as :data:`NONE`."""

    NONE = type("_NoTensor", (), {})()  # weakly referenceable, alive as long as the class

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._sets: List[Tuple[Any, ...]] = []

    def seen(self, args: Tuple[Any, ...]) -> bool:
        for refs in self._sets:  # C-level iteration over the arguments (map): no Python frame per argument
            if len(refs) == len(args) and all(map(operator.is_, map(_deref, refs), args)):
                return True
        return False

    def add(self, args: Tuple[Any, ...]) -> None:
        self._sets.insert(0, tuple(map(weakref.ref, args)))
        del self._sets[self._size:]


_deref = weakref.ref.__call__
_STATS_STEP_SCALARS = _Accepted()


def _scalars_take(ext: Any, coef_out: Tensor, base: Tensor, skip: Tensor, steps: Tensor, h: Dict[str, Any]) -> bool:
    """Whether the compiled ``step_scalars`` takes :func:`stats_step`'s health tensors (``h``),
    asked once per set of tensors (:class:`_Accepted`). The skip flag stands in for the stats'
    views, which the call makes (fp32 on its parts' device)."""
    inv, host, spare, none = h.get("inv_scale"), h.get("record_host"), h.get("spare"), _Accepted.NONE
    args = (ext, coef_out, base, skip, steps, none if inv is None else inv, h["counters"], h["record"],
            none if host is None else host, none if spare is None else spare)
    if _STATS_STEP_SCALARS.seen(args):
        return True
    if not scalars_native(ext, coef_out, base, None, skip, steps, steps, dict(h, raw_norm=skip, ranks=None)):
        return False
    _STATS_STEP_SCALARS.add(args)
    return True


def stats_step(parts: Sequence[Tensor], end: int, norm_type: float, views: Sequence[Tuple[int, int]],
               view_of: Dict[str, int], coef_out: Tensor, coef_parts: Tuple[Tensor, float, Optional[Tensor], float],
               steps: Tensor, health: Dict[str, Any], launches: Sequence[AdamLaunch], order: Sequence[int],
               grads: Sequence[Tensor], hparams: Tensor, prepare: StepRecords, bias_correction: bool,
               n_params: int = 0) -> List[Tensor]:
    """A one-shard-rank step whose stats nothing asked for before it: :func:`stats_cat_finish`,
    the param groups' partials (:func:`group_partials_all`) and then :func:`launch_step` over its
    results, in ONE native call where the compiled kernels take them all. ``view_of``: which of
    ``views`` are the step's touched flags (``"touched"``), the health's count of ranks with
    inf/NaN grads (``"ranks"``) and, with several groups, the group partials (``"groups"``,
    over the optimizer's ``n_params`` params); ``health``: ``step_scalars``' keywords without
    ``raw_norm`` and ``ranks`` (the stats' norm and that view). No clip (``coef_parts``' norm is
    None). Returns ``[stats, norm, found_inf, *views]`` as :func:`stats_cat_finish`. No host
    sync."""
    base, scale, norm, _ = coef_parts
    if norm is not None:
        raise ValueError("stats_step: a clip's norm is handed out before the step (finish the stats first)")
    device = coef_out.device
    ext = _native(device)
    h = health
    skip = h["skip_out"]
    groups = view_of.get("groups", -1)
    if (ext is not None and hasattr(ext, "stats_step") and (norm_type == 2.0 or math.isinf(norm_type))
            and fp32_on(parts, coef_out.get_device()) and skip is not None and order
            and h.get("counters") is not None and h.get("record") is not None
            and ("ranks" not in view_of or h["record"].numel() == 4)
            and _scalars_take(ext, coef_out, base, skip, steps, h)):
        natives, shards = native_launches(ext, launches, order, grads, hparams)
        if natives is not None:
            if groups >= 0 and coef_out.is_cuda:
                _set_group_chunks(ext, natives, launches, order, coef_out.device, n_params, views[groups][1])
            table, records = (prepare.table, prepare.records) if coef_out.is_cuda else (None, None)
            return ext.stats_step(list(parts), int(end), float(norm_type), list(views), view_of["touched"],
                                  view_of.get("ranks", -1), groups, coef_out, base, float(scale), steps, skip,
                                  h.get("inv_scale"), float(h.get("avg", 1.0)), float(h.get("skip_above", math.inf)),
                                  h["counters"], h["record"], h.get("record_host"), h.get("spare"), natives, shards,
                                  hparams, table, records)
    out = stats_cat_finish(parts, end, norm_type, views)
    if groups >= 0:
        group_partials_all(launches, order, grads, out[3 + groups], norm_type, n_params)
    touched = out[3 + view_of["touched"]]
    ranks = view_of.get("ranks", -1)
    h = dict(health, raw_norm=out[1], ranks=out[3 + ranks] if ranks >= 0 else None)
    launch_step(coef_out, coef_parts, out[2], steps, touched, h, launches, order, grads, hparams, prepare,
                bias_correction)
    return out


def _set_group_chunks(ext: Any, natives: Sequence[Any], launches: Sequence[AdamLaunch], order: Sequence[int],
                      device: torch.device, n_params: int, n_groups: int) -> None:
    """Give each native launch of ``natives`` (those of ``order`` with segments, as
    ``native_launches`` returns them) the chunk map of its group partials on CUDA, once."""
    if all(native.group_chunks is not None for native in natives):
        return
    with_segments = [launches[i] for i in order if launches[i].segments.segments]
    for native, launch in zip(natives, with_segments):
        if native.group_chunks is None:
            native.group_chunks = group_chunk_map(ext, launch.segments, device, launch.master.numel(), n_params,
                                                  n_groups)
