"""The one small all-reduce per step, and the scalars derived from it.

Each rank fills a float32 tensor ``[norm_partial, nonfinite, touched_0 .. touched_{P-1}, health
entries, agreement entries]`` (health.py: ranks whose own grads held inf/NaN, per-group norm
partials; agreement.py: what the ranks must agree on): the
partial norm of its grad shards (``sum |g|^p``, or ``max |g|`` for ``p = inf``) and its
non-finite flag in one pass per shard, plus which params got a grad on this rank. ONE
all-reduce (SUM for finite ``p``; MAX for ``inf``, where a max of 0/1 flags is still the "any")
gives the global norm, the global found-inf and the set of params touched on some rank.
Everything stays on the device. The norm math (partials, root, clip coefficients) is norms.py's.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import kernels, norms
from ..kernels import fused_step
from ..checks import agreement
from ..kernels import partials
from ..layout import forward_order

HEADER = norms.PARTIAL  # norm partial, non-finite flag


@dataclass
class GradStats:
    """Global stats of the landed (still scaled, still summed) grads of one step."""

    norm_type: float
    raw_norm: Tensor  # norm of the grad shards as stored: before averaging and unscaling
    found_inf: Tensor  # 0-d float32, exactly 0.0 or 1.0, agreed by every rank
    touched: Tensor  # float32 [P], 1.0 where some rank produced a grad for the param
    # float32 0/1 [invalid value on some rank, ranks disagree on category 0, 1, ...] (agreement.py)
    disagreement: Optional[Tensor] = None
    views: Sequence[Tensor] = ()  # the views of the stats ``finish`` was asked for, in order


def finish(stats: Tensor, norm_type: float, n_params: Optional[int] = None, fingerprint=None,
           n_health: int = 0, views: Sequence[Tuple[int, int]] = ()) -> GradStats:
    """Turn the all-reduced ``stats`` into a :class:`GradStats`. The ``n_health`` entries of the
    step's health (health.py) follow the touched flags; with ``fingerprint``
    (agreement.StepFingerprint), ``stats[HEADER + n_params + n_health:]`` holds its entries: a
    mismatch or an invalid lr sets found-inf, so the kernel skips the step on every rank.
    ``views``: ``(start, length)`` of more views of ``stats`` the caller keeps (made in the same
    native call: ``GradStats.views``)."""
    end = stats.numel() if n_params is None else HEADER + n_params
    # one launch (kernels.stats_finish): on a GPU each op is a launch the host pays for before
    # the step kernel; the touched counts (SUM-reduced, or MAX-reduced flags) become 0/1
    raw, found_inf, touched, *more = kernels.stats_finish(stats, end, norm_type, [(HEADER, end - HEADER), *views])
    if fingerprint is None:
        return GradStats(norm_type, raw, found_inf, touched, views=more)
    disagreement = fingerprint.check(stats[end + n_health:], math.isinf(norm_type))
    found_inf = torch.maximum(found_inf, disagreement.reshape(()) if disagreement.numel() == 1 else disagreement.amax())
    return GradStats(norm_type, raw, found_inf, touched, disagreement=disagreement, views=more)


class TouchedPatterns:
    """Device copies of the host-side "got a grad" masks and of the step's agreement entries,
    each cached on its own, so that a training loop whose mask repeats copies nothing to the
    device after its first step (no sync, capturable), and a float lr changing every step (an LR
    scheduler) re-uploads only its few agreement floats, not the mask of every param."""

    def __init__(self, device: torch.device, capacity: int = 8) -> None:
        self.device = device
        self.capacity = capacity
        self.masks: "OrderedDict[bytes, Tensor]" = OrderedDict()
        self.tails: "OrderedDict[tuple, Tensor]" = OrderedDict()
        self.header = torch.zeros(HEADER, dtype=torch.float32, device=device)  # the norm header's start

    def get(self, mask: Union[bytes, Sequence[bool]]) -> Tensor:
        """``mask`` (0/1 bytes, or bools) as float32 0/1 on the device."""
        return self._cached(self.masks, bytes(mask), lambda: [float(m) for m in mask])

    def get_tail(self, tail: Sequence[float]) -> Tensor:
        """The agreement entries ``tail`` as float32 on the device."""
        return self._cached(self.tails, tuple(tail), lambda: list(tail))

    def _cached(self, cache: "OrderedDict", key: Any, values: Any) -> Tensor:
        t = cache.get(key)
        if t is None:
            host = torch.tensor(values(), dtype=torch.float32)
            if self.device.type == "cuda":
                # pinned + non_blocking: a new pattern (e.g. MoE routing) costs no host sync; the
                # caching host allocator keeps the pinned buffer alive until the copy is done
                t = host.pin_memory().to(self.device, non_blocking=True)
            else:
                t = host
            cache[key] = t
            if len(cache) > self.capacity:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return t


class ReducedStats(NamedTuple):
    """``reduce_step_stats``'s result."""

    stats: GradStats
    checked: bool  # the agreement entries must be read (raise on disagreement / invalid values)
    names: List[str]  # the agreement categories compared, in entry order


