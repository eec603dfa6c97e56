"""The step's health in one object: why steps were skipped, whose grads overflowed, each param
group's norm, and the counters ``step_stats()`` reports. The optimizer, deferred.py and the
scalers ask a :class:`StepHealth` through its methods; it holds no reference to the optimizer.

Where each piece lives, and when the host sees it:

* **Per-param non-finite flags of THIS rank's grads before their reduction** (float32 ``[P + 1]``,
  the last entry "any param"): set in backward by ``kernels.nonfinite_flags`` over each bucket's
  buffer just before its reduce-scatter (grad_sync.py calls :meth:`StepHealth.check_landed`), so
  an inf that only the reduction produced (an fp16 sum overflowing) sets none. They follow the
  grads: started from zero by the first landing after ``zero_grad``, accumulated otherwise. The
  last step's flags are kept beside the current ones (``last_flags``): on CUDA the host learns
  that a step was skipped only at the next step's stats, after the next backward landed. The two
  buffers take turns; the step's scalar launch zeroes the one the next round takes up (no one
  reads it once the step is launched), so that round starts with no launch of its own: one
  launch fewer at every ``zero_grad`` (where one process sets its landing plan) or first landing.
* **In the one stats all-reduce**, after the touched flags (:meth:`entries`): the number of ranks
  whose own grads held inf/NaN (their "any" flags, SUM; MAX for the inf norm: still "any"), then,
  with several param groups, each group's norm partial (the norm type of the step's stats).
* **On the device, written by the step's scalar launch** (``kernels.step_scalars``): the step's
  skip flag (found-inf, or a spike: the unscaled norm above ``skip_grad_norm_above``), fp64
  counters ``[applied, skipped non-finite, skipped spike, consecutive skips]`` and the record
  ``[reason, unscaled norm, ranks whose own grads held inf/NaN, inverse scale]`` (reason 0
  applied, 1 non-finite, 2 spike; the inverse scale 1 without a scaler). Nothing is read on the
  host per step.
* **On the host**, where a step's flags are read anyway (deferred.py: at once on the CPU, at the
  next step's stats on CUDA; never at world 1 with a scaler and float lrs, nor for steps
  replayed in a CUDA graph, where nothing is read back per step): :meth:`observe` learns the
  outcome; if the step was skipped for non-finite grads and some rank's own grads held inf/NaN,
  every rank all-gathers the per-param flags there (one small collective, after such a step
  only) and the report ``[(global rank, param name)]`` is kept. The ``shardamp`` logger names
  them, once per burst of consecutive skipped steps, and loss-scale back-offs once per burst.
"""
from __future__ import annotations

import logging
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _compat, kernels, norms

LOGGER = logging.getLogger("shardamp")
SKIPS_BEFORE_WARNING = 3  # consecutive skipped steps without a scaler before the warning
APPLIED, NONFINITE, SPIKE = 0, 1, 2  # the record's reasons


def check_skip_above(value: Any) -> float:
    """``skip_grad_norm_above`` as the threshold the step compares with (``inf``: never)."""
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < value < math.inf):
        raise ValueError(
            f"skip_grad_norm_above={value!r}: expected None or a finite float > 0, the global grad norm "
            "(unscaled, before clipping) above which a step is skipped on every rank")
    return float(value)


def param_names(param_groups: Sequence[Dict[str, Any]]) -> List[str]:
    """Every param's name in the optimizer's order: its ``param_names`` entry (the optimizer was
    given ``named_parameters()``), else ``"group {g}, param {i}, shape (...)"``, ``i`` counted
    within the group."""
    names: List[str] = []
    for g, group in enumerate(param_groups):
        given = group.get("param_names")
        for i, p in enumerate(group["params"]):
            names.append(str(given[i]) if given is not None and i < len(given)
                         else f"group {g}, param {i}, shape {tuple(p.shape)}")
    return names


def bucket_rows(slots: Sequence[Any]) -> List[List[int]]:
    """The ``(start, length, param index)`` rows of a bucket's params in its flat buffer, sorted by
    start (``kernels.nonfinite_flags``' input; ``slots``: layout.ParamSlot)."""
    return [list(r) for r in sorted((s.offset, s.numel, s.index) for s in slots)]


