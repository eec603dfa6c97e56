"""Hugging Face accelerate: ``ShardampAccelerator`` is a drop-in for ``accelerate.Accelerator``.

With a ``DistributedFusedAdam`` among the prepared optimizers:

* ``prepare`` does not wrap the model whose params it manages in DDP (it reduce-scatters the
  grads itself) but still applies device placement (a no-op: the model must already be on its
  device) and the mixed-precision autocast; the model must be prepared with (or before) the
  optimizer, else autocast and ``save_state``'s weights would silently not apply to it;
* ``mixed_precision="fp16"`` uses ``ShardedGradScaler``, and ``step_was_skipped`` reports its
  device-side skip (so a prepared LR scheduler skips with it, as accelerate does for torch),
  read on the host only when asked and once per step;
* ``clip_grad_norm_`` clips through ``shardamp.optim.clip_grad_norm_`` (inside the step kernel)
  and returns the true global norm; ``clip_grad_value_`` raises (the grads are sharded);
* ``no_sync``/``accumulate`` keep the grads local through ``opt.no_sync()``;
* ``save_state``/``load_state`` work unchanged: every rank takes part in the optimizer's
  collective ``state_dict``, and the model's weights go through safetensors.

Launching (``accelerate launch --config_file ...``): accelerate picks the launcher from the config's
``distributed_type``, and each process derives its own distributed type from the environment
(``LOCAL_RANK`` and the device; ``ACCELERATE_USE_FSDP`` / ``ACCELERATE_USE_DEEPSPEED`` / ...):

* ``MULTI_GPU`` (and ``MULTI_NPU``/``MULTI_XPU``/... for other devices) starts the ranks through
  torchrun; ``prepare`` would wrap the model in DDP, which is skipped here. With
  ``Accelerator(cpu=True)`` (or ``ACCELERATE_USE_CPU=true`` exported) the same launch runs on CPU
  ranks as ``MULTI_CPU`` over gloo. ``examples/accelerate_config.yaml`` is such a config;
* ``MULTI_CPU`` also wraps in DDP (skipped here), but its launcher starts several processes only
  through ``mpirun`` (``mpirun_hostfile``): without it, ``accelerate launch --cpu`` or
  ``use_cpu: true`` start ONE process;
* ``NO`` is one process: the optimizer shards over nothing. A ``MULTI_GPU`` launch where no GPU
  is visible (and ``cpu`` is not set) also gives ``NO`` in every rank, with a process group of
  all of them initialised: ``prepare`` refuses a ``DistributedFusedAdam`` spanning several ranks
  there (every rank would be the main process and see the whole dataset);
* ``FSDP``, ``DEEPSPEED``, ``MEGATRON_LM`` and ``XLA`` shard or replace the model and optimizer
  themselves: ``prepare`` refuses a ``DistributedFusedAdam`` there (as it refuses a
  ``parallelism_config`` that shards the model: ``dp_shard``, ``tp``, ``cp``, ``sp``), naming the
  setting to change.

A ``DistributedDataParallelKwargs`` passed in ``kwargs_handlers`` configures the DDP wrapper that a
``DistributedFusedAdam``'s model does not get: ``prepare`` raises rather than ignore it. The
handler the transformers Trainer always builds itself (from ``TrainingArguments.ddp_*``) is not
the user's: ``shardamp.integrations.transformers`` adopts the Trainer's ``Accelerator``, which
never went through ``ShardampAccelerator.__init__``, and declares its handler internal.

With any other optimizer it behaves exactly like ``Accelerator``.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Any, Iterable, Iterator, List, Optional, Set

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedDataParallelKwargs, DistributedType

from shardamp.optim import DistributedFusedAdam, clip_grad_norm_
from shardamp.scaler import ShardedGradScaler

from . import _step_logging as step_logging

__all__ = ["ShardampAccelerator"]


def _unwrap(optimizer: Any) -> Any:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _params(opt: DistributedFusedAdam) -> List[torch.nn.Parameter]:
    return [p for group in opt.param_groups for p in group["params"]]


# distributed types whose own engine shards or replaces the model and its optimizer
_OWN_ENGINE = {
    DistributedType.FSDP: "FullyShardedDataParallel (the FSDP plugin, ACCELERATE_USE_FSDP)",
    DistributedType.DEEPSPEED: "a DeepSpeed engine (the DeepSpeed plugin, ACCELERATE_USE_DEEPSPEED)",
    DistributedType.MEGATRON_LM: "Megatron-LM (the Megatron-LM plugin, ACCELERATE_USE_MEGATRON_LM)",
    DistributedType.XLA: "torch_xla's replicated model",
}


def _ddp_settings(handler: DistributedDataParallelKwargs) -> str:
    settings = handler.to_kwargs()
    return ", ".join(f"{k}={getattr(v, 'value', v)!r}" for k, v in settings.items()) or "defaults only"


class _ShardampAcceleratedOptimizer(AcceleratedOptimizer):
    """AcceleratedOptimizer whose ``step_was_skipped`` reads the ShardedGradScaler's verdict and,
    with ``skip_grad_norm_above``, the optimizer's own: the skip happens on the device inside
    ``step``, which accelerate would count as a step."""

    @property
    def step_was_skipped(self) -> bool:
        """The host read of the device-side verdict happens only here, lazily: the step itself
        never syncs. Without a scaler (fp32, bf16) there is nothing to read. With fp16 it is read
        when asked, at most once per step (cached per verdict tensor, which ``update`` replaces):
        by a prepared LR scheduler's ``step`` and ``Accelerator.optimizer_step_was_skipped`` (the
        Trainer asks both every step). It cannot be avoided there: torch's schedulers decide on
        the host whether to advance the lr; with torch's GradScaler that same loop syncs inside
        every ``scaler.step`` instead."""
        skipped = getattr(self.scaler, "last_step_skipped", None)
        if skipped is not None:
            cached = getattr(self, "_shardamp_skip_read", None)
            if cached is None or cached[0] is not skipped:
                cached = self._shardamp_skip_read = (skipped, bool(skipped))
            if cached[1]:
                return True
        opt = getattr(self, "optimizer", None)
        if isinstance(opt, DistributedFusedAdam) and opt.skip_grad_norm_above is not None:
            # the step may have been skipped for its norm (no overflow: the scaler saw none); read
            # only where the user asked for such skips (one host read each time asked)
            return bool(opt.last_step_skipped())
        return False


class ShardampAccelerator(Accelerator):
    """``accelerate.Accelerator`` that trains a ``DistributedFusedAdam`` correctly (see the
    module docstring).

    Args:
        *args: exactly ``Accelerator``'s.
        **kwargs: exactly ``Accelerator``'s. A ``DistributedDataParallelKwargs`` among
            ``kwargs_handlers`` is kept for models trained by other optimizers (which DDP
            wraps as usual) and refused by ``prepare`` for a ``DistributedFusedAdam``'s model.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the DDP handler passed HERE is the user's; an Accelerator built elsewhere (the Trainer's,
        # adopted by ShardampTrainerMixin) never runs this and has none recorded
        self._set_user_ddp_handler(self.ddp_handler)

    @classmethod
    def adopt(cls, accelerator: Accelerator, owner: str = "the caller") -> "ShardampAccelerator":
        """Make an ``Accelerator`` built elsewhere (e.g. the transformers Trainer's) a
        ``ShardampAccelerator`` in place: it keeps everything it was built with, and its DDP
        kwargs handler counts as internal (the user did not pass it; a ``DistributedFusedAdam``'s
        model is never DDP-wrapped). Local; no collective.

        Args:
            accelerator: a plain ``Accelerator`` (or already a ``ShardampAccelerator``).
            owner: who built it, for the error message.

        Returns:
            The same object, now a ``ShardampAccelerator``.

        Raises:
            TypeError: ``accelerator`` is of another ``Accelerator`` subclass (its class cannot
                be swapped safely): derive that class from ``ShardampAccelerator``.
        """
        if type(accelerator) is Accelerator:
            accelerator.__class__ = cls
        elif not isinstance(accelerator, cls):
            raise TypeError(
                f"{owner}: the trainer built a {type(accelerator).__name__}, which cannot become a "
                "ShardampAccelerator (it would wrap the model in DDP). Derive that accelerator class from "
                "shardamp.integrations.accelerate.ShardampAccelerator."
            )
        accelerator._set_user_ddp_handler(None)
        return accelerator

    def _set_user_ddp_handler(self, handler: Optional[DistributedDataParallelKwargs]) -> None:
        self._shardamp_user_ddp_handler = handler

    # ------------------------------------------------------------------ which params are ours
    def _shardamp_optimizers(self) -> List[DistributedFusedAdam]:
        opts = list(getattr(self, "_shardamp_pending", []))
        opts += [_unwrap(o) for o in self._optimizers if isinstance(_unwrap(o), DistributedFusedAdam)]
        return list({id(o): o for o in opts}.values())

    def _optimizers_of(self, params: Iterable[torch.Tensor]) -> List[DistributedFusedAdam]:
        ids: Set[int] = {id(p) for p in params}
        return [o for o in self._shardamp_optimizers() if any(id(p) in ids for p in _params(o))]

    def _plain_setup(self) -> bool:
        """FSDP, DeepSpeed, Megatron and XLA keep their own paths (``prepare`` refuses this
        optimizer there)."""
        return self.distributed_type not in _OWN_ENGINE

    def _check_setup(self, opts: List[DistributedFusedAdam]) -> None:
        """Raises ``ValueError`` where accelerate would shard or wrap a ``DistributedFusedAdam``'s
        model itself (a distributed type with its own engine, a ``parallelism_config`` that
        shards the model, a DDP kwargs handler the user passed), or runs its ranks as one
        process each."""
        ranks = max(opt.world_size for opt in opts)
        if self.distributed_type == DistributedType.NO and ranks > 1:
            # a MULTI_GPU launch where no GPU is visible and cpu is not set: accelerate's state
            # initialises the process group, then sees no backend and calls the process alone
            raise ValueError(
                f"ShardampAccelerator.prepare: accelerate runs this process as distributed_type=NO (num_processes=1, "
                f"every rank its main process, every rank the whole dataset), but the DistributedFusedAdam spans "
                f"{ranks} ranks of torch.distributed. This is what `accelerate launch` with a MULTI_GPU config gives "
                "where no GPU is visible: for CPU ranks build the accelerator with cpu=True (or export "
                "ACCELERATE_USE_CPU=true) so that each rank runs as MULTI_CPU; for GPUs make them visible."
            )
        engine = _OWN_ENGINE.get(self.distributed_type)
        if engine is not None:
            raise ValueError(
                f"ShardampAccelerator.prepare: distributed_type={self.distributed_type.value} trains through "
                f"{engine}, which takes over the model's grads and params that DistributedFusedAdam reduce-scatters "
                "and all-gathers itself. DistributedFusedAdam already shards the optimizer state (ZeRO-2) over "
                "plain data-parallel ranks: launch with distributed_type: MULTI_GPU (MULTI_CPU on CPUs, NO for one "
                "process; see examples/accelerate_config.yaml) and no FSDP/DeepSpeed/Megatron plugin (with the "
                "transformers Trainer: no TrainingArguments fsdp= / deepspeed=), or keep "
                f"{self.distributed_type.value} with a torch optimizer."
            )
        config = getattr(self, "parallelism_config", None)
        if config is not None:
            sharded = [f"{dim}_size={getattr(config, dim + '_size')}" for dim in ("dp_shard", "tp", "cp", "sp")
                       if getattr(config, dim + "_size", 1) > 1]
            if sharded:
                raise ValueError(
                    f"ShardampAccelerator.prepare: parallelism_config has {', '.join(sharded)}: accelerate shards "
                    "or splits the model across ranks (FSDP2 / tensor / context / sequence parallel), which "
                    "DistributedFusedAdam does not train. Use data parallelism only (parallelism_config=None, or "
                    "only dp_replicate_size): DistributedFusedAdam shards the optimizer state over those ranks."
                )
        self._check_ddp_handler()

    def _check_ddp_handler(self) -> None:
        handler = getattr(self, "_shardamp_user_ddp_handler", None)
        if handler is not None:
            raise ValueError(
                "ShardampAccelerator(kwargs_handlers=[DistributedDataParallelKwargs("
                f"{_ddp_settings(handler)})]): the model a DistributedFusedAdam trains is not wrapped in "
                "DistributedDataParallel (the optimizer reduce-scatters its grads itself), so these DDP settings "
                "would be silently ignored. Remove the DistributedDataParallelKwargs handler and configure the grad "
                "sync on the optimizer: DistributedFusedAdam(bucket_cap_mb=..., overlap_grad_sync=..., "
                "grad_sync_dtype=...). Params that get no grad need no find_unused_parameters."
            )

    # ------------------------------------------------------------------ prepare
    def log(self, values: Dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """``Accelerator.log`` to the trackers; with trackers set, the prepared
        DistributedFusedAdams' ``grad_norm``, ``loss_scale`` and ``skipped_steps`` join ``values``
        (the caller's values win on a name clash; one host read per call).

        Args:
            values: as ``Accelerator.log``.
            *args: as ``Accelerator.log``.
            **kwargs: as ``Accelerator.log``.
        """
        if getattr(self, "trackers", None):
            extra = step_logging.step_values(getattr(self, "_optimizers", []))
            values = {**extra, **values}
        return super().log(values, *args, **kwargs)

    def prepare(self, *args: Any, device_placement: Optional[List[bool]] = None) -> Any:
        """``Accelerator.prepare``, with a ``DistributedFusedAdam``'s model left without DDP.

        Args:
            *args: as ``Accelerator.prepare``.
            device_placement: as ``Accelerator.prepare``.

        Returns:
            The prepared objects, as ``Accelerator.prepare``.

        Raises:
            ValueError: with a ``DistributedFusedAdam`` among ``args``, before anything is
                prepared: under FSDP / DeepSpeed / Megatron-LM / XLA, a model-sharding
                ``parallelism_config``, a ``DistributedDataParallelKwargs`` handler passed to
                this accelerator, or distributed type ``NO`` while the optimizer spans several
                ranks; after preparing: its model was not prepared with or before it.
        """
        # the model comes before its optimizer in prepare's first pass: announce the optimizer
        pending = [_unwrap(a) for a in args if isinstance(_unwrap(a), DistributedFusedAdam)]
        if pending:
            self._check_setup(pending)  # before anything is prepared
        self._shardamp_pending = pending
        try:
            result = super().prepare(*args, device_placement=device_placement)
        finally:
            self._shardamp_pending = []
        for opt in pending:
            self._check_model_prepared(opt)
        return result

    def _check_model_prepared(self, opt: DistributedFusedAdam) -> None:
        ids = {id(p) for m in self._models for p in m.parameters()}
        if not any(id(p) in ids for p in _params(opt)):
            raise ValueError(
                "ShardampAccelerator.prepare: the model whose params this DistributedFusedAdam "
                "manages was not prepared. Pass it to prepare() together with (or before) the "
                "optimizer, e.g. accelerator.prepare(model, optimizer, dataloader): otherwise "
                "mixed-precision autocast silently does not apply to it and save_state saves no "
                "weights for it."
            )

    def prepare_model(self, model: torch.nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """``Accelerator.prepare_model``; a ``DistributedFusedAdam``'s model gets everything but
        the DDP wrapper.

        Args:
            model: as ``Accelerator.prepare_model``.
            device_placement: as ``Accelerator.prepare_model``.
            evaluation_mode: as ``Accelerator.prepare_model``.

        Returns:
            The prepared model (not DDP-wrapped when a ``DistributedFusedAdam`` manages its params).

        Raises:
            ValueError: a ``DistributedDataParallelKwargs`` handler passed to this accelerator,
                for a ``DistributedFusedAdam``'s model.
        """
        if not evaluation_mode and self._plain_setup() and self._optimizers_of(model.parameters()):
            self._check_ddp_handler()
            # evaluation_mode=True is prepare_model minus the distributed wrapper (DDP, for
            # MULTI_CPU and every MULTI_<device>): device placement, autocast and torch.compile
            # still apply
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> Any:
        """``Accelerator.prepare_optimizer``; a ``DistributedFusedAdam`` keeps its state where it
        is, and a torch ``GradScaler`` becomes a ``ShardedGradScaler`` with the same settings.

        Args:
            optimizer: as ``Accelerator.prepare_optimizer``.
            device_placement: as ``Accelerator.prepare_optimizer``.

        Returns:
            The ``AcceleratedOptimizer``.

        Raises:
            ValueError: a ``DistributedFusedAdam`` in a setup ``prepare`` refuses.
        """
        opt = _unwrap(optimizer)
        if not isinstance(opt, DistributedFusedAdam) or getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        self._check_setup([opt])
        if self.scaler is not None and not isinstance(self.scaler, ShardedGradScaler):
            old = self.scaler
            self.scaler = ShardedGradScaler(  # the same settings, agreeing on found-inf over ranks
                self.device.type, init_scale=old.get_scale(), growth_factor=old.get_growth_factor(),
                backoff_factor=old.get_backoff_factor(), growth_interval=old.get_growth_interval(),
                enabled=old.is_enabled(),
            )
            for prepared in self._optimizers:
                if prepared.scaler is old:
                    prepared.scaler = self.scaler
        # no device placement: its state already lives with the params (and placing it would be
        # a state_dict round trip, a collective)
        prepared = super().prepare_optimizer(optimizer, device_placement=False)
        prepared.__class__ = _ShardampAcceleratedOptimizer  # adds a property (and its cached read)
        return prepared

    # ------------------------------------------------------------------ clipping, accumulation
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Unscale, then clip through ``shardamp.optim.clip_grad_norm_``: a ``DistributedFusedAdam``'s
        params are clipped inside its step kernel, and the returned norm is the true global norm.
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not (self._plain_setup() and self._optimizers_of(params)):
            return super().clip_grad_norm_(params, max_norm, norm_type)
        self.unscale_gradients()
        return clip_grad_norm_(params, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """``Accelerator.clip_grad_value_`` for other params.

        Raises:
            ValueError: the params belong to a ``DistributedFusedAdam`` (their grads are sharded:
                clip by norm instead).
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if self._optimizers_of(params):
            raise ValueError(
                "clip_grad_value_ with DistributedFusedAdam: its grads live in reduce-scattered "
                "shards (param.grad is None) and cannot be clipped by value; use clip_grad_norm_."
            )
        return super().clip_grad_value_(params, clip_value)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Accumulate locally: the ``no_sync()`` of every ``DistributedFusedAdam`` over ``model``'s
        params (accelerate's own for other models).
        """
        opts = self._optimizers_of(model.parameters())
        if not opts:
            with super().no_sync(model):
                yield
            return
        with contextlib.ExitStack() as stack:
            for opt in opts:
                stack.enter_context(opt.no_sync())
            yield
