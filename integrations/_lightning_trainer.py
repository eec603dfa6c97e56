"""The Trainer strategy's logic, for ``lightning.pytorch`` and ``pytorch_lightning`` alike: mixins
that each package's module combines with that package's ``DDPStrategy``, and ``trainer_plugins``,
which builds the package's precision plugins and monitor callback from its base classes
(``shardamp.integrations.lightning`` / ``shardamp.integrations.pytorch_lightning``). Imports no
Lightning package.
"""
from __future__ import annotations

import contextlib
import os
import types
from datetime import timedelta
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

import torch
from torch.distributed.constants import default_pg_timeout

from shardamp.optim import DistributedFusedAdam, clip_grad_norm_

from . import _lightning_common as common
from . import _step_logging as step_logging
from . import _sharded_checkpoint as shards


class ClipThroughOptimizer:
    """Precision-plugin mixin: norm clipping that reaches a DistributedFusedAdam's shards, and
    16-mixed unscaling before ``on_before_optimizer_step`` also for it.

    Lightning's AMP plugin neither unscales nor clips optimizers that unscale inside ``step``
    (fused torch optimizers); ShardedGradScaler unscales a DistributedFusedAdam without a pass
    over the grads (it records ``1/scale`` for the step kernel), so here it is unscaled where
    Lightning unscales any other optimizer: hooks, ``opt.grad_norm()`` and clipping see the true
    norm."""

    _shardamp = True

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: float = 0.0,
                       gradient_clip_algorithm: Any = "norm") -> None:
        """Clip by norm through ``shardamp.optim.clip_grad_norm_``: the coefficient is applied
        inside the optimizer's step kernel, from the true global norm (all ranks' shards).

        Raises:
            ValueError: ``gradient_clip_algorithm='value'`` with a DistributedFusedAdam (its
                grads live in reduce-scattered shards; ``param.grad`` is None).
        """
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == "norm":
            # torch's clip_grad_norm_ would see param.grad None and clip nothing; shardamp's clips a
            # DistributedFusedAdam's params in its step (with the true scale) and others as torch
            clip_grad_norm_(self.main_params(optimizer), clip_val)
        elif isinstance(common.unwrap(optimizer), DistributedFusedAdam):
            raise ValueError(
                "gradient_clip_algorithm='value' with DistributedFusedAdam: its grads live in reduce-scattered "
                "shards (param.grad is None), so they cannot be clipped by value. Use gradient_clip_algorithm='norm'."
            )
        else:
            self.clip_grad_by_value(optimizer, clip_val)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """As Lightning's MixedPrecision.optimizer_step, with the DistributedFusedAdam unscaled
        after the closure (see the class docstring); without a scaler, the base plugin's step."""
        scaler = getattr(self, "scaler", None)
        if scaler is None or not isinstance(common.unwrap(optimizer), DistributedFusedAdam):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skipped_backward = closure_result is None and model.automatic_optimization
        if not skipped_backward:
            scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skipped_backward:
            return closure_result
        step_output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return step_output


class TrainerPlugins(NamedTuple):
    """One Trainer package's classes built by ``trainer_plugins``."""

    precision: type  # ShardampPrecision: precision="32-true"
    half_precision: type  # ShardampHalfPrecision: "bf16-true" / "16-true"
    mixed_precision: type  # ShardampMixedPrecision: "bf16-mixed" / "16-mixed"
    monitor: type  # ShardampMonitor
    bases: Tuple[type, type, type]  # the package's Precision, HalfPrecision and MixedPrecision


def trainer_plugins(module: str, package: str, precision: type, half_precision: type, mixed_precision: type,
                    callback: type) -> TrainerPlugins:
    """The precision plugins a Trainer package's ShardampStrategy runs (its ``Precision``,
    ``HalfPrecision`` and ``MixedPrecision`` with ``ClipThroughOptimizer``) and its
    ``ShardampMonitor`` (``callback``: its ``Callback``), as classes of ``module``, which must
    bind each under its name (a spawned rank unpickles them from there). ``package`` names the
    package in the monitor's docstring."""

    def make(name: str, bases: Tuple[type, ...], doc: str) -> type:
        def body(ns: Dict[str, Any]) -> None:
            ns.update(__module__=module, __qualname__=name, __doc__=doc)

        return types.new_class(name, bases, exec_body=body)

    return TrainerPlugins(
        make("ShardampPrecision", (ClipThroughOptimizer, precision), '``precision="32-true"`` under ShardampStrategy.'),
        make("ShardampHalfPrecision", (ClipThroughOptimizer, half_precision),
             '``precision="bf16-true"`` / ``"16-true"`` under ShardampStrategy.'),
        make("ShardampMixedPrecision", (ClipThroughOptimizer, mixed_precision),
             '``precision="bf16-mixed"`` / ``"16-mixed"`` (with a ShardedGradScaler) under ShardampStrategy.'),
        make("ShardampMonitor", (MonitorLogic, callback),
             f"A ``{package}`` callback logging ``grad_norm``, ``loss_scale`` and ``skipped_steps`` of every\n"
             "    DistributedFusedAdam each logged step (``trainer.log_every_n_steps``) into the Trainer's\n"
             "    loggers; ShardampStrategy adds one itself (``log_step_stats=True``, the default)."),
        (precision, half_precision, mixed_precision),
    )