def reduce_step_stats(
    norm_type: float,
    grad_shards: Sequence[Tensor],
    buckets: Sequence[Any],
    n_params: int,
    health: Any,
    view: "agreement.StepView",
    problem: str,
    lrs: Optional[Any],
    landed: Callable[[], Optional[Tensor]],
    reduce: Optional[Callable[[Tensor, Any], None]],
    defer: bool = False,
) -> Union[ReducedStats, "StatsPlan"]:
    """The step's one stats all-reduce: fill this rank's entries, reduce them, finish.

    Args:
        norm_type: the first norm type asked for this step.
        grad_shards: each bucket's reduced grad shard on this rank.
        buckets: the layout's buckets (their segments, for the per-group partials).
        n_params: the optimizer's param count.
        health: the optimizer's StepHealth (its entries ride in the same tensor).
        view: what the agreement entries read (checks/agreement.py).
        problem: this rank's invalid value ("" if none): flagged in the entries, never raised
            before the all-reduce (the other ranks would wait in it).
        lrs: this step's tensor lrs (hparams.TensorLrs) or None.
        landed: the L2 partials computed as the grads landed (the stats' header), if they are
            complete (sync/grad_sync.py ``landed_stats``); None: computed here.
        reduce: the all-reduce (the optimizer's ``_reduce_grad_stats``, a subclass's extension
            point); None where nothing reduces (one process): the stats are assembled and
            finished in one native call.
        defer: where nothing reduces and nothing is compared, return the :class:`StatsPlan`
            instead, for the step's one native call to finish (``StatsPlan.finished``).

    A collective (``reduce``); no host sync.
    """
    header = landed() if norm_type == 2.0 else None
    offset = HEADER + n_params  # where the health entries start
    groups = health.group_slice(offset)
    views = health.stats_views(offset)
    parts, checked, names = agreement.stats_parts(view, norm_type, problem, lrs, health.entries(), header)
    if reduce is None and not checked:  # one process, nothing to compare: assembled and finished in one call
        if header is None:
            parts[0] = partials.partial(list(grad_shards), norm_type, device=parts[0].device)
        plan = StatsPlan(parts, offset, norm_type, [(HEADER, n_params), *views], groups, names,
                         buckets, grad_shards, n_params, health)
        return plan if defer else plan.finished(fused_step.stats_cat_finish(parts, offset, norm_type, plan.views))
    buf = torch.cat(parts)  # one launch: each device-to-device copy_ would be a cudaMemcpyAsync
    if header is None:
        partials.partial(list(grad_shards), norm_type, buf, zeroed=True)
    if groups is not None:  # each group's partial too (one launch per bucket), for grad_norms_by_group
        _group_partials(buckets, grad_shards, buf[groups], norm_type, n_params)
    if reduce is not None:
        reduce(buf, norms.reduce_op(norm_type))
    stats = finish(buf, norm_type, n_params, view.fingerprint if checked else None, health.n_entries, views)
    health.note_stats(stats.views, norm_type)
    return ReducedStats(stats, checked, names)