@dataclass
class _StepNorms:
    """The reduced stats of one step that stay readable after it: views into its stats tensor."""

    partials: Tensor  # each group's norm partial (G == 1: the whole norm's)
    norm_type: float
    nonfinite_ranks: Tensor  # 1 element: ranks whose own grads held inf/NaN
    inv_scale: Optional[Tensor] = None  # the step's 1 / scale (set when it is stepped)


class StepHealth:
    """Per-step health state of one optimizer (see the module docstring).

    Args:
        device: the params' device. comm: the optimizer's ``Comm`` (the report's all-gather).
        buckets: the layout's buckets (each bucket's param rows). param_groups: the optimizer's
        groups (names, read when a report is made). skip_above: ``check_skip_above``'s threshold.
        capturable: the flags keep their addresses (CUDA graphs): copied, never swapped.
        fp16_grads: grads are reduced in fp16 (named by the no-scaler skip warning).
    """

    def __init__(self, device: torch.device, comm: Any, buckets: Sequence[Any], param_groups: List[Dict[str, Any]],
                 skip_above: float, capturable: bool, fp16_grads: bool = False) -> None:
        self.device = device
        self.comm = comm
        self.param_groups = param_groups
        self.n_params = sum(len(g["params"]) for g in param_groups)
        self.n_groups = len(param_groups)
        self.skip_above = skip_above
        self.capturable = capturable
        self.fp16_grads = fp16_grads
        self.host_rows = [bucket_rows(b.slots) for b in buckets]  # what the reference reads: no device read
        self.rows = [torch.tensor(r, dtype=torch.int64).reshape(len(r), 3).to(device) for r in self.host_rows]
        f32 = dict(dtype=torch.float32, device=device)
        self.flags = torch.zeros(self.n_params + 1, **f32)  # this step's (the grads since zero_grad)
        self.last_flags = torch.zeros(self.n_params + 1, **f32)  # the last step's, once this one landed
        # each one's "any" entry as a 1-element view, made once (swapped with them): a view made
        # every step costs microseconds of host time
        self._any = {id(t): t[-1:] for t in (self.flags, self.last_flags)}
        self.counters = torch.zeros(4, dtype=torch.float64, device=device)
        # the last step's [reason, unscaled norm, ranks whose own grads held inf/NaN, inverse scale
        # (1 without)]: written whole by the step's scalar launch, read back as it is (deferred.py)
        self.record = torch.zeros(4, **f32)
        self.skip = torch.zeros((), **f32)  # the step's skip flag: what the step kernel skips on
        self._group_zeros = torch.zeros(self.n_groups, **f32) if self.n_groups > 1 else None
        # host side
        self._landed = False  # a bucket was checked since the last step (the flags are the next step's)
        self._reset = False  # zero_grad since: the next landing starts the flags from zero
        # the spare flags (last_flags before the round's first landing) were zeroed by the last
        # step's scalar launch (step_args hands them over): the round's first landing swaps them
        # in without a launch of its own
        self._spare_zero = False
        self._round: Optional[_StepNorms] = None  # this round's, from its stats
        self._last: Optional[_StepNorms] = None  # the last step's
        self.steps = 0  # step() calls (and steps a scaler skipped on the host)
        self._report: List[Tuple[int, str]] = []
        self._report_of = 0  # the step the report belongs to (0: none)
        self._scaler: Optional[weakref.ref] = None
        self._pushed = False  # the last step's record was pushed for the host (deferred.py)
        # what the host has seen, for the logger and the no-scaler warning
        self._burst = 0  # consecutive skipped steps seen so far
        self._backing_off = False
        self._last_scale: Optional[float] = None
        self._unscaled_skips = 0
        self._warned_skips = False
        self._summarised = 0.0  # skipped steps already summarised by step_stats()

    # ------------------------------------------------------------------ backward
    def check_landed(self, bucket: int, full: Tensor, partial: Optional[Tensor] = None, assign: bool = False) -> None:
        """Backward, just before bucket ``bucket``'s buffer ``full`` (this rank's grads, not yet
        reduced; at world 1 the shard itself) is reduce-scattered: flag its params holding inf/NaN.
        One launch, no host read (grad_sync.py calls it).

        Args:
            partial: where ``full``'s L2 partial goes in the same read pass (float32 ``[2]``; at
                one process, where ``full`` is the shard and nothing is reduced), or None.
            assign: the partial replaces ``partial``'s values instead of adding to them."""
        rows, flags = self.landing_flags(bucket)
        if partial is None:
            kernels.nonfinite_flags(full, rows, flags, self.host_rows[bucket])
        else:
            kernels.bucket_stats(full, rows, flags, partial, assign, self.host_rows[bucket])

    def landing_flags(self, bucket: int) -> Tuple[Tensor, Tensor]:
        """What a pass over landed bucket ``bucket`` flags its params in: its ``(start, length,
        index)`` rows on the device and the flags of this round, started over (and the last
        step's kept) at the round's first landing. For a caller that runs the pass itself
        (the grad hook's landing under a plan, sync/merged_landings.py: the landing and the pass
        in one native call)."""
        if not self._landed:  # the first landing after a step: keep that step's flags
            self._landed = True
            if self._reset and not self.capturable:
                self.flags, self.last_flags = self.last_flags, self.flags
                if not self._spare_zero:
                    self.flags.zero_()
            else:
                self.last_flags.copy_(self.flags)
                if self._reset:
                    self.flags.zero_()
            self._reset = self._spare_zero = False
        elif self._reset:
            self.flags.zero_()
            self._reset = False
        return self.rows[bucket], self.flags

    def landing_rows(self, bucket: int) -> Tensor:
        """Bucket ``bucket``'s ``(start, length, index)`` rows on the device (what
        :meth:`landing_flags` returns first, without starting the round's flags)."""
        return self.rows[bucket]

    def grads_dropped(self) -> None:
        """``zero_grad``: the grads (so their flags) start over; this round's norms are dropped."""
        self._reset = True
        self._round = None

    # ------------------------------------------------------------------ the stats all-reduce
    @property
    def n_entries(self) -> int:
        """Floats this object adds to the stats all-reduce (after the touched flags)."""
        return 1 + (self.n_groups if self.n_groups > 1 else 0)

    def entries(self) -> List[Tensor]:
        """This rank's entries for the stats tensor: its "any non-finite" flag (a view), and
        zeros where the group partials are accumulated (several groups only)."""
        return [self._any[id(self.flags)]] + ([] if self._group_zeros is None else [self._group_zeros])

    def group_slice(self, offset: int) -> Optional[slice]:
        """Where the group partials sit in a stats tensor whose entries start at ``offset`` (None
        with one group: its partial is the whole norm's, ``stats[0]``)."""
        return slice(offset + 1, offset + 1 + self.n_groups) if self.n_groups > 1 else None

    def stats_views(self, offset: int) -> List[Tuple[int, int]]:
        """``(start, length)`` of the views :meth:`note_stats` takes, in a stats tensor whose
        entries start at ``offset``: the group partials (the norm's partial with one group),
        then the count of ranks whose own grads held inf/NaN."""
        groups = self.group_slice(offset)
        return [(0, 1) if groups is None else (groups.start, self.n_groups), (offset, 1)]

    def note_stats(self, views: Sequence[Tensor], norm_type: float) -> None:
        """The step's stats were all-reduced: ``views`` are those :meth:`stats_views` named."""
        partials, ranks = views
        self._round = _StepNorms(partials, norm_type, ranks)

    # ------------------------------------------------------------------ the step
    def step_args(self, raw_norm: Tensor, inv_scale: Optional[Tensor], avg: float,
                  record_host: Optional[Tensor] = None) -> Dict[str, Any]:
        """``kernels.step_scalars``' ``health`` argument: it decides the skip flag (:attr:`skip`)
        and updates the counters and the record in the step's one scalar launch (and writes the
        record into ``record_host`` too, where the host reads it: deferred.py). The same launch
        zeroes the spare flags (``spare``: the buffer the next round's first landing swaps in, read
        by no one once this step is launched: the last step's flags were observed before it), so
        that landing, often at ``zero_grad``, launches nothing for them. Not with CUDA graphs
        (the flags are copied there, not swapped)."""
        spare = None if self.capturable else self.last_flags
        return dict(skip_out=self.skip, raw_norm=raw_norm, inv_scale=inv_scale, avg=float(avg),
                    skip_above=self.skip_above, counters=self.counters, record=self.record,
                    ranks=self._round.nonfinite_ranks if self._round is not None else None,
                    record_host=record_host, spare=spare)

    def stepped(self, inv_scale: Optional[Tensor], launched: bool = True) -> None:
        """The step consumed this round: its norms and flags become the last step's.
        ``launched``: its scalar launch ran with :meth:`step_args` (False: a scaler skipped it on
        the host), so it zeroed the spare flags."""
        self.steps += 1
        self._landed = False
        self._spare_zero = launched and not self.capturable
        if self._round is not None:
            self._round.inv_scale = inv_scale
        self._last, self._round = self._round, None
        self._pushed = False
        if inv_scale is not None:  # a scaled step: the no-scaler warning counts unscaled skips in a row
            self._unscaled_skips = 0

    def pushed_record(self) -> Tensor:
        """What the last step pushes for the host (deferred.py), float32 ``[reason, unscaled norm,
        ranks whose own grads held inf/NaN, inverse scale (1 without a scaler)]``: the record the
        step's scalar launch wrote whole, no op."""
        self._pushed = True
        return self.record

    def host_skipped(self, unscaled_norm: Tensor, inv_scale: Optional[Tensor]) -> None:
        """A scaler skipped this round's step on the host (``_step_supports_amp_scaling = False``:
        torch's path read found-inf): count it as the kernel counts a found-inf step, and learn
        its outcome at once (every rank: the scaler's found-inf is agreed). A host sync, as the
        scaler's own."""
        self.counters.add_(torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64, device=self.device))
        one = torch.ones((), dtype=torch.float32, device=self.device)
        ranks = self._round.nonfinite_ranks.reshape(()) if self._round is not None else one * 0.0
        inv = one if inv_scale is None else inv_scale.reshape(()).to(device=self.device, dtype=torch.float32)
        self.record.copy_(torch.stack([one, unscaled_norm.reshape(()).float(), ranks, inv]))
        self.stepped(inv_scale, launched=False)
        self.observe(self.steps, self.pushed_record().tolist(), scaled=inv_scale is not None)

    # ------------------------------------------------------------------ the host learns the outcome
    def observe(self, step: int, values: Sequence[float], scaled: bool) -> None:
        """Step ``step``'s pushed record (:meth:`pushed_record`) read on the host, on every rank at
        the same point (deferred.py): all-gather the ranks' flags if some rank's own grads held
        inf/NaN in a skipped step (a collective), keep the report, log, warn."""
        reason, norm, ranks, inv = int(values[0]), float(values[1]), float(values[2]), float(values[3])
        if step != self._report_of:
            report = self._gather() if reason == NONFINITE and ranks > 0 else []
            if step == self.steps:
                self._report, self._report_of = report, step
        else:
            report = self._report
        self._log(step, reason, norm, ranks, report, (1.0 / inv) if scaled and inv > 0 else None)
        if reason == NONFINITE and not scaled:
            self._unscaled_skips += 1
        elif reason != NONFINITE:
            self._unscaled_skips = 0
        if self._unscaled_skips >= SKIPS_BEFORE_WARNING and not self._warned_skips:
            self._warned_skips = True
            warnings.warn(
                f"DistributedFusedAdam: the last {self._unscaled_skips} steps were all skipped because the "
                "gradients (summed over the ranks) held inf/NaN, and no grad scaler is in use"
                + (" (grads are reduced in float16, whose max is 65504)" if self.fp16_grads else "") + ". Nothing is "
                "training. Reduce the grads in float32 (grad_sync_dtype=torch.float32) or use "
                "shardamp.scaler.ShardedGradScaler, which lowers the loss scale when this happens.",
                RuntimeWarning, stacklevel=5,
            )

    def flags_of_last_step(self) -> Tensor:
        """The last step's per-param flags (``[-1]``: any): the current ones until the next
        landing, then the kept copy."""
        return self.last_flags if self._landed else self.flags

    def _gather(self) -> List[Tuple[int, str]]:
        """All-gather every rank's flags of the last step (a collective over the optimizer's
        ranks; nothing at world 1) and name them: sorted ``(global rank, param name)``."""
        mine = (self.flags_of_last_step()[: self.n_params] > 0).to(torch.uint8)
        table = self.comm.all_gather_flags(mine).cpu()
        ranks = self.comm.global_ranks()
        names = param_names(self.param_groups)
        return sorted((ranks[r], names[i]) for r, i in table.nonzero().tolist())

    def _log(self, step: int, reason: int, norm: float, ranks: float, report: List[Tuple[int, str]],
             scale: Optional[float]) -> None:
        if reason != APPLIED:
            if self._burst == 0:
                if reason == NONFINITE:
                    where = ("; ".join(f"rank {r}: {n}" for r, n in report) if report else
                             "no rank's own gradients held inf/NaN: it arose in their reduction, the norm or "
                             "the loss scale" if ranks == 0 else "on some rank")
                    LOGGER.warning("step %d skipped: non-finite gradients (%s); further skips in a row are not "
                                   "logged", step, where)
                else:
                    LOGGER.warning("step %d skipped: gradient norm %.6g above skip_grad_norm_above=%g; further "
                                   "skips in a row are not logged", step, norm, self.skip_above)
            self._burst += 1
        else:
            if self._burst > 1:
                LOGGER.info("step %d applied after %d skipped steps in a row", step, self._burst)
            self._burst = 0
        if scale is None:
            return
        if self._last_scale is not None and scale < self._last_scale:
            if not self._backing_off:
                LOGGER.warning("loss scale backed off from %g to %g before step %d; further back-offs in a row are "
                               "not logged", self._last_scale, scale, step)
            self._backing_off = True
        else:
            self._backing_off = False
        self._last_scale = scale

    # ------------------------------------------------------------------ asked by the user
    def last_nonfinite(self) -> List[Tuple[int, str]]:
        """See ``DistributedFusedAdam.last_nonfinite``."""
        if self.steps == 0:
            return []
        if self._report_of == self.steps and not self.capturable:
            return list(self._report)
        last = self._last
        ranks = last.nonfinite_ranks.float() if last is not None else self.record.new_zeros(1)
        reason, count = torch.cat([self.record[:1], ranks]).tolist()  # a host read
        report = self._gather() if int(reason) == NONFINITE and count > 0 else []
        if not self.capturable:  # a graph replay rewrites the device values: read them every time
            self._report, self._report_of = report, self.steps
        return list(report)

    def group_norms(self, last: bool, avg: float, inv_scale: Optional[Tensor]) -> Tensor:
        """Each group's norm of this round (``last=False``) or the last step, averaged and
        multiplied by ``inv_scale`` (the last step's own when ``last``); a new 1-D float32 tensor."""
        # a round a scaler skipped on the host (host_skipped) was handed to ``_last`` already
        last = last or (self._round is None and self._last is not None)
        norms_of = self._last if last else self._round
        if norms_of is None:
            raise RuntimeError("grad_norms_by_group(): no step's norms yet; call it after backward (every rank) "
                               "or after step()")
        inv = norms_of.inv_scale if last else inv_scale
        out = norms.root(norms_of.partials, norms_of.norm_type) * avg
        return out if inv is None else out * inv

    def note_scaler(self, scaler: Any) -> None:
        """The scaler driving this optimizer (``step_stats``' ``loss_scale``); held weakly."""
        self._scaler = weakref.ref(scaler)

    def stats(self) -> Dict[str, Any]:
        """See ``DistributedFusedAdam.step_stats``: ONE host read (counters, record and scale
        together)."""
        scaler = self._scaler() if self._scaler is not None else None
        scale = _compat.scaler_scale(scaler) if scaler is not None and scaler.is_enabled() else None
        parts = [self.counters, self.record[:2].double()]
        if scale is not None:
            parts.append(scale.detach().reshape(1).to(device=self.device, dtype=torch.float64))
        values = torch.cat(parts).tolist()
        applied, nonfinite, spike, consecutive, _reason, norm = values[:6]
        skipped = nonfinite + spike
        if not self._pushed and skipped > self._summarised:  # no per-step read saw them: say so here
            LOGGER.warning("steps skipped since the last report: %d (in all %d of %d: %d non-finite, %d above "
                           "skip_grad_norm_above)", skipped - self._summarised, skipped, self.steps, nonfinite, spike)
        self._summarised = skipped
        return {
            "steps": int(applied),
            "skipped_steps": int(skipped),
            "skipped_spike": int(spike),
            "skipped_nonfinite": int(nonfinite),
            "consecutive_skips": int(consecutive),
            "last_grad_norm": None if self.steps == 0 else norm,
            "loss_scale": None if scale is None else values[6],
        }