class TrainerStrategyMixin(common.StrategyBase):
    """ShardampStrategy's logic: Lightning's ``DDPStrategy`` (launchers, process group,
    distributed sampler) without the DDP wrapper, for ``DistributedFusedAdam``. Combined with a
    package's ``DDPStrategy`` by ``shardamp.integrations.lightning`` and
    ``shardamp.integrations.pytorch_lightning``, whose class statement names that package's
    ``trainer_plugins`` (``plugins=``); see their ``ShardampStrategy``."""

    strategy_name = "shardamp"
    _monitor_class: ClassVar[type]  # the package's ShardampMonitor callback

    def __init_subclass__(cls, plugins: Optional[TrainerPlugins] = None, **kwargs: Any) -> None:
        if plugins is not None:
            kwargs.update(precisions=plugins.bases,
                          replacements=(plugins.precision, plugins.half_precision, plugins.mixed_precision))
            cls._monitor_class = plugins.monitor
        super().__init_subclass__(**kwargs)

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
        sharded_checkpoint: bool = False,
        staging_dir: Optional[str] = None,
        log_step_stats: bool = True,
        **kwargs: Any,
    ) -> None:
        """``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
        ``precision_plugin``, ``process_group_backend`` and ``timeout`` are as Lightning's
        ``DDPStrategy``'s (usually left to the Trainer: ``accelerator=``, ``devices=``,
        ``precision=``, ``plugins=``).

        Args:
            start_method: ``"popen"`` (a script per rank, as ``strategy="ddp"``), ``"spawn"``,
                ``"fork"`` or ``"forkserver"``; the registered names ``shardamp_spawn``,
                ``shardamp_fork`` and ``shardamp_notebook`` pick them.
            sharded_checkpoint: each rank writes its optimizer shard through
                ``torch.distributed.checkpoint`` into ``<checkpoint>.optim<i>/`` beside the
                checkpoint file, which stores that directory's name (relative to it) instead of
                the state (``strategy="shardamp_sharded_checkpoint"``). Default: every rank takes
                part in the optimizer's collective ``state_dict``, rank 0 writes it into the file.
            staging_dir: with ``sharded_checkpoint`` and a checkpoint path on a non-local fsspec
                filesystem (``s3://`` ...): where rank 0 stages the shards before uploading them;
                every rank must see it. Default: the temp dir.
            log_step_stats: add a ``ShardampMonitor`` callback (unless the Trainer has one):
                ``grad_norm``, ``loss_scale`` and ``skipped_steps`` logged each logged step.

        Raises:
            ValueError: DDP-only options (``find_unused_parameters`` ...), an unknown
                ``start_method``, or a precision plugin DistributedFusedAdam cannot train with.
        """
        super().__init__(
            start_method, sharded_checkpoint, staging_dir, kwargs, accelerator=accelerator,
            parallel_devices=parallel_devices, cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, process_group_backend=process_group_backend, timeout=timeout,
        )
        self.log_step_stats = bool(log_step_stats)

    # ------------------------------------------------------------------ no DDP
    def configure_ddp(self) -> None:
        """Keep the LightningModule unwrapped (DDPStrategy.setup would wrap it here); start every
        rank from rank 0's buffers."""
        common.broadcast_buffers(self.model)

    precision_plugin = common.precision_property(
        "_precision_plugin", "The precision plugin, routed (``route_precision``): 16-mixed with a ShardedGradScaler, "
                             "clipping through the optimizer.")

    def setup(self, trainer: Any) -> None:
        """Lightning's, then a ``ShardampMonitor`` joins the Trainer's callbacks (``log_step_stats``)."""
        super().setup(trainer)
        monitor = getattr(type(self), "_monitor_class", None)
        if self.log_step_stats and monitor is not None and not any(isinstance(c, MonitorLogic) for c in trainer.callbacks):
            trainer.callbacks.append(monitor())

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's, then every optimizer must be a DistributedFusedAdam.

        Raises:
            ValueError: ``configure_optimizers`` returned another optimizer.
        """
        super().setup_optimizers(trainer)
        for opt in self.optimizers:
            common.require_fused_adam(opt, f"{type(self).__name__}: configure_optimizers",
                                      "Return a DistributedFusedAdam, or use strategy='ddp' for other optimizers.")

    def _fused_adams(self) -> List[DistributedFusedAdam]:
        return [common.unwrap(opt) for opt in self.optimizers]

    def teardown(self) -> None:
        """Drop the optimizers' grads (``zero_grad()``), then Lightning's teardown, which moves the
        module to the CPU.

        The grads go first: a managed param's ``.grad`` is a view of the optimizer's reduced
        shards, and Lightning's ``module.cpu()`` moves every grad with its param, which with peers
        is a collective per param (``full_grad``). Dropped, they free the grad buffers as the
        teardown intends, and the params' values move to the CPU as with any strategy. Not a
        collective."""
        for opt in self._fused_adams():
            if isinstance(opt, DistributedFusedAdam):
                opt.zero_grad()
        super().teardown()

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulating micro-batches: grads stay local until the last one's backward."""
        with contextlib.ExitStack() as stack:
            for opt in self._fused_adams():
                stack.enter_context(opt.no_sync())
            yield None

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> Optional[Dict[str, Any]]:
        """Called on every rank by ``Trainer.save_checkpoint``: the collective state dict, whole
        on rank 0 (which writes the file) and None elsewhere; with ``sharded_checkpoint`` a
        placeholder that ``save_checkpoint`` replaces."""
        opt = common.unwrap(optimizer)
        if not isinstance(opt, DistributedFusedAdam):
            return super().optimizer_state(optimizer)
        if self.sharded_checkpoint:
            return {shards.DCP_KEY: None}
        return opt.state_dict(rank0_only=True)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Every rank: the shards first (``sharded_checkpoint``), then rank 0 writes the file, so
        a checkpoint file never refers to shards that are not complete. ``filepath`` may be an
        fsspec URL."""
        states = checkpoint.get("optimizer_states", [])
        for i, (opt, state) in enumerate(zip(self.optimizers, states)):
            if shards.is_reference(state):
                states[i] = shards.save(common.unwrap(opt), filepath, f".optim{i}", self, self.staging_dir)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Lightning's; remembers ``checkpoint_path``, beside which the shards it refers to are."""
        self._checkpoint_path = checkpoint_path
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Every rank: load each optimizer's state, from the file or from its shards.

        Raises:
            ValueError: shards referred to by name, but the checkpoint was not read through
                ``load_checkpoint`` (which says where the file is).
        """
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            opt = common.unwrap(opt)
            if not shards.is_reference(state):
                opt.load_state_dict(state)
                continue
            path = getattr(self, "_checkpoint_path", None)
            if path is None and not os.path.isabs(str(state[shards.DCP_KEY])):
                raise ValueError(
                    f"{type(self).__name__}.load_optimizer_state_dict: the checkpoint refers to optimizer shards by "
                    f"name ({state[shards.DCP_KEY]!r}), found beside the checkpoint file; read it through "
                    "strategy.load_checkpoint(path) first (Trainer.fit(ckpt_path=...) does)."
                )
            location = shards.resolve(state, path) if path is not None else state[shards.DCP_KEY]
            shards.load(opt, location, self, self.staging_dir)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's, and the optimizer shards beside the file (rank 0)."""
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            for i in range(len(self.optimizers)):
                shards.remove(filepath, f".optim{i}")