class StatsPlan(NamedTuple):
    """One process, nothing to compare: the stats' parts, assembled and finished by one native
    call (``fused_step.stats_cat_finish``, then :meth:`finished`; or the step's own, :meth:`step`,
    where nothing asked for the stats before the step)."""

    parts: List[Tensor]
    end: int  # where the touched flags end (the finish's ``end``)
    norm_type: float
    views: List[Tuple[int, int]]  # the touched flags', then the health's (health.stats_views)
    groups: Optional[slice]  # the group partials' place (several groups), written after the finish
    names: List[str]
    buckets: Sequence[Any]
    grad_shards: Sequence[Tensor]
    n_params: int
    health: Any

    def step(self, coef_out: Tensor, coef_parts: Tuple[Tensor, float, Optional[Tensor], float], steps: Tensor,
             health: Dict[str, Any], launches: Sequence[Any], order: Sequence[int], grads: Sequence[Tensor],
             hparams: Tensor, prepare: Any, bias_correction: bool) -> GradStats:
        """Finish the stats in the step's one native call (``fused_step.stats_step``: then the
        param groups' partials, the scalars, the health record and every bucket's update;
        ``health``: ``step_scalars``' keywords, its norm and ranks count taken from these
        stats); returns the stats."""
        # views: the touched flags, then health.stats_views' (group partials, ranks with inf/NaN)
        view_of = {"touched": 0, "ranks": 2} if self.groups is None else {"touched": 0, "groups": 1, "ranks": 2}
        out = fused_step.stats_step(self.parts, self.end, self.norm_type, self.views, view_of, coef_out, coef_parts,
                                    steps, health, launches, order, grads, hparams, prepare, bias_correction,
                                    self.n_params)
        return self.stats_of(out, groups_formed=True)

    def finished(self, out: Sequence[Tensor]) -> ReducedStats:
        """The reduced stats from the finish's ``[stats, norm, found_inf, *views]``."""
        return ReducedStats(self.stats_of(out), False, self.names)

    def stats_of(self, out: Sequence[Tensor], groups_formed: bool = False) -> GradStats:
        """The stats from the finish's ``[stats, norm, found_inf, *views]`` (``groups_formed``:
        the step's call formed the group partials too)."""
        _buf, raw, found_inf, touched, *more = out
        if self.groups is not None and not groups_formed:
            # after the finish, which reads nothing past the touched flags; more[0] is
            # buf[self.groups] (health.stats_views: the group partials first), made by the native
            # call: a slice here would cost the step another view op
            _group_partials(self.buckets, self.grad_shards, more[0], self.norm_type, self.n_params)
        self.health.note_stats(more, self.norm_type)
        return GradStats(self.norm_type, raw, found_inf, touched, views=more)


def launch_step(stats: Union[GradStats, StatsPlan], bad_clip: Optional[Tensor], launch: Callable[..., None],
                step_args: Callable[[Optional[Tensor]], Dict[str, Any]], coef_out: Tensor,
                coef_parts: Tuple[Tensor, float, Optional[Tensor], float], steps: Tensor, launches: Sequence[Any],
                order: Sequence[int], grads: Sequence[Tensor], hparams: Tensor, prepare: Any, bias_correction: bool,
                after_bucket: Optional[Callable[[int], None]] = None) -> GradStats:
    """The step's launches, from its reduced stats or from their plan; returns the stats.

    The scalar launch (the grad coefficient ``avg * inv_scale * clip``, the skip flag: found-inf, an
    invalid ``max_norm`` (``bad_clip``) or a norm spike; the step counts and the health counters),
    then each bucket's update in ``order``. A :class:`StatsPlan` (one process, nothing asked for the
    stats before the step) is finished in the step's one native call (:meth:`StatsPlan.step`); there
    is no all-gather between its buckets (``after_bucket`` None) and nothing offloaded (the caller
    defers the stats only then). Otherwise ``launch`` (``fused_step.launch_step``'s signature: the
    optimizer's ``HostState.launch_step``, which steps offloaded buckets on the host) runs them,
    ``after_bucket(i)`` after bucket ``i``'s kernel. ``step_args(raw_norm)``: the health's
    ``step_scalars`` keywords (``StepHealth.step_args``). No collective; no host sync but an
    offloaded step's one (host_state.py).

    Raises:
        ValueError: a plan with ``after_bucket`` (its one call has no place for an all-gather).
    """
    if isinstance(stats, StatsPlan):
        if after_bucket is not None:
            raise ValueError("launch_step: a stats plan steps every bucket in one call; no all-gather between them")
        return stats.step(coef_out, coef_parts, steps, step_args(None), launches, order, grads, hparams, prepare,
                          bias_correction)
    found_inf = stats.found_inf if bad_clip is None else torch.maximum(stats.found_inf, bad_clip)
    launch(coef_out, coef_parts, found_inf, steps, stats.touched, step_args(stats.raw_norm), launches, order, grads,
           hparams, prepare, bias_correction, after_bucket)
    return stats


def _group_partials(buckets: Sequence[Any], grad_shards: Sequence[Tensor], out: Tensor, norm_type: float,
                    n_params: int) -> None:
    # in the step's bucket order, as the step's one native call adds them: a step's group norms
    # do not depend on whether a clip finished its stats or the step did
    kernels.group_partials_all(buckets, forward_order(len(buckets)), grad_shards, out, norm_type, n_params)


def reduce_norm(norm_type: float, grad_shards: Sequence[Tensor], device: Any,
                reduce: Callable[[Tensor, Any], None]) -> Tensor:
    """A second norm type in one step: its own (tiny) all-reduce, as extensible as the first.
    Returns the global norm before averaging and unscaling. A collective; no host sync."""
    buf = partials.partial(list(grad_shards), norm_type, device=device)
    reduce(buf, norms.reduce_op(norm_type))
    return norms.root(buf[0], norm_type)
