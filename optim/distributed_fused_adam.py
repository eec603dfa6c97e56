"""DistributedFusedAdam: ZeRO-2 Adam/AdamW whose unscale, clip and step agree with unsharded torch.

This file is the optimizer's constructor and its step protocol's entry points; a third of it is the class's
documentation (every constructor argument, the extension points), which the API reference is built from. Its
reading methods are in reads.py, its communication methods in sync/optimizer_sync.py, the hooks
ShardedGradScaler calls in step/torch_scaler.py. The step's phase:
step/cycle.py (its values: step/step_round.py); slices: layout.py; buffers: shards/; backward and the all-gather:
sync/; collectives: comm/; the one all-reduce: step/grad_stats.py; ranks that disagree: checks/; norms: norms.py;
the step's math: kernels/; where the state lives: offload.py.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .checks import agreement
from .step import torch_scaler, grad_stats
from .step.cycle import Action, StepCycle
from .step.torch_scaler import ScalerHooks
from . import _compat, kernels, param_tags
from .comm.collectives import Comm, make_comm
from .shards.buffers import (BucketBuffers, ShardGrads, adam_launches, allocate_all, check_remainders, check_views,
                             reattach_param)
from .checks.misuse import check_setup
from .step.grad_stats import HEADER, GradStats, TouchedPatterns
from .step.health import StepHealth, check_skip_above
from .shards.view import ShardView
from .step.step_round import StepRound
from .sync.grad_sync import GradSync
from .sync.merged_landings import held_bucket_bound
from .checks.deferred import DeferredChecks
from .hparams import (NO_COPY, NO_KEY, HparamTable, check_hparams, check_new_group, check_max_norm, check_norm_type,
                      check_options, clip_invalid, plain_key, tensor_lrs)
from .layout import ALIGN, Bucket, build_layout, forward_order, grouped_params, params_device
from .sync.param_sync import ParamSync
from .sync.optimizer_sync import OptimizerSync
from . import torch_tools
from .grads_view import GradSource, GradsView
from .reads import OptimizerReads
from .state_formats import resolve_moments
from .offload import resolve_offload
from .shards.host_state import HostState


class DistributedFusedAdam(OptimizerReads, OptimizerSync, ScalerHooks, torch.optim.Optimizer):
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
            host-bound on GPUs. At one process on CUDA (neither capturable, offloaded nor with a
            blockwise moment) a bucket of 16 MB or more also holds at most 128 params
            (``HELD_SEGMENTS``: its grads are then read where autograd left them).
        overlap_grad_sync: reduce-scatter each bucket during backward as soon as it is complete
            (``False``: at ``grad_sync()`` / ``step``).
        overlap_param_sync: leave the all-gathers in flight after ``step``; each module waits
            for its own params in a forward pre-hook. Call ``param_sync()`` before reading params
            elsewhere, or ``attach(model)`` to guard every read in the model's forward.
        capturable: no host syncs and static buffers, so that the whole iteration can be
            captured in a CUDA graph (``lr`` then a device tensor).
        exp_avg_dtype: storage of ``exp_avg``: ``torch.float32`` or ``torch.bfloat16`` (default
            ``dtype``; read as fp32 by the step, written back rounded to nearest even), or
            ``"8bit"`` / ``"4bit"`` (codes plus one fp32 absmax scale per block, requantized per
            block by the step; docs/low-bit-states.md); CUDA params need the compiled CUDA
            kernels with the blockwise step (``SHARDAMP_KERNELS=reference``: the reference math)
            unless every bucket's state is offloaded (the CPU kernels step it).
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
        quant_block_size: elements per block of the blockwise moments, one value for both;
            None: each format's default (256 for ``"8bit"``, 128 for ``"4bit"``). A positive
            multiple of 16; only with a blockwise moment.
        offload: ``"cpu"``: the owned fp32 master and moments in host memory, stepped on the CPU (docs/offload.md).
        offload_fraction: with ``offload``, the share of the state on the host (0 to 1, default 1.0), whole buckets.

    Raises:
        ValueError: an invalid hyperparameter or option (naming it and the fix), params on
            several devices or on the meta device, a param given twice, or storage options that
            do not fit the params' dtypes, or ``offload`` options that do not fit them, or on CUDA a
            ``quant_block_size`` over the blockwise kernel's tile (where some bucket's state stays on the GPU).
        NotImplementedError: ``"8bit"`` / ``"4bit"`` moments over CUDA params where the loaded CUDA
            kernels lack the blockwise step (none built, or built before it); never for CPU params,
            nor with every bucket's state offloaded to the host.
        RuntimeError: the model is wrapped in ``DistributedDataParallel`` (the optimizer reduces the grads itself),
            ``WORLD_SIZE > 1`` without a process group, the ranks built different optimizers (raised on every rank,
            naming the field and each rank's value), or ``offload`` finds too little host memory or cannot pin it.

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
    # takes groups with a "param_names" list beside "params" (and named_parameters()), keeps them
    # in state dicts and names them in last_nonfinite(): the transformers integration passes them
    accepts_param_names = True

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
        exp_avg_dtype: Optional[Union[torch.dtype, str]] = None,
        exp_avg_sq_dtype: Optional[Union[torch.dtype, str]] = None,
        store_param_remainders: bool = False,
        skip_grad_norm_above: Optional[float] = None,
        quant_block_size: Optional[int] = None,
        offload: Optional[str] = None,
        offload_fraction: Optional[float] = None,
    ) -> None:
        check_hparams(lr, betas, eps, weight_decay, "")
        self._skip_above = check_skip_above(skip_grad_norm_above)  # fixed: a captured graph holds it
        check_options(
            dict(adam_w_mode=adam_w_mode, bias_correction=bias_correction, average_grad_sync=average_grad_sync,
                 overlap_grad_sync=overlap_grad_sync, overlap_param_sync=overlap_param_sync, capturable=capturable,
                 store_param_remainders=store_param_remainders),
            max_grad_norm, dtype, grad_sync_dtype, param_sync_dtype, bucket_cap_mb,
        )
        self._formats = resolve_moments(dtype, exp_avg_dtype, exp_avg_sq_dtype, quant_block_size)  # state_formats.py
        self._offload = resolve_offload(offload, offload_fraction, store_param_remainders, capturable)  # offload.py

        self._initialized = False
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        # before torch's __init__ wraps step: torch's wrapper only where something observes it (_compat.py)
        _compat.hook_optimizer_step(type(self), "_step_observer")
        super().__init__(params, defaults)

        self.adam_w_mode, self.bias_correction, self.max_grad_norm = adam_w_mode, bias_correction, max_grad_norm
        self.average_grad_sync, self.dtype, self.capturable = average_grad_sync, dtype, capturable
        self.overlap_grad_sync, self.overlap_param_sync = overlap_grad_sync, overlap_param_sync
        self.bucket_cap_mb = float(bucket_cap_mb)

        check_setup(self.param_groups, explicit_group=process_group is not None or device_mesh is not None)
        indexed = grouped_params(self.param_groups)  # (param, group index), in param_groups order
        self._params: List[torch.nn.Parameter] = [p for p, _ in indexed]
        self._device = params_device(self._params)
        self._on_cuda = self._device.type == "cuda"  # asked every step: a device's .type makes a new string
        kernels.backend(self._device)  # any kernel build (minutes) before the first collective, not inside its timeout
        self._comm: Comm = make_comm(process_group, device_mesh, self._device)
        self.process_group = self._comm.group  # the group of every rank the optimizer spans
        self.device_mesh = device_mesh
        self.world_size, self.rank = self._comm.world_size, self._comm.rank
        self.grad_sync_dtype, self.param_sync_dtype = grad_sync_dtype, param_sync_dtype
        self.exp_avg_dtype, self.exp_avg_sq_dtype = self._formats.attribute_values()
        if store_param_remainders:
            check_remainders(dtype, param_sync_dtype, [p.dtype for p in self._params])
        self.store_param_remainders = store_param_remainders
        self._buckets: List[Bucket] = build_layout(
            indexed, self.bucket_cap_mb, self._comm.shard_size, self._comm.shard_rank, self._formats.grid(ALIGN),
            *held_bucket_bound(self._comm, capturable, overlap_grad_sync, self._offload.offload is not None,
                               self._formats, [grad_sync_dtype or p.dtype for p in self._params],
                               [p.dtype for p in self._params], self._device))
        self._host = HostState(self._offload, self._buckets, self._device, self._formats, dtype, grad_sync_dtype,
                               param_sync_dtype, self._comm, len(self._params))  # where the state lives: shards/host_state.py
        # the formats against where each bucket's state lives (an offloaded one takes the CPU kernels)
        native = kernels.native_module(self._device)
        kernels.check_formats(self._formats, self._host.state_devices(), native)
        # the step wrapper's question (_compat.hook_optimizer_step): does anything record the step's
        # label? Found once: the device's compiled module does not change
        self._step_observer = getattr(native, "record_function_observed", None)
        if self._host.active and self._device.type != "cpu":  # the CPU kernels step the offloaded buckets: any
            kernels.backend(torch.device("cpu"))  # build of theirs before the first collective, as the device's
        # before anything is allocated or communicated: every rank built the same optimizer
        agreement.agree_on_construction(self._comm, self._device, agreement.describe(
            self._params, self.param_groups, agreement.construction_options(self), self.bucket_cap_mb, self._comm,
            self._buckets, self._device, self._formats, self._host.agreed()))
        self._host.allocate(self._comm)  # host memory checked and pinned, agreed by every rank, before the device's
        # allocated, broadcast from rank 0 (as DDP does) and the masters initialised: a collective
        self._buffers: List[BucketBuffers] = allocate_all(
            self._buckets, self._params, self._comm, dtype, grad_sync_dtype, param_sync_dtype, self._formats,
            store_param_remainders, self._host.by_bucket())
        # chunk tables on the device, and the one prepare launch per step for every bucket's segments
        self._records = kernels.prepare(
            [b.segments for b in self._buckets], [b.shard_numel for b in self._buckets], self._device, len(self._params),
            len(self.param_groups), [kernels.light_state(b.master, b.exp_avg, b.exp_avg_sq, b.grad_dtype) for b in self._buffers])
        self._launches: Optional[List[kernels.AdamLaunch]] = None  # each bucket's step, built at the first step
        self._shard_grads = ShardGrads(self._buffers)  # every bucket's grad shard, read when indexed
        self._order = forward_order(len(self._buckets))
        self._view_refs = [p.detach() for p in self._params]  # what check_views compares with
        self._view_check = kernels.view_check(self._view_refs)
        # all per-step health state: skip reasons, counters, non-finite flags, per-group norms
        self._health = StepHealth(self._device, self._comm, self._buckets, self.param_groups, self._skip_above,
                                  capturable, fp16_grads=any(b.grad_dtype == torch.float16 for b in self._buffers))
        self._avg_tensor = torch.full((), self._avg_factor, dtype=torch.float32, device=self._device)
        # the step's phase and every per-step counter (step/cycle.py)
        self._cycle = StepCycle(self._avg_factor, self._avg_tensor)
        self._grad_sync = GradSync(self._buckets, self._buffers, self._params, self._comm, overlap_grad_sync,
                                   keep_buffers=capturable, native_hooks=not capturable, cycle=self._cycle,
                                   check_landed=self._health.check_landed, landing_flags=self._health.landing_flags,
                                   landing_rows=self._health.landing_rows, host=self._host)
        self._param_sync = ParamSync(self._buckets, self._buffers, self._params, self._comm, overlap_param_sync)
        self._comm.context = self._cycle.position  # named when the ranks' collectives do not line up
        n = len(self._params)
        self._steps = torch.zeros(n, dtype=torch.float32, device=self._device)  # per param, as torch
        self._hparam_table = HparamTable(len(self.param_groups), self._device)
        self._shard_view = ShardView(self._buckets, self._buffers, self._steps, self._params, self._device,
                                     self._comm, self._hparam_table, self._cycle.clips_of_last_step, self._formats)
        self._coef = torch.empty((), dtype=torch.float32, device=self._device)  # the step's grad coefficient
        # what the per-step agreement reads (checks/agreement.py): nothing it may write
        self._step_view = agreement.step_view(weakref.ref(self), self._comm, self._cycle, self._device, TouchedPatterns(
            self._device), local_touched=functools.partial(getattr, self._grad_sync, "local_touched"))
        self._deferred = DeferredChecks(self._device, self._cycle, self._health)
        # reading the grads as torch would hold them (grads_view.py): what it needs, held here
        self._grad_source = GradSource(self._params, self._buckets, self._buffers, self._comm, self._device,
                                       self._grad_sync, self._cycle, self._coef)
        self._grads_view = GradsView(self, self._grad_source)
        self._cycle.set_fold(self._grads_view.fold_pending)  # grads reused: what param.grad showed
        # last, once nothing can fail (a construction that raises leaves the params with the
        # optimizer that had them): the grad hooks go on and the params' grads are this optimizer's
        self._grad_sync.take_over(self._params)
        for p in self._params:
            param_tags.manage(p, self)  # lets clip_grad_norm_ find us
        # param.grad and torch's clip functions see them (torch_tools.py); the params take the class
        # that shows them while this optimizer holds grads, their own otherwise
        self._cycle.on_grads_held(torch_tools.install(self, self._params, self._grads_view.owner_token).show)
        self._initialized = True

    # ------------------------------------------------------------------ setup helpers
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Register a param group while the optimizer is being built (``torch.optim.Optimizer``'s
        ``__init__`` calls it per group; validated here). The flat-buffer layout is fixed at
        construction: pass every group to the constructor. Local (no collective, no host sync).

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
        check_new_group(self.param_groups[-1], len(self.param_groups) - 1)

    # ------------------------------------------------------------------ per-step state (step/cycle.py)
    def _current_round(self) -> StepRound:
        """This step's round (the step cycle's)."""
        return self._cycle.current()

    def _add_clip(self, max_norm: float | Tensor, norm: Tensor) -> None:
        """Clip this step to ``max_norm`` given ``norm`` (resolved at the step)."""
        self._current_round().add_clip(max_norm, norm)

    @property
    def _avg_factor(self) -> float:
        return 1.0 / self.world_size if self.average_grad_sync else 1.0

    # ------------------------------------------------------------------ communication: sync/optimizer_sync.py
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the grads (``set_to_none=False``: zeros, so the next step still updates every param that had one)."""
        self._cycle.dropping()  # counted first: a wait in zero() that times out names it
        self._grad_sync.zero(set_to_none)
        self._cycle.grads_dropped(set_to_none)  # the last step's norms stay readable until the next backward
        self._health.grads_dropped()
        self._grads_view.dropped()
        self._grad_sync.prearm()  # last: it starts the next round's flags (health.landing_flags)

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

    def _ensure_stats(self, norm_type: float, key: Any = NO_KEY, defer: bool = False,
                      capturing: Optional[bool] = None) -> Union[GradStats, grad_stats.StatsPlan]:
        """This step's reduced stats (GradStats), made at the first call (``key``: the groups'
        plain_key, where the caller computed it); ``defer`` (the step, before any stats): where one
        process would finish them, the plan instead, for the step's one call (``StatsPlan.step``).
        ``capturing``: whether a CUDA graph is being captured, where the caller asked already."""
        r = self._cycle.current()
        if r.stats is not None:
            if norm_type not in r.raw_norms:
                shards, reduce = self._shard_grads, self._reduce_grad_stats
                r.add_norm_type(norm_type, grad_stats.reduce_norm(norm_type, shards, self._device, reduce))
            return r.stats
        if self._deferred.pending is not None:  # the last step's flags, where not read yet (CUDA)
            self._deferred.check_last_step(force=True, capturing=capturing)
        self.grad_sync()
        # A bad value on one rank must not raise before the all-reduce (the others would wait in
        # it): it is flagged in the entries, and every rank raises after it.
        problem = self._hparam_table.validate(self.param_groups, key)
        # backward passes of two threads at once over optimizers of this group (sync/backward_order.py)
        problem = problem or self._grad_sync.refusal
        # the agreement entries ride in the same all-reduce (agreement.py): no extra collective
        # read once: the entries and the table take it (a plain key: every lr a number, none to read)
        r.lrs = None if isinstance(key, tuple) else tensor_lrs(self.param_groups, self._device)
        shards = self._shard_grads
        reduce = self._reduce_grad_stats
        if (not self._comm.has_peers
                and getattr(reduce, "__func__", None) is DistributedFusedAdam._reduce_grad_stats):
            reduce = None  # one process and no subclass reduction: nothing between assembly and finish
        reduced = grad_stats.reduce_step_stats(
            norm_type, shards, self._buckets, len(self._params), self._health, self._step_view, problem, r.lrs,
            self._grad_sync.landed_stats, reduce, defer)
        if isinstance(reduced, grad_stats.StatsPlan):
            self._cycle.reduced("", reduced.names)  # nothing compared: no problem (the table is refreshed)
            return reduced
        r.set_stats(reduced.stats)
        self._cycle.reduced(problem, reduced.names)
        if reduced.checked and self._device.type != "cuda":  # reading is free here: raise before anything trains
            self._deferred.check_now(r.stats)
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
        norm_type = check_norm_type(norm_type)
        last = self._cycle.last_norm(norm_type)  # after step: that step's, if it computed norm_type (the gate)
        if last is not None:
            return last
        self._ensure_stats(norm_type)
        return self._current_round().norm(norm_type)

    def clip_grad_norm(self, max_norm: float | Tensor, norm_type: float = 2.0) -> Tensor:
        """Clip all grads to a global norm of ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``.

        Returns the norm before clipping (see :meth:`grad_norm` for its scale). No pass over
        the grads happens here: the coefficient ``min(1, max_norm / (norm + 1e-6))`` is resolved
        on the device at ``step``, with the true scale, and applied inside the step kernel. A
        non-finite norm skips the step instead of producing NaN params.
        """
        max_norm = check_max_norm(max_norm, self._comm.has_peers)  # a CUDA tensor: checked at step
        self._cycle.reuse_stepped()  # after step() without backward: the norm of what that step left
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
        self._cycle.reuse_stepped()  # a second step's unscale: of the grads that step left, as torch
        self._cycle.require(Action.UNSCALE)  # also warns once of a clip made before it (while scaled)
        r = self._current_round()
        inv = inv_scale.detach()
        if inv.dim() != 0 or inv.device != self._device or inv.dtype != torch.float32:
            inv = inv.reshape(()).to(device=self._device, dtype=torch.float32)
        stats = self._ensure_stats(r.first_norm_type())
        # a loss scale of 0, inf or NaN (underflow, new_scale=0) would make NaN or ascending
        # params: such a step is skipped as any non-finite step is
        # (three launches: found + 0 * log(inv) is NaN unless 0 < inv < inf, and NaN != 0)
        stats.found_inf.add_(inv.log(), alpha=0.0).ne_(0.0)
        self._cycle.unscaled(inv)  # norms handed out before unscaling become the true norms
        return stats.found_inf.to(inv_scale.device)

    # ------------------------------------------------------------------ the step
    @_compat.grad_disabled
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scaler: Optional[Any] = None) -> Any:
        """Update the params from the reduced grads; skip on the device if any grad (or the
        norm) is not finite. With ``grad_scaler`` (torch.amp.GradScaler's hand-over), unscale by
        its scale and record the global found-inf in it so ``update()`` agrees on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._host.refuse_capture()  # an offloaded step reads the host: no CUDA graph captures it (host_state.py)
        if self._param_sync.pending:  # overlap_param_sync's all-gathers of the last step
            self._param_sync.wait()
        check_views(self._params, self._view_refs, self._reattach, self._view_check)
        self._cycle.require(Action.STEP)
        self._cycle.reuse_stepped()  # a second step without backward steps on what the first left, as torch
        if grad_scaler is not None:
            self._health.note_scaler(grad_scaler)  # step_stats() reports its scale
            torch_scaler.take_over(grad_scaler, self, self._cycle, self.unscale_grads)
        r = self._cycle.current()
        key = plain_key(self.param_groups)  # once for the validation and the table: nothing runs between
        # asked once for the step's three readers of it (a query is microseconds on a GPU host)
        capturing = self._on_cuda and _compat.cuda_capturing()
        # nothing asked for the stats before the step (no clip, no unscale): the step finishes them
        gathers = self._param_sync.gathers
        stats = self._ensure_stats(r.first_norm_type(), key, defer=self.max_grad_norm is None
                                   and not gathers and not self._host.active, capturing=capturing)
        planned = isinstance(stats, grad_stats.StatsPlan)
        # invalid values were folded into the stats (every rank skips this step, on CUDA they
        # raise at the next one): the last valid table is kept
        table = self._hparam_table
        hparams = table.table if self._cycle.problem else table.refresh(self.param_groups, r.lrs, key)
        if self.max_grad_norm is not None:
            r.add_clip(self.max_grad_norm, self.grad_norm(2.0))
        coef, health = self._coef, self._health
        max_norms = [c for c, _ in r.clips] if r.clips else []
        bad_clip = clip_invalid(max_norms) if max_norms else None  # a CUDA tensor max_norm, checked here
        record_host = self._deferred.record_target(None if planned else stats, bad_clip, health.record,
                                                   capturing)  # no copy
        # built at the first step (the state buffers persist), again after load_state_dict changed an option
        launches = self._launches = adam_launches(self._buffers, self._buckets, self._records.offsets, self._steps,
                                                  coef, self.adam_w_mode, self.bias_correction, self._launches)
        step_args = functools.partial(health.step_args, inv_scale=r.inv_scale, avg=self._avg_factor,
                                      record_host=record_host)
        # first layers first, each all-gather after its bucket's kernel (none: one shard rank); offload: host_state.py
        stats = grad_stats.launch_step(stats, bad_clip, self._host.launch_step, step_args, coef, r.coef_parts(),
                                       self._steps, launches, self._order, self._shard_grads, hparams, self._records,
                                       self.bias_correction, self._param_sync.launch if gathers else None)
        if planned:  # the step's one native call finished them
            r.set_stats(stats)
        self._param_sync.launched_all()
        health.stepped(r.inv_scale)
        self._deferred.record_step(stats, bad_clip, capturing)
        # its norms stay readable, unscaled lazily; graph replays rewrite the raw norms: no cache
        self._cycle.stepped(max_norms, r.raw_norms, cache_after_step=not self.capturable)
        self._grad_sync.step_done()
        return loss

    def _reattach(self, index: int) -> bool:
        slot = self._grad_sync.slots[index]
        return reattach_param(self._buffers[slot.bucket], slot, self._params[index], self._device)

    def __deepcopy__(self, memo: Optional[dict] = None) -> Any:
        raise TypeError(NO_COPY)

    __getstate__ = __deepcopy__  # a pickle as well as a deepcopy would train a detached copy