class MonitorLogic:
    """ShardampMonitor's logic (a Lightning ``Callback`` per package: ``shardamp.integrations.
    lightning.ShardampMonitor``, ``...pytorch_lightning.ShardampMonitor``): each logged training
    step, ``grad_norm``, ``loss_scale`` and ``skipped_steps`` of every DistributedFusedAdam go to the
    Trainer's loggers through ``LightningModule.log`` (``_step_logging.step_values``: one host
    read per logged step, none on the others). ShardampStrategy adds one unless the Trainer
    already has one (``log_step_stats=False`` turns that off)."""

    # Lightning enters every callback's hook of each name it reaches, whether a callback overrides
    # it or not (a profiler section and a call, six times a training batch: ~20 us of a small
    # model's iteration on a CPU host), and skips a hook that is not callable. The per-batch hooks
    # this callback does not use are None, so a host-bound loop pays for the one it does (a
    # subclass may still override them; it has no base method of theirs to call).
    on_train_batch_start = on_before_backward = on_after_backward = None
    on_before_optimizer_step = on_before_zero_grad = None
    on_validation_batch_start = on_validation_batch_end = None
    on_test_batch_start = on_test_batch_end = on_predict_batch_start = on_predict_batch_end = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Log the last step's values on the Trainer's logging steps (``log_every_n_steps``)."""
        every = max(int(getattr(trainer, "log_every_n_steps", 1) or 1), 1)
        step = trainer.global_step
        # under accumulate_grad_batches every micro-batch ends here: read once per optimizer step
        if step == 0 or step % every != 0 or step == getattr(self, "_logged_step", None):
            return
        self._logged_step = step
        values = step_logging.step_values(trainer.optimizers)
        if values:  # the same on every rank: no reduction needed
            pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=False, logger=True, sync_dist=False)
