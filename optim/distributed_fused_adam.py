"""DistributedFusedAdam: ZeRO-2 Adam/AdamW whose unscale, clip and step agree with unsharded torch.

State and protocol (one step's: step_round.py); slices: layout.py; buffers: buffers.py; collectives:
comm.py, used by grad_sync.py / param_sync.py; the one all-reduce: grad_stats.py; norms: norms.py;
the step's math: reference.py / csrc (through kernels.py).
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .checks import agreement, deferred as deferred_checks
from .step import torch_scaler, grad_stats
from . import kernels, norms
from .kernels import partials
from .checkpoint import state_dict as _state_dict
from .comm.collectives import Comm, make_comm
from .shards.buffers import (BucketBuffers, allocate, check_moment_dtypes, check_remainders, check_views, init_master,
                             memory_stats, reattach_param)
from .checks.misuse import check_launcher_env, ddp_error, find_ddp
from .step.grad_stats import HEADER, GradStats, TouchedPatterns
from .step.health import StepHealth, check_skip_above
from .shards.view import ShardView
from .step.step_round import StepRound
from .sync.grad_sync import GradSync
from .checks.deferred import DeferredChecks
from .hparams import (NO_COPY, HparamTable, check_group_options, check_hparams, check_max_norm, check_norm_type,
                      check_options, clip_invalid, tensor_lrs, validate_groups)
from .layout import Bucket, build_layout, forward_order
from .sync.param_sync import ParamSync
from .sync.stale_read_guard import StaleReadGuard
from . import torch_tools
from .grads_view import GradsView, LocalGrad

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DistributedFusedAdam(torch.optim.Optimizer):
    """ZeRO-2 sharded Adam/AdamW with fused, scaler-aware unscale, clip and step.

    Every rank keeps the fp32 master params, ``exp_avg`` and ``exp_avg_sq`` of one contiguous
    shard of every bucket. Grads are reduce-scattered during backward (hooks on the grad
    accumulators, fixed bucket order; autograd's grad field stays empty, and ``param.grad`` shows a
    read-only ``ShardedGrad`` view of the reduced shards that torch's norms, clip and
    ``GradScaler.unscale_`` read: optim/torch_tools.py), and ``step`` updates the
    local shard with one fused kernel per bucket, then all-gathers the params in place. Training
    matches unsharded ``torch.optim.AdamW`` (``adam_w_mode=True``) or ``Adam`` (``False``) fed the
    union of all ranks' batches.

    Build it after the model is on its final device and dtype: the params become views into the
    optimizer's flat buffers, and replacing their storage afterwards is detected at the next
    ``step``. Construction is a collective when there are peers (every rank of the group builds
    the same optimizer; one all-gather compares them, and the params are broadcast from rank 0).

    ``params`` may be ``model.named_parameters()`` (or groups of ``(name, param)`` pairs), as for
    torch's optimizers: each group then has ``param_names``, kept in state dicts, and the names
    appear in ``last_nonfinite()`` and the ``shardamp`` logger's messages.

    Step health (optim/step/health.py): ``last_nonfinite()`` (which rank's grads of which param
    held inf/NaN before the reduction), ``grad_norms_by_group()``, ``step_stats()``; the
    ``logging.getLogger("shardamp")`` logger reports skipped steps and loss-scale back-offs once
    per burst, where the step's flags are read on the host anyway.

    Args:
        params: the params to train, or dicts defining param groups (``lr``, ``betas``, ``eps``,
            ``weight_decay`` per group), as for ``torch.optim.AdamW``. Every param that will
            ever train must be here and require grad; all on one device.
        lr: learning rate; a float, or a one-element tensor (on the params' device for
            ``capturable``: an LR scheduler writing that tensor reaches CUDA-graph replays).
        betas: coefficients of the running averages of the grad and its square.
        eps: added to the denominator.
        weight_decay: decoupled weight decay with ``adam_w_mode=True`` (default 0.0; torch's
            AdamW defaults to 0.01), an L2 term added to the grad with ``False``.
        adam_w_mode: ``True``: AdamW; ``False``: Adam with L2 regularisation.
        bias_correction: apply Adam's bias corrections (torch always does).
        max_grad_norm: clip the global grad norm to this value at every step, inside the step
            kernel, with the true (unscaled) norm; ``None``: no clipping here (``clip_grad_norm``,
            ``shardamp.optim.clip_grad_norm_`` and ``torch.nn.utils.clip_grad_norm_`` still clip).
        process_group: the group the state is sharded over; default the WORLD group, or no
            communication at all when ``torch.distributed`` is not initialised.
        device_mesh: instead of ``process_group``, not with it: a 1-D ``DeviceMesh`` shards over
            its ranks as a group does; a 2-D ``(replicate, shard)`` mesh shards over its last
            dim and keeps one copy of the state per replica (grads reduce-scattered over the
            shard dim and the shard all-reduced over the replicate dim, params all-gathered over
            the shard dim, norm and found-inf agreed over all ranks).
        average_grad_sync: average the grads over ALL ranks (``True``) or sum them.
        dtype: the master params' and moments' dtype (``torch.float32``).
        grad_sync_dtype: the dtype grads are reduce-scattered in; default the param dtype.
        param_sync_dtype: the dtype params are all-gathered in; default the param dtype.
        bucket_cap_mb: the size of a flat bucket, in MB; below ~100 MB, backward becomes
            host-bound on GPUs.
        overlap_grad_sync: reduce-scatter each bucket during backward as soon as it is complete
            (``False``: at ``grad_sync()`` / ``step``).
        overlap_param_sync: leave the all-gathers in flight after ``step``; each module waits
            for its own params in a forward pre-hook. Call ``param_sync()`` before reading params
            elsewhere, or ``attach(model)`` to guard every read in the model's forward.
        capturable: no host syncs and static buffers, so that the whole iteration can be
            captured in a CUDA graph (``lr`` then a device tensor).
        exp_avg_dtype: storage dtype of ``exp_avg``, ``torch.float32`` or ``torch.bfloat16``
            (default ``dtype``); read as fp32 by the step, written back rounded to nearest even.
        exp_avg_sq_dtype: the same for ``exp_avg_sq``.
        store_param_remainders: bf16 params with an fp32 master (``dtype=torch.float32``):
            keep only the low 16 bits of each master, whose high 16 bits are the bf16 param
            itself. Updates are bitwise those of a separate fp32 master; the bf16 params are the
            master rounded to nearest with ties away from zero.
        skip_grad_norm_above: a finite float > 0, or None: skip, on every rank, a step whose
            global grad norm (unscaled, before clipping, in the step's norm type: 2 unless the
            first norm asked for that step was another) exceeds it; decided on the device from
            the one stats all-reduce (no host sync, capturable). A spike is not an overflow: a
            scaler does not back off for it and, as torch.amp.GradScaler counts every step
            without an overflow, it counts toward the scaler's growth interval;
            ``step_stats()`` counts such steps apart (``skipped_spike``).

    Raises:
        ValueError: an invalid hyperparameter or option (naming it and the fix), params on
            several devices or on the meta device, a param given twice, or storage options that
            do not fit the params' dtypes.
        RuntimeError: the model is wrapped in ``DistributedDataParallel`` (the optimizer
            reduces the grads itself), ``WORLD_SIZE > 1`` without a process group, or the ranks
            built different optimizers (raised on every rank, naming the field and each rank's
            value).

    Extension points for subclasses (e.g. NeMo-style wrappers):

    * ``_step_supports_amp_scaling = False``: ShardedGradScaler then unscales through
      ``unscale_grads`` and skips overflowing steps through torch's ordinary path (one
      ``.item()``) instead of calling ``step`` and letting the kernel skip on the device;
    * ``_reduce_grad_stats(stats, op)``: the one all-reduce of the per-step stats; override to
      also reduce ``stats[:2]`` over a model-parallel group;
    * ``step(closure=None, *, grad_scaler=None)``: an override must keep ``grad_scaler`` as an
      explicit keyword (torch.amp.GradScaler looks for it) and call ``super().step``;
    * ``unscale_grads(inv_scale, grad_scaler=None)``: receives the scaler, e.g. to read its
      state; an override returns ``super()``'s found-inf (0-d float, exactly 0.0 or 1.0).
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adam_w_mode: bool = True,
        bias_correction: bool = True,
        max_grad_norm: Optional[float] = None,
        process_group: Optional[Any] = None,
        device_mesh: Optional[Any] = None,
        average_grad_sync: bool = True,
        dtype: torch.dtype = torch.float32,
        grad_sync_dtype: Optional[torch.dtype] = None,
        param_sync_dtype: Optional[torch.dtype] = None,
        bucket_cap_mb: float = 100.0,
        overlap_grad_sync: bool = True,
        overlap_param_sync: bool = False,
        capturable: bool = False,
        exp_avg_dtype: Optional[torch.dtype] = None,
        exp_avg_sq_dtype: Optional[torch.dtype] = None,
        store_param_remainders: bool = False,
        skip_grad_norm_above: Optional[float] = None,
    ) -> None:
        check_hparams(lr, betas, eps, weight_decay, "")
        self._skip_above = check_skip_above(skip_grad_norm_above)  # fixed: a captured graph holds it
        check_options(
            dict(adam_w_mode=adam_w_mode, bias_correction=bias_correction, average_grad_sync=average_grad_sync,
                 overlap_grad_sync=overlap_grad_sync, overlap_param_sync=overlap_param_sync, capturable=capturable,
                 store_param_remainders=store_param_remainders),
            max_grad_norm, dtype, grad_sync_dtype, param_sync_dtype, bucket_cap_mb,
        )
        exp_avg_dtype, exp_avg_sq_dtype = check_moment_dtypes(dtype, exp_avg_dtype, exp_avg_sq_dtype)

        self._initialized = False
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

        self.adam_w_mode = adam_w_mode
        self.bias_correction = bias_correction
        self.max_grad_norm = max_grad_norm
        self.average_grad_sync = average_grad_sync
        self.dtype = dtype
        self.capturable = capturable
        self.overlap_grad_sync = overlap_grad_sync
        self.overlap_param_sync = overlap_param_sync
        self.bucket_cap_mb = float(bucket_cap_mb)

        if process_group is None and device_mesh is None and not (dist.is_available() and dist.is_initialized()):
            check_launcher_env()
        if dist.is_available() and dist.is_initialized():
            ddp = find_ddp(p for group in self.param_groups for p in group["params"])
            if ddp is not None:
                raise ddp_error(ddp)
        self._params: List[torch.nn.Parameter] = []
        indexed: List[Tuple[torch.nn.Parameter, int]] = []
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._params.append(p)
                indexed.append((p, g))
                p._shardamp_optimizer = weakref.ref(self)  # lets clip_grad_norm_ find us
        devices = {p.device for p in self._params}
        if len(devices) != 1:
            raise ValueError(f"params: all parameters must be on one device, got {sorted(map(str, devices))}")
        self._device = devices.pop()
        if self._device.type == "meta":
            raise ValueError("params: parameters are on the meta device; materialise the model first")
        kernels.backend(self._device)  # any kernel build (minutes) before the first collective, not inside its timeout
        self._comm: Comm = make_comm(process_group, device_mesh, self._device)
        self.process_group = self._comm.group  # the group of every rank the optimizer spans
        self.device_mesh = device_mesh
        self.world_size, self.rank = self._comm.world_size, self._comm.rank
        for i, p in enumerate(self._params):
            if not p.is_floating_point() or p.dtype not in _FLOAT_DTYPES + (torch.float64,):
                raise ValueError(f"params: parameter {i} has dtype {p.dtype}; expected a floating-point dtype")
        self.grad_sync_dtype = grad_sync_dtype
        self.param_sync_dtype = param_sync_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        if store_param_remainders:
            check_remainders(dtype, param_sync_dtype, [p.dtype for p in self._params])
        self.store_param_remainders = store_param_remainders

        self._buckets: List[Bucket] = build_layout(
            indexed, self.bucket_cap_mb, self._comm.shard_size, self._comm.shard_rank)
        # before anything is allocated or communicated: every rank built the same optimizer
        agreement.agree_on_construction(self)
        self._buffers: List[BucketBuffers] = []
        for bucket in self._buckets:
            gdt = grad_sync_dtype or bucket.dtype
            pdt = param_sync_dtype or bucket.dtype
            self._buffers.append(
                allocate(bucket, self._params, self._comm.gathers_params, dtype, gdt, pdt, exp_avg_dtype, exp_avg_sq_dtype))
        for buf in self._buffers:  # every rank starts from rank 0's weights, as DDP does
            self._comm.broadcast(buf.params)
        for buf in self._buffers:
            init_master(buf, dtype, store_param_remainders)
        # chunk tables on the device, and the one prepare launch per step for every bucket's segments
        self._records = kernels.prepare(
            [b.segments for b in self._buckets], [b.shard_numel for b in self._buckets], self._device, len(self._params),
            len(self.param_groups), [kernels.light_state(b.master, b.exp_avg, b.exp_avg_sq, b.grad_dtype) for b in self._buffers])
        self._launches: Optional[List[kernels.AdamLaunch]] = None  # each bucket's step, built at the first step
        self._view_refs = [p.detach() for p in self._params]  # what check_views compares with
        self._view_check = kernels.view_check(self._view_refs)
        # all per-step health state: skip reasons, counters, non-finite flags, per-group norms
        self._health = StepHealth(self._device, self._comm, self._buckets, self.param_groups, self._skip_above,
                                  capturable,
                                  fp16_grads=any(b.grad_dtype == torch.float16 for b in self._buffers))
        self._grad_sync = GradSync(self._buckets, self._buffers, self._params, self._comm, overlap_grad_sync,
                                   keep_buffers=capturable, native_hooks=not capturable,
                                   check_landed=self._health.check_landed)
        self._param_sync = ParamSync(
            self._buckets, self._buffers, self._params, self._comm, overlap_param_sync)
        agreement.track_position(self)  # named in the error when the ranks' collectives do not line up
        n = len(self._params)
        self._steps = torch.zeros(n, dtype=torch.float32, device=self._device)  # per param, as torch
        self._hparam_table = HparamTable(len(self.param_groups), self._device)
        self._shard_view = ShardView(self._buckets, self._buffers, self._steps, self._params, self._device,
                                     self._comm, self._hparam_table)
        self._touched_patterns = TouchedPatterns(self._device)
        self._avg_tensor = torch.full((), self._avg_factor, dtype=torch.float32, device=self._device)
        self._coef = torch.empty((), dtype=torch.float32, device=self._device)  # the step's grad coefficient
        self._fingerprint = agreement.StepFingerprint(self.world_size, self._device)
        self._deferred = DeferredChecks(self._device)
        self._step_problem = ""  # this rank's invalid hyperparameter this step, if any
        self._step_names: List[str] = []
        self._warned_clip_before_unscale = False
        self._warned_unscaled_by_torch = False
        self._round: Optional[StepRound] = None  # this step's protocol (step_round.py)
        self._round_backwards = 0  # GradSync.backwards when it started
        self._last: Optional[StepRound] = None  # the last step's, readable until the next backward
        self._grads_view = GradsView(self)  # reading the grads as torch would hold them (grads_view.py)
        torch_tools.install(self)  # param.grad and torch's clip functions see them (torch_tools.py)
        self._initialized = True

    # ------------------------------------------------------------------ setup helpers
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Register a param group; only possible while the optimizer is being built.

        ``torch.optim.Optimizer.__init__`` calls this once per group of ``params``; each group's
        hyperparameters and options are validated here. The flat-buffer layout is fixed at
        construction, so a group cannot be added later: pass every group to the constructor.
        Local (no collective, no host sync).

        Args:
            param_group: a dict with ``params`` (``torch.nn.Parameter`` leaves) and optionally
                ``lr``, ``betas``, ``eps``, ``weight_decay`` (the constructor's defaults fill in
                the rest).

        Raises:
            RuntimeError: called after construction.
            ValueError: an invalid hyperparameter or group option, a plain tensor instead of a
                ``Parameter``, or a param given twice.
        """
        if getattr(self, "_initialized", False):
            raise RuntimeError(
                "DistributedFusedAdam.add_param_group: the flat-buffer layout is fixed at "
                "construction; pass every param group to the constructor"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"param_groups[{len(self.param_groups) - 1}]: "
        check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"], where)
        check_group_options(group, where)
        seen: Dict[int, int] = {}
        for i, p in enumerate(group["params"]):
            if not isinstance(p, torch.nn.Parameter):
                raise ValueError("params: DistributedFusedAdam needs torch.nn.Parameter leaves (got a plain tensor)")
            if id(p) in seen:  # torch only warns, then updates it twice per step
                raise ValueError(f"{where}params: parameter {i} (shape {tuple(p.shape)}) is parameter {seen[id(p)]} "
                                 "given again; pass each parameter once")
            seen[id(p)] = i

    # ------------------------------------------------------------------ per-step state
    def _current_round(self) -> StepRound:
        """This step's round. The first grad after a step (a new backward) starts a new one and
        forgets the last step's norms; zero_grad starts a new one but keeps them."""
        backwards = self._grad_sync.backwards
        if backwards != self._round_backwards:
            self._round_backwards, self._round, self._last = backwards, None, None
        if self._round is None:
            self._round = StepRound(self._avg_factor, self._avg_tensor)
        return self._round

    @property
    def _inv_scale(self) -> Optional[Tensor]:
        """This step's inverse scale, if the scale is known yet (deferred_checks reads it)."""
        return self._current_round().inv_scale

    def _add_clip(self, max_norm: float | Tensor, norm: Tensor, recompute: Optional[Callable[[], Any]] = None) -> None:
        """Clip this step to ``max_norm`` given ``norm`` (clip.py: a norm over several
        optimizers, ``recompute`` refreshing it in place when this one unscales)."""
        self._current_round().add_clip(max_norm, norm, recompute)

    @property
    def _avg_factor(self) -> float:
        return 1.0 / self.world_size if self.average_grad_sync else 1.0

    # ------------------------------------------------------------------ communication
    def grad_sync(self) -> None:
        """Finish reducing the grads: launch the buckets not yet launched, wait for all."""
        self._grad_sync.sync()

    def param_sync(self) -> None:
        """Wait for the params' all-gather (only ever pending with ``overlap_param_sync``)."""
        self._param_sync.wait()

    def attach(self, model: torch.nn.Module) -> StaleReadGuard:
        """With ``overlap_param_sync``: make every param read during ``model``'s forward current,
        also where no module hook sees it (the root's forward body reading a child's weight, a
        helper, a borrowed weight), and land all in-flight all-gathers when the forward returns.
        Returns a handle whose ``remove()`` detaches. Without ``overlap_param_sync`` nothing is
        ever in flight after ``step`` and this changes nothing."""
        return StaleReadGuard(self._param_sync, model)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As DDP's ``no_sync``: backward inside accumulates grads locally; the first backward
        outside reduces everything accumulated."""
        with self._grad_sync.no_sync():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the grads. ``set_to_none=False`` keeps them as zeros, so the next step still
        updates (weight decay, momentum) every param that had a grad, as torch does."""
        agreement.dropping(self)
        self._grad_sync.zero(set_to_none)
        self._health.grads_dropped()
        self._grads_view.dropped()
        self._round = None  # the last step's norms stay readable (grad_norm) until the next backward

    # ------------------------------------------------------------------ reading the grads (grads_view.py)
    def full_grad(self, p: torch.nn.Parameter) -> Optional[Tensor]:
        """What ``p.grad`` would hold in the same unsharded torch loop at this point, on every rank
        (as DeepSpeed's ``safe_get_full_grad``).

        A COLLECTIVE: every rank calls it, for the same param, at the same point (an agreement
        all-reduce checks that; then a MAX all-reduce, the reduction of any pending grads
        (``grad_sync``) and an all-gather over the shard dim of at most ``min(p.numel(), shard
        size)`` elements per rank). SYNCS THE HOST (it reads whether any rank produced a grad).

        Args:
            p: a param of this optimizer.

        Returns:
            A new tensor with ``p``'s shape, dtype and strides (its memory order: a channels_last
            weight's grad is channels_last), holding the reduced grad averaged over the ranks as
            ``average_grad_sync`` says; still multiplied by the loss scale before ``unscale_``
            (ShardedGradScaler's or torch.amp.GradScaler's), unscaled after; times the coefficients
            of the clips recorded so far; after ``step`` (until ``zero_grad``) the grads times the
            coefficient that step used. ``None`` when no rank produced a grad for ``p`` since
            ``zero_grad(set_to_none=True)``, as ``p.grad`` in torch.

        Raises:
            ValueError: ``p`` is not a param of this optimizer.
            RuntimeError: called inside ``no_sync()``, where the accumulated grads are not reduced
                (call it after the backward that reduces, or call ``grad_sync()`` on every rank
                outside ``no_sync`` first); or the ranks did not all call it for the same param.
        """
        return self._grads_view.full_grad(p)

    def local_grad(self, p: torch.nn.Parameter) -> Optional[LocalGrad]:
        """This rank's slice of ``p``'s reduced grad. NOT a collective; no host sync.

        Args:
            p: a param of this optimizer.

        Returns:
            ``LocalGrad(tensor, start, end)``: ``tensor`` (1-D, ``p``'s dtype, a new tensor) holds
            elements ``[start, end)`` of ``full_grad(p)`` in ``p``'s memory order (the order of
            ``torch.empty_like(p)``'s storage), with the same values (averaged, scaled before
            ``unscale_``, clipped as recorded so far). ``None`` where this rank's shard holds
            none of ``p``, or when this optimizer holds no grads (no backward since
            ``zero_grad(set_to_none=True)``) on this rank.

        Raises:
            ValueError: ``p`` is not a param of this optimizer.
            RuntimeError: called inside ``no_sync()``, or while this rank holds grads not reduced
                yet (``overlap_grad_sync=False`` before ``step``, or after a ``no_sync`` backward):
                call ``grad_sync()`` on every rank first.
        """
        return self._grads_view.local_grad(p)

    # ------------------------------------------------------------------ stats, unscale, clip
    def _reduce_grad_stats(self, stats: Tensor, op: Any) -> None:
        """Extension point: all-reduce this rank's partial grad stats in place.

        ``stats`` is float32 ``[norm_partial, nonfinite, touched_0 .. touched_{P-1}, health
        entries, agreement entries...]`` (health.py: ranks whose own grads held inf/NaN, then,
        with several param groups, each group's norm partial; ``agreement.py``: what the ranks
        must agree on this step) and ``op`` is SUM (finite norm types) or MAX (``inf``); reduce
        all of it. The default reduces over the optimizer's process group. A subclass whose
        params are also split over another group (tensor or pipeline model parallelism) calls
        ``super()`` and then reduces ``stats[:2]`` over that group with the same ``op``, so the
        norm and found-inf cover the whole model (and, for ``grad_norms_by_group`` with G > 1
        groups, the group partials ``stats[P + 3 : P + 3 + G]``).
        """
        groups = self._health.group_slice(HEADER + len(self._params)) if stats.numel() > HEADER else None
        self._comm.all_reduce_stats(stats, op, groups)

    def _ensure_stats(self, norm_type: float) -> GradStats:
        r = self._current_round()
        if r.stats is None:
            deferred_checks.check_last_step(self, force=True)
            self.grad_sync()
            # A bad value on one rank must not raise before the all-reduce (the others would wait in
            # it): it is flagged in the entries, and every rank raises after it.
            self._step_problem = validate_groups(self.param_groups, read_lr=self._device.type != "cuda")
            # backward passes of two threads at once over optimizers of this group (sync/backward_order.py)
            self._step_problem = self._step_problem or self._grad_sync.refusal
            # the agreement entries ride in the same all-reduce (agreement.py): no extra collective
            r.lrs = tensor_lrs(self.param_groups, self._device)  # read once: the entries and the table take it
            health = self._health
            buf, checked = agreement.stats_buffer(self, norm_type, self._step_problem, r.lrs, health.entries())
            if not (norm_type == 2.0 and self._grad_sync.landed_stats(buf)):
                partials.partial([b.grad_shard for b in self._buffers], norm_type, buf, zeroed=True)
            offset = HEADER + len(self._params)  # where the health entries start
            groups = health.group_slice(offset)
            if groups is not None:  # each group's partial too (one launch per bucket), for grad_norms_by_group
                for bucket, b in zip(self._buckets, self._buffers):
                    kernels.group_partials(b.grad_shard, bucket.segments, buf[groups], norm_type, len(self._params))
            self._reduce_grad_stats(buf, norms.reduce_op(norm_type))
            fingerprint = self._fingerprint if checked else None
            r.set_stats(grad_stats.finish(buf, norm_type, len(self._params), fingerprint, health.n_entries))
            health.note_stats(buf, offset, norm_type)
            if checked and self._device.type != "cuda":  # reading is free here: raise before anything trains
                deferred_checks.check_now(self, r.stats)
        elif norm_type not in r.raw_norms:
            # a second norm type in one step costs a second (tiny) all-reduce, as extensible as the first
            buf = partials.partial([b.grad_shard for b in self._buffers], norm_type, device=self._device)
            self._reduce_grad_stats(buf, norms.reduce_op(norm_type))
            r.add_norm_type(norm_type, norms.root(buf[0], norm_type))
        return r.stats

    def grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """The global norm of all grads, as ``torch.nn.utils.clip_grad_norm_`` would return it.

        Averaged over the group as the grads are, and unscaled as far as the scale is known:
        after ``unscale_grads`` (ShardedGradScaler.unscale_) it is the true norm; called before
        it while the loss is scaled, it is the scaled norm and the SAME tensor is divided by the
        scale in place when unscaling happens (at the latest inside ``step``). Cached until the
        next backward; after ``step`` (also after ``zero_grad``) it returns the UNSCALED norm
        that step used, from the cache: no collective, so one rank alone may read it (rank-zero
        logging). 0-d float32 tensor on the params' device; never reads a value on the host.
        """
        norm_type = self._check_norm_type(norm_type)
        r = self._current_round()
        if r.stats is None and self._last is not None:
            return self._last.norm_after_step(norm_type)
        self._ensure_stats(norm_type)
        return r.norm(norm_type)

    _check_norm_type = staticmethod(check_norm_type)

    def clip_grad_norm(self, max_norm: float | Tensor, norm_type: float = 2.0) -> Tensor:
        """Clip all grads to a global norm of ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``.

        Returns the norm before clipping (see :meth:`grad_norm` for its scale). No pass over
        the grads happens here: the coefficient ``min(1, max_norm / (norm + 1e-6))`` is resolved
        on the device at ``step``, with the true scale, and applied inside the step kernel. A
        non-finite norm skips the step instead of producing NaN params.
        """
        max_norm = check_max_norm(max_norm, self._comm.has_peers)  # a CUDA tensor: checked at step
        norm = self.grad_norm(norm_type)
        self._add_clip(max_norm, norm)
        return norm

    def unscale_grads(self, inv_scale: Tensor, grad_scaler: Optional[Any] = None) -> Tensor:
        """Record ``inv_scale`` (0-d tensor) for this step and return the GLOBAL found-inf.

        Used by ``ShardedGradScaler.unscale_``. Nothing is rewritten: ``inv_scale`` becomes part
        of the device scalar the step kernel multiplies the grads by. The result is a 0-d
        float32 tensor on ``inv_scale``'s device holding exactly 0.0 or 1.0, agreed by every rank
        (inf/NaN in any grad, or a non-finite norm). ``grad_scaler`` is passed through for
        subclasses.
        """
        if not isinstance(inv_scale, Tensor) or inv_scale.numel() != 1:
            raise ValueError("inv_scale: expected a one-element tensor (1 / scale)")
        r = self._current_round()
        if r.inv_scale is not None:
            raise RuntimeError("unscale_grads() has already been called since the last step()")
        inv = inv_scale.detach()
        if inv.dim() != 0 or inv.device != self._device or inv.dtype != torch.float32:
            inv = inv.reshape(()).to(device=self._device, dtype=torch.float32)
        stats = self._ensure_stats(r.first_norm_type())
        # a loss scale of 0, inf or NaN (underflow, new_scale=0) would make NaN or ascending
        # params: such a step is skipped as any non-finite step is
        # (three launches: found + 0 * log(inv) is NaN unless 0 < inv < inf, and NaN != 0)
        stats.found_inf.add_(inv.log(), alpha=0.0).ne_(0.0)
        if r.clips and not self._warned_clip_before_unscale:
            self._warned_clip_before_unscale = True
            warnings.warn(
                "DistributedFusedAdam: clip_grad_norm ran before unscaling, while the loss was scaled. Its "
                "max_norm is compared with the TRUE (unscaled) norm once the scale is known, so torch's idiom "
                "clip_grad_norm_(params, max_norm * scaler.get_scale()) would never clip here: pass the plain, "
                "unscaled max_norm (or clip after scaler.unscale_(opt)).",
                UserWarning, stacklevel=3,
            )
        r.unscale(inv)  # norms handed out before unscaling become the true norms
        return stats.found_inf.to(inv_scale.device)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scaler: Optional[Any] = None) -> Any:
        """Update the params from the reduced grads; skip on the device if any grad (or the
        norm) is not finite. With ``grad_scaler`` (torch.amp.GradScaler's hand-over), unscale by
        its scale and record the global found-inf in it so ``update()`` agrees on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._param_sync.wait()
        check_views(self._params, self._view_refs, self._reattach, self._view_check)
        if not self._grad_sync.grad_since_zero:
            raise RuntimeError(
                "DistributedFusedAdam.step(): no parameter of this optimizer received a gradient on "
                "this rank since the last zero_grad(). Either backward() did not run, or the model's "
                "parameters were replaced (load_state_dict(assign=True), deepcopy, re-created modules) "
                "and the optimizer no longer sees them: build the optimizer over the model's current "
                "parameters."
            )
        if grad_scaler is not None:
            torch_scaler.take_over(self, grad_scaler)
        r = self._current_round()
        stats = self._ensure_stats(r.first_norm_type())
        # invalid values were folded into the stats (every rank skips this step, on CUDA they
        # raise at the next one): the last valid table is kept
        hparams = self._hparam_table.table if self._step_problem else self._hparam_table.refresh(self.param_groups, r.lrs)
        if self.max_grad_norm is not None:
            r.add_clip(self.max_grad_norm, self.grad_norm(2.0))
        found_inf, coef = stats.found_inf, self._coef
        bad_clip = clip_invalid([c for c, _ in r.clips])  # a CUDA tensor max_norm, checked here
        found_inf = found_inf if bad_clip is None else torch.maximum(found_inf, bad_clip)
        # one launch: the grad coefficient (avg * inv_scale * clip), the step's skip (found-inf or a
        # norm spike), the step counts and the health counters
        health = self._health
        kernels.step_scalars(coef, *r.coef_parts(), found_inf, self._steps, stats.touched,
                             health.step_args(stats.raw_norm, r.inv_scale, self._avg_factor))
        skip = health.skip  # what the step kernels skip on
        records = self._records.compute(hparams, self._steps, stats.touched, coef, skip, self.bias_correction)
        launches = self._adam_launches(hparams, stats.touched, coef, skip)
        for i in forward_order(len(self._buckets)):  # the first layers' params land first
            launch = launches[i]
            launch.grad, launch.hparams, launch.records = self._buffers[i].grad_shard, hparams, records
            launch.touched, launch.found_inf = stats.touched, skip
            kernels.launch_adam(launch)
            self._param_sync.launch(i)
        self._param_sync.launched_all()
        health.stepped(r.inv_scale)
        deferred_checks.record_step(self, stats, bad_clip)
        r.cache_after_step = not self.capturable  # graph replays rewrite its raw norms
        agreement.stepped(self, [c for c, _ in r.clips], r.raw_norms)
        r.done()
        self._last, self._round = r, None  # its norms are unscaled lazily: no work here
        self._grad_sync.step_done()
        return loss

    def _adam_launches(self, hparams: Tensor, touched: Tensor, coef: Tensor, found_inf: Tensor) -> List[Any]:
        """Each bucket's step launch, built at the first step: the state buffers persist (a param
        re-attached after a broken view keeps them); the grad shard and the step's flags are
        assigned at every step."""
        if self._launches is None:
            self._launches = [
                kernels.AdamLaunch(buf.grad_shard, buf.master, buf.exp_avg, buf.exp_avg_sq, buf.model_out(),
                                   bucket.segments, hparams, self._steps, touched, coef, found_inf, self.adam_w_mode,
                                   self.bias_correction, None, self._records.offsets[i])
                for i, (buf, bucket) in enumerate(zip(self._buffers, self._buckets))]
        return self._launches

    # ------------------------------------------------------------------ step health (optim/step/health.py)
    @property
    def skip_grad_norm_above(self) -> Optional[float]:
        """The constructor's ``skip_grad_norm_above`` (None: no step is skipped for its norm)."""
        return None if math.isinf(self._skip_above) else self._skip_above

    def last_nonfinite(self) -> List[Tuple[int, str]]:
        """Where the last step's gradients overflowed: the sorted ``(rank, param_name)`` pairs
        whose gradient held an inf or NaN on that rank BEFORE the reduction.

        ``rank`` is the global rank; ``param_name`` the name given with ``named_parameters()``,
        else ``"group {g}, param {i}, shape (...)"`` (``i`` counted within the group). Empty for
        a step that was not skipped for non-finite grads (a finite step, a spike), and empty when
        the inf/NaN arose only in the reduction (an fp16 sum overflowing), the norm, or an
        invalid loss scale: ``step_stats()["skipped_nonfinite"]`` (or the scaler's found-inf)
        counted the step but this list is empty.

        Returns:
            list of ``(int, str)``, the same on every rank.

        Collective / host sync: none where the report is ready, which it is once the step's
        flags have been read on the host (at once on the CPU; on CUDA from the next step's
        first ``unscale_``/``clip_grad_norm``/``grad_norm``/``step`` on; after a step a
        ``_step_supports_amp_scaling = False`` scaler skipped): the ranks' flags were then
        all-gathered there. Asked earlier (CUDA right after ``step``; CUDA graphs, whose replays
        read nothing back; world 1 with a scaler), it reads the device (a host sync) and, if
        some rank's own grads held inf/NaN in a skipped step, all-gathers the ranks' flags: a
        collective, so then call it on every rank.
        """
        return self._health.last_nonfinite()

    def grad_norms_by_group(self) -> Tensor:
        """Each param group's global grad norm, from the step's one stats all-reduce.

        Returns:
            1-D float32 tensor on the params' device, one entry per param group: unscaled (as
            far as the scale is known, as :meth:`grad_norm`), before clipping, averaged as the
            grads are, in the norm type of the step's stats (2 unless the first norm asked for
            the step was another, e.g. ``clip_grad_norm(norm_type=inf)``). After ``step`` (and
            ``zero_grad``): that step's norms, until the next stats.

        Collective: before the step's stats exist (after backward, before any norm, unscale or
        step) this computes them: the step's one all-reduce, so every rank calls it then.
        Never reads a value on the host.

        Raises:
            RuntimeError: no step and no backward yet (nothing to report).
        """
        r = self._current_round()
        if r.stats is None and self._last is not None:
            return self._health.group_norms(True, self._avg_factor, None)
        self._ensure_stats(r.first_norm_type())
        return self._health.group_norms(False, self._avg_factor, r.inv_scale)

    def step_stats(self) -> Dict[str, Any]:
        """Counters of the steps so far, every key always present:

        * ``steps``: updates applied; ``skipped_steps``: ``skipped_spike + skipped_nonfinite``;
        * ``skipped_spike``: skipped for a norm above ``skip_grad_norm_above``;
        * ``skipped_nonfinite``: skipped for inf/NaN grads, a non-finite norm or loss scale (also
          skips the device made on invalid values or ranks that disagree, which raise);
        * ``consecutive_skips``: skipped steps in a row up to the last one;
        * ``last_grad_norm``: the last step's global norm (unscaled, before clipping, the step's
          norm type; inf/NaN for an overflow), None before the first step;
        * ``loss_scale``: the scale of the scaler driving this optimizer after its last update
          (ShardedGradScaler, or torch.amp.GradScaler handing itself to ``step``), None without one.

        Returns:
            dict of int / float / None.

        Host sync: ONE host read of the device counters (and the scale), when called; nothing
        is read per step. Not a collective (the counters are the same on every rank).
        """
        return self._health.stats()

    def _note_scaler(self, scaler: Any) -> None:
        """A scaler unscales (or steps) this optimizer: ``step_stats()`` reports its scale."""
        self._health.note_scaler(scaler)

    def _note_step_skipped_by_scaler(self) -> None:
        """A scaler skipped this round's ``step`` on the host (``_step_supports_amp_scaling =
        False``: torch's path read found-inf): the health counts the skip as a found-inf step and
        reports it (every rank: the scaler's found-inf is agreed)."""
        r = self._round
        if r is None or r.stats is None:
            return
        self._health.host_skipped(r.norm(r.first_norm_type()), r.inv_scale)

    def _reattach(self, index: int) -> bool:
        slot = self._grad_sync.slots[index]
        return reattach_param(self._buffers[slot.bucket], slot, self._params[index], self._device)

    # ------------------------------------------------------------------ state dicts (optim/checkpoint/state_dict.py)
    def state_dict(self, *, rank0_only: bool = False, cpu_offload: bool = True) -> Optional[Dict[str, Any]]:
        """The optimizer's full state, world-size independent, in ``torch.optim.AdamW``'s layout.

        ``state[i]`` holds ``step``, ``exp_avg`` and ``exp_avg_sq`` shaped like param ``i``
        (plus ``master_param`` where the model dtype differs from the state dtype), and
        ``param_groups`` uses torch's keys, so the dict loads into ``torch.optim.AdamW`` / ``Adam``
        and into a DistributedFusedAdam at any world size and bucket size.

        A collective: every rank of the process group calls it, at the same point. It starts
        with one small all-reduce that checks the ranks are in the same call with the same
        arguments (and that the last step clipped alike on every rank), then gathers each
        bucket's shards (an all-gather, or a gather to rank 0 with ``rank0_only``). It waits
        for pending param all-gathers, and syncs the host: the step counts and, with
        ``cpu_offload``, every tensor are copied to the CPU.

        Args:
            rank0_only: only the group's rank 0 receives the dict; the others get ``None`` and
                never hold more than one bucket's gather buffer.
            cpu_offload: return CPU tensors (default); ``False`` keeps them on the params'
                device.

        Returns:
            The state dict, or ``None`` on the ranks other than 0 with ``rank0_only``.

        Raises:
            RuntimeError: the ranks called different collectives, or the others never joined
                (after ``SHARDAMP_COLLECTIVE_TIMEOUT`` on gloo, else the group's timeout), or the
                last step clipped on some ranks only; nothing is read.
            ValueError: the ranks passed different arguments.
        """
        return _state_dict.gather_state_dict(self, rank0_only=rank0_only, cpu_offload=cpu_offload)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full state dict (ours, or ``torch.optim.AdamW`` / ``Adam``'s over the same
        params) into this rank's shard, at any world size and bucket layout.

        Master params come from ``master_param`` entries when present, otherwise from the
        model's current params: load the model's weights first (``load_state_dict(assign=False)``,
        so they land in the optimizer's buffers). Params without a state entry restart from step 0
        with zero moments, as in torch. Moments are converted to their storage dtype (fp32 into
        bf16 moments rounds to nearest even).

        A collective: every rank calls it with the same dict. Everything is validated on every
        rank before anything is written, and one small all-reduce carries the verdict and a
        summary of each rank's dict, so a problem on any rank raises on every rank and leaves
        every optimizer untouched. Validation reads the dict's values on the host (a host sync
        when the dict holds device tensors).

        Args:
            state_dict: the full dict every rank loads.

        Raises:
            ValueError: the dict is malformed, does not fit the params (count, shapes), holds
                invalid values (negative ``exp_avg_sq``, a NaN lr, meta tensors), or the ranks
                were given different dicts; nothing is written.
            RuntimeError: the ranks called different collectives, or the others never joined.
        """
        _state_dict.load_state_dict(self, state_dict)

    def shard_view(self) -> ShardView:
        """This rank's shard and layout, for state-dict and checkpoint code (shard_view.py)."""
        return self._shard_view

    def memory_stats(self) -> Dict[str, int]:
        """Bytes this rank's optimizer holds, by kind (model params excluded): ``master`` (0
        where the master IS the param shard, 2 B/element as int16 remainders), ``moments``
        (exp_avg + exp_avg_sq, 4 B/element each in fp32, 2 in bf16),
        ``grad_shards`` (reduced grads), ``grad_buckets`` (full-size bucket buffers alive now:
        with ``capturable`` all of them, else at most the ones in flight), ``param_sync`` (the
        lower-precision all-gather buffers), and ``total``."""
        return memory_stats(self._buffers, self._grad_sync.alive_full_buffers())

    def __deepcopy__(self, memo: dict) -> "DistributedFusedAdam":
        raise TypeError(NO_COPY)

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError(NO_COPY)

    def __repr__(self) -> str:
        lines = [
            f"{type(self).__name__} (",
            f"  world_size={self.world_size}, rank={self.rank}, buckets={len(self._buckets)}, "
            f"adam_w_mode={self.adam_w_mode}, max_grad_norm={self.max_grad_norm}, dtype={self.dtype}, "
            f"capturable={self.capturable}, skip_grad_norm_above={self.skip_grad_norm_above}, "
            f"kernels={kernels.backend(self._device)}",
        ]
        for i, group in enumerate(self.param_groups):
            keys = ", ".join(f"{k}={group[k]}" for k in sorted(group) if k not in ("params", "param_names"))
            lines.append(f"  group {i}: {len(group['params'])} params, {keys}")
        lines.append(")")
        return "\n".join(lines)
