"""A DistributedFusedAdam's grads read as torch would hold them in ``param.grad``.

The optimizer keeps, per bucket, this rank's shard of the reduced grads: SUMMED over the ranks
and still SCALED by the loss scale; the averaging factor, ``1/scale`` and the clip coefficients
are one device scalar the step kernel multiplies the grads by (``StepRound.coef``). Reading the
grads therefore means: the shard's elements, times that scalar as far as it is known now
(:meth:`GradsView.factor`):

* before ``unscale_``: ``avg`` (the grads are scaled, as torch's are before ``unscale_``);
* after ``unscale_``: ``avg / scale``; after a clip also the clip coefficients recorded so far
  (each from its norm as it stands now), so the values are torch's clipped grads;
* after ``step`` (until ``zero_grad`` or the next backward): the coefficient that step used
  (``max_grad_norm``'s clip included, which torch has no equivalent of).

torch's clip before ``unscale_`` compares ``max_norm`` with the norm of the SCALED grads, the
value its ``get_total_norm`` returns then: :meth:`GradsView.total_norm` hands out that value (not
the optimizer's norm tensor, which ``unscale_`` divides in place) and :meth:`GradsView.clip`
keeps the norm it is given as it is. What a step applies is what ``param.grad`` shows: grads
reused with a coefficient pending (a backward without ``zero_grad``, a second step without
backward) get it folded in first (:meth:`GradsView.fold_pending`, called by the step cycle).

What is read here, and what it costs:

* :meth:`GradsView.full_grad` (``opt.full_grad(p)``): the whole grad of one param on every rank,
  in the param's shape, dtype and strides (memory order: a channels_last weight stays
  channels_last). A collective: every rank's arrival in the store first (comm/order.py
  ``arrive``: a rank alone raises in bounded time, issuing no collective), an agreement
  all-reduce (every rank asks for the same param, bounded waits), a MAX all-reduce of "some rank
  produced a grad for it" (None otherwise, as torch), the reduction of grads still pending
  (``grad_sync``), and one all-gather over the shard dim of at most ``min(numel, shard size)``
  elements per rank. Reads a flag on the host.
* :meth:`GradsView.local_grad` (``opt.local_grad(p)``): this rank's slice and its offsets in the
  param's memory order. No collective, no host sync (in-flight reductions are waited for on
  the device's streams).
* :meth:`GradsView.param_norms`: every param's grad norm of one order, for torch's per-param
  norms (``p.grad.norm()``, Lightning's ``grad_norm``): one all-reduce of ``2 x params`` floats
  over the shard dim, after the arrival and an agreement all-reduce (its flags are read on the
  host), once per step and norm order (cached until the grads change); every rank must read
  them, as a framework's logging hook does.
* :meth:`GradsView.total_norm`: the norm over some params' grads (torch's ``get_total_norm``):
  over ALL of the optimizer's params it is ``opt.grad_norm()``, i.e. the step's one stats
  all-reduce, shared with ``unscale_``, clip and ``step``; over a subset, the per-param norms.

Grads not reduced yet: inside ``opt.no_sync()`` the grads accumulated so far are this rank's
own (a torch/DDP loop's ``param.grad`` would hold the local sum there, not the unsharded
loop's), so every read raises, naming the fix. Outside ``no_sync`` a collective read reduces
what is pending first (``grad_sync``: exact, it is what ``step`` would do); ``local_grad``, which
issues no collective, raises instead and names ``opt.grad_sync()``. Both refusals (and that of
torch's clip inside ``no_sync``) are the step cycle's gate's (step/cycle.py ``require``), asked
before any collective: a read out of order raises there on every rank that calls it.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _compat, norms, param_tags
from .checks import agreement
from .comm import order
from .hparams import check_max_norm, check_norm_type
from .step.cycle import Action


class LocalGrad(NamedTuple):
    """This rank's slice of a param's grad: ``tensor`` (1-D, the param's dtype) holds elements
    ``[start, end)`` of the grad in the param's memory order (``torch.empty_like(p)``'s storage
    order: a channels_last weight's NHWC order)."""

    tensor: Tensor
    start: int
    end: int


def owner(p: Tensor) -> Optional[Any]:
    """The live DistributedFusedAdam that manages ``p`` (the last one built over it), or None."""
    return owners((p,))[0]


def owners(params: Sequence[Tensor]) -> List[Optional[Any]]:
    """:func:`owner` of each of ``params``, in one call: torch's clip hands every param of the
    model each step, and a Python frame per param costs a GPU host a microsecond or more."""
    out: List[Optional[Any]] = []
    tag_of = param_tags.by_id
    for p in params:
        tag = tag_of(id(p))
        opt = tag.optimizer() if tag is not None else None
        out.append(opt if opt is not None and tag.owner is opt._grads_view.owner_token else None)
    return out


_GONE = ("the DistributedFusedAdam that managed this param's grad was garbage-collected: read grads while their "
         "optimizer is alive")


@dataclass(frozen=True)
class GradSource:
    """What reading one optimizer's grads needs of it besides its public methods: the params,
    the layout and this rank's buffers, the comm, the grad sync (pending reductions, touched
    params), the step cycle (the round's scale and clips: clips are recorded through it) and the
    coefficient the last step used. The optimizer holds it; a :class:`GradsView` holds it weakly."""

    params: Sequence[torch.nn.Parameter]
    buckets: Sequence[Any]
    buffers: Sequence[Any]
    comm: Any
    device: torch.device
    grad_sync: Any
    cycle: Any
    coef: Tensor  # 0-d, written by every step: what the last step multiplied the grads by


class GradsView:
    """The reads of one optimizer's grads (see the module docstring). Holds the optimizer (for
    its public methods) and its :class:`GradSource` weakly; ``handles`` is torch_tools.py's
    per-param ``ShardedGrad`` cache."""

    def __init__(self, opt: Any, source: GradSource) -> None:
        self._opt = weakref.ref(opt)
        self._source = weakref.ref(source)
        # what the optimizer's grad hooks tag its params with: a param tagged otherwise was taken
        # over by a newer optimizer
        self.owner_token = source.grad_sync.owner_token
        self.index_of: Dict[int, int] = {id(p): i for i, p in enumerate(source.params)}  # by id(param)
        self.handles: List[Optional[Tensor]] = [None] * len(source.params)
        self._moved: List[Tuple[int, Tensor]] = []  # (param, the grad it took along when moved): see moved()
        self.generation = 0  # zero_grad calls: the cached norms are of dropped grads after one
        self._norms: Optional[Tuple[tuple, Tensor]] = None  # (key, raw per-param norms)
        self._scaled: Optional[Tuple[tuple, Tensor]] = None  # (key, the norms times factor())
        self._segment_params: Dict[int, Tensor] = {}  # bucket -> param index of each segment (device)

    # ------------------------------------------------------------ state
    def optimizer(self) -> Any:
        opt = self._opt()
        if opt is None:
            raise RuntimeError(_GONE)
        return opt

    def source(self) -> GradSource:
        src = self._source()
        if src is None:
            raise RuntimeError(_GONE)
        return src

    def index(self, p: Any, what: str) -> int:
        """``p``'s position in the optimizer's params; ``ValueError`` if it does not manage ``p``."""
        i = self.index_of.get(id(p))
        if i is None or self.source().params[i] is not p:
            shape = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
            raise ValueError(f"{what}: the tensor given ({shape}) is not a parameter of this DistributedFusedAdam; "
                             "pass one of its params (opt.param_groups). The grads of params it does not manage "
                             "are in their .grad as usual.")
        return i

    def indices(self, params: Sequence[Any], what: str) -> List[int]:
        """:meth:`index` of each of ``params`` (one call for a whole model's params)."""
        out: List[int] = []
        mine = self.source().params
        get = self.index_of.get
        for p in params:
            i = get(id(p))
            if i is None or mine[i] is not p:
                self.index(p, what)  # raises, naming the tensor
            out.append(i)
        return out

    def dropped(self) -> None:
        """``zero_grad``: the grads (so the cached norms) are gone, also those moved params took along."""
        self.generation += 1
        self._norms = self._scaled = None
        if self._moved:
            params = self.source().params
            for i, grad in self._moved:
                if _compat.raw_grad(params[i]) is grad:  # not replaced since
                    _compat.set_raw_grad(params[i], None)
            self._moved.clear()

    def moved(self, i: int, grad: Tensor) -> None:
        """Param ``i`` was moved or cast (``Module._apply``: its ``.data`` first, then ``.to()`` of its
        ``.grad``) while grads are held: ``grad``, its values where it went, goes into autograd's own
        field, as a plain param's grad does (``Module._apply`` next sets ``.data`` on what ``p.grad``
        returns); ``zero_grad`` drops it."""
        _compat.set_raw_grad(self.source().params[i], grad)
        self._moved.append((i, grad))

    def has_grads(self) -> bool:
        """Some backward on this rank produced grads for this optimizer since ``zero_grad``
        (``param.grad`` is not None in torch then). Read per param by every ``param.grad``
        (torch_tools.py): one frame, the cycle's flag an attribute."""
        src = self._source()
        if src is None:
            raise RuntimeError(_GONE)
        return src.cycle.grad_since_zero

    def require(self, action: Action, what: str) -> None:
        """The step cycle's gate (step/cycle.py): raise if ``action`` is out of order now (a read
        or torch's clip inside ``no_sync``; ``local_grad`` of grads not reduced yet)."""
        self.source().cycle.require(action, what)

    def reduce(self, what: str) -> None:
        """Make the grads readable: raise inside ``no_sync``, else finish their reduction (a
        collective: launches what is pending, in order, on every rank; a wait otherwise)."""
        self.require(Action.READ, what)
        if not self.source().cycle.stepped_since_zero:  # a step consumed them: reduced, nothing to launch
            self.optimizer().grad_sync()

    def factor(self) -> Tensor:
        """The device scalar that turns the stored (summed, scaled) grads into torch's ``param.grad``
        now (the module docstring). Never modify it in place."""
        src = self.source()
        if src.cycle.stepped_since_zero:
            return src.coef  # what the last step multiplied the grads by
        return src.cycle.current().coef()

    def fold_pending(self) -> None:
        """The kept grads are about to be reused (a backward adding to them, a second step on
        them) while ``param.grad`` shows them times a pending coefficient (``factor()``: a clip,
        an unscale, or the last step's coefficient). Multiply each shard in place by that
        coefficient over the averaging factor, so that from now on they show (and a step
        applies) exactly what ``param.grad`` showed: torch's unscale_ and clip act on
        ``param.grad`` in place. One pass over this rank's shards, only in this reuse case (the
        step cycle calls it while it still describes the grads). Local: no collective, no sync.
        A released shard holds no grad (``param.grad`` is None there in torch): nothing to fold,
        and reading it would allocate zeros beside a landing the grad hook may be planning."""
        src = self.source()
        ratio = self.factor() * (1.0 / src.cycle.avg_factor)
        for index, buf in enumerate(src.buffers):
            if buf.released:
                continue
            shard = src.grad_sync.shard(index)  # what the hook landed under its plan is adopted first
            if shard.dtype == torch.float32:
                shard.mul_(ratio)
            else:  # the product in fp32, rounded once (an fp16 1/scale alone would lose digits)
                shard.copy_(shard.float().mul_(ratio))
        self._norms = self._scaled = None  # of the values before the fold

    def _key(self, norm_type: float) -> tuple:
        cycle = self.source().cycle
        return (self.generation, cycle.backwards, cycle.rounds_since_step, cycle.stepped_since_zero, norm_type)

    # ------------------------------------------------------------ norms
    def param_norms(self, norm_type: float, what: str) -> Tensor:
        """float32 ``[params]``: every param's grad norm of order ``norm_type`` as torch would
        compute it on ``param.grad`` now (see the module docstring for the collectives)."""
        norm_type = check_norm_type(norm_type)
        self.require(Action.READ, what)
        src = self.source()
        if self._norms is None or self._norms[0] != self._key(norm_type):
            order.arrive(src.comm, what)  # a rank alone raises in bounded time, issuing no collective
            agreement.agree_on_call(self.optimizer().shard_view(), what, given=norm_type)
            self.reduce(what)
            raw = self._local_partials(norm_type)
            src.comm.all_reduce_shard_dim(raw, norms.reduce_op(norm_type))
            n = len(src.params)
            value = raw[:n] if math.isinf(norm_type) else raw[:n].pow(1.0 / norm_type)
            value = torch.where(raw[n:] > 0, torch.full_like(value, math.nan), value)  # NaN stays NaN (MAX drops it)
            self._norms = (self._key(norm_type), value)
        # torch's tools ask per param (p.grad.norm() for each of P params): the scaled vector is
        # cached until the norms or the factor can change (the scale, a clip, the step)
        key = (self._norms[0], self._factor_key())
        if self._scaled is None or self._scaled[0] != key:
            self._scaled = (key, self._norms[1] * self.factor())
        return self._scaled[1]

    def _factor_key(self) -> tuple:
        """What ``factor()`` depends on: after a step, that step's coefficient; before, the
        round, its phase (unscaling rescales its norms in place) and its clips."""
        cycle = self.source().cycle
        if cycle.stepped_since_zero:
            return ("stepped", cycle.position()["steps"])
        r = cycle.current()
        return (id(r), cycle.phase, len(r.clips))

    def _local_partials(self, norm_type: float) -> Tensor:
        """``[sum |g|^p (max |g| for inf) per param, NaN flag per param]`` over this rank's shards."""
        src = self.source()
        n = len(src.params)
        out = torch.zeros(2 * n, dtype=torch.float32, device=src.device)
        for b, (bucket, buf) in enumerate(zip(src.buckets, src.buffers)):
            segments = bucket.segments.segments
            if not segments:
                continue
            shard = buf.grad_shard
            pieces = [shard[s.start:s.start + s.length] for s in segments]
            seg_norms = torch.stack(_compat.foreach_norm(pieces, norm_type, dtype=torch.float32))
            index = self._segment_params.get(b)
            if index is None:  # a param meets a rank's shard in one segment at most
                index = self._segment_params[b] = torch.tensor([s.param_index for s in segments], device=src.device)
            out[index] = seg_norms if math.isinf(norm_type) else seg_norms.pow(norm_type)
            out[index + n] = seg_norms.isnan().float()
        return out

    def total_norm(self, indices: Sequence[int], norm_type: float) -> Tensor:
        """The norm of order ``norm_type`` over the grads of params ``indices`` (repeats count
        twice, as in torch) as torch's ``get_total_norm`` computes it on ``param.grad`` now."""
        norm_type = check_norm_type(norm_type)
        what = "get_total_norm"
        self.require(Action.READ, what)
        src = self.source()
        if not src.cycle.stepped_since_zero and sorted(indices) == list(range(len(src.params))):
            # every grad once: the step's own stats all-reduce (shared with unscale_, clip, step)
            norm = self.optimizer().grad_norm(norm_type)
            r = src.cycle.current()
            prev = norms.chained_clip_coef(r.clips)
            if prev is not None:
                return norm * prev  # the grads as clipped so far, as torch's
            # torch's value now: the handed-out norm is divided by the scale in place at unscale_
            return norm.clone() if r.inv_scale is None else norm
        per = self.param_norms(norm_type, what)[torch.tensor(list(indices), device=src.device)]
        return per.max() if math.isinf(norm_type) else per.pow(norm_type).sum().pow(1.0 / norm_type)

    # ------------------------------------------------------------ clip, unscale
    def clip(self, indices: Sequence[int], max_norm: Any, total_norm: Tensor) -> None:
        """torch's ``clip_grads_with_norm_`` over params ``indices``: their grads times
        ``min(1, max_norm / (total_norm + 1e-6))``, resolved in the step kernel (no pass over the
        grads). Must cover every param of the optimizer (one coefficient per optimizer)."""
        src = self.source()
        if not self.has_grads():
            return  # torch skips params whose .grad is None
        n = len(src.params)
        if sorted(set(indices)) != list(range(n)):
            missing = n - len(set(indices))
            raise ValueError(
                f"clip_grads_with_norm_ / clip_grad_norm_: parameters includes {n - missing} of the {n} params of a "
                f"DistributedFusedAdam ({missing} missing). Its grads are clipped inside its step by one coefficient: "
                "pass all of them (e.g. model.parameters()), or use one optimizer per set of params you clip "
                "separately.")
        self.require(Action.CLIP, "clip_grads_with_norm_")
        max_norm = check_max_norm(max_norm, src.comm.has_peers)
        src.cycle.reuse_stepped()  # a clip after step() without backward: on what param.grad shows
        norm = torch.as_tensor(total_norm).detach().to(device=src.device, dtype=torch.float32)
        r = src.cycle.current()
        if r.inv_scale is None and any(norm.data_ptr() == n.data_ptr() for n in r.norms.values()):
            # as torch: max_norm is compared with the norm given, i.e. before unscale_ the SCALED
            # norm (torch's idiom passes max_norm * scale); a handed-out norm is unscaled in place later
            norm = norm.clone()
        prev = norms.chained_clip_coef(r.clips)
        # ``total_norm`` is of the grads as clipped so far; the chain multiplies each later clip's
        # norm by the earlier coefficients, so hand it the norm before them
        r.add_clip(max_norm, norm if prev is None else norm / prev)

    def unscale(self, inv_scale: Tensor) -> Tensor:
        """torch's ``GradScaler.unscale_`` reached this optimizer's grads: record ``inv_scale``
        (once per step: its other dtype groups come after) and return the GLOBAL found-inf."""
        self.require(Action.READ, "GradScaler.unscale_")
        r = self.source().cycle.current()
        if r.inv_scale is None:
            return self.optimizer().unscale_grads(inv_scale)  # a subclass's override is honoured
        return r.stats.found_inf

    # ------------------------------------------------------------ whole and local grads
    def _pieces(self, i: int) -> Tuple[Any, Any, Any, List[Tuple[int, int]]]:
        """Param ``i``'s slot, bucket, buffers and per shard rank its ``[lo, hi)`` in bucket coords."""
        src = self.source()
        slot = src.grad_sync.slots[i]
        bucket = src.buckets[slot.bucket]
        size = bucket.shard_numel
        a, b = slot.offset, slot.offset + slot.numel
        ranges = [(max(a, r * size), min(b, (r + 1) * size)) for r in range(src.comm.shard_size)]
        return slot, bucket, src.buffers[slot.bucket], ranges

    def full_grad(self, p: Any) -> Optional[Tensor]:
        return self.full_grad_at(self.index(p, "full_grad"), "full_grad")

    def full_grad_at(self, i: int, what: str) -> Optional[Tensor]:
        """Param ``i``'s whole grad as torch's ``param.grad`` holds it (None where no rank produced
        one): a collective (every rank reads the same param; ``what`` names the read in errors)."""
        self.require(Action.READ, what)
        src = self.source()
        order.arrive(src.comm, what)  # a rank alone raises in bounded time, issuing no collective
        agreement.agree_on_call(self.optimizer().shard_view(), what, given=i)
        touched = torch.tensor([float(src.grad_sync.local_touched[i])], device=src.device)
        src.comm.all_reduce_max(touched)
        if not bool(touched.item()):  # no rank produced a grad for it: None, as param.grad in torch
            return None
        self.reduce(what)
        slot, bucket, buf, ranges = self._pieces(i)
        length = max(max(hi - lo, 0) for lo, hi in ranges)
        lo, hi = ranges[src.comm.shard_rank]
        shard = buf.grad_shard
        send = torch.zeros(length, dtype=shard.dtype, device=shard.device)
        if hi > lo:
            send[:hi - lo] = shard[lo - bucket.shard_start:hi - bucket.shard_start]
        gathered = src.comm.gather_shards(send, to_first=False)
        flat = torch.empty(slot.numel, dtype=torch.float32, device=shard.device)
        for r, (lo_r, hi_r) in enumerate(ranges):
            if hi_r > lo_r:
                flat[lo_r - slot.offset:hi_r - slot.offset] = gathered[r, :hi_r - lo_r]
        out = flat.mul_(self.factor()).to(src.params[i].dtype)
        return out.as_strided(slot.shape, slot.stride)  # memory order: the param's own strides

    def local_grad(self, p: Any) -> Optional[LocalGrad]:
        what = "local_grad"
        i = self.index(p, what)
        self.require(Action.READ, what)
        src = self.source()
        gs = src.grad_sync
        if not src.cycle.grad_since_zero:
            return None
        slot, bucket, buf, ranges = self._pieces(i)
        lo, hi = ranges[src.comm.shard_rank]
        if hi <= lo:
            return None
        self.require(Action.LOCAL_READ, what)  # no collective: refused while grads wait for their reduction
        gs.wait()  # in-flight reductions land (on the device's streams: no host sync)
        piece = buf.grad_shard[lo - bucket.shard_start:hi - bucket.shard_start]
        value = (piece.float() * self.factor()).to(p.dtype)
        return LocalGrad(value, lo - slot.offset, hi - slot.offset)
