"""PyTorch Lightning: ``pl.Trainer(strategy=ShardampStrategy(), ...)`` with a
``DistributedFusedAdam`` returned by ``configure_optimizers``.

``ShardampStrategy`` is Lightning's ``DDPStrategy`` (same launchers, process-group setup and
distributed sampler) with five things changed:

* the model is never wrapped in DDP: the optimizer reduce-scatters the grads itself;
* ``gradient_clip_val`` (norm) clips through ``shardamp.optim.clip_grad_norm_``, i.e. inside the
  optimizer's step kernel with the true global norm, in every precision (Lightning's own AMP
  plugin refuses to clip optimizers that unscale inside ``step``);
* ``precision="16-mixed"`` uses ``ShardedGradScaler`` (every rank skips the same steps);
* ``accumulate_grad_batches`` runs all but the last micro-batch under ``opt.no_sync()``;
* checkpoints: every rank takes part in the optimizer's (collective) ``state_dict``; rank 0
  writes it. ``sharded_checkpoint=True`` writes each rank's shard through
  ``torch.distributed.checkpoint`` next to the checkpoint file instead.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any, Dict, Iterator, List, Mapping, Optional

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType

from shardamp.optim import DistributedFusedAdam, clip_grad_norm_, load_sharded, save_sharded
from shardamp.scaler import ShardedGradScaler

__all__ = ["ShardampStrategy"]

_DCP_KEY = "shardamp_dcp_dir"


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer -> the optimizer


class _ClipThroughOptimizer:
    """Precision-plugin mixin: norm clipping that reaches a DistributedFusedAdam's shards."""

    _shardamp = True

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            # torch's clip_grad_norm_ would see param.grad None and clip nothing; shardamp's clips a
            # DistributedFusedAdam's params in its step (with the true scale) and others as torch
            clip_grad_norm_(self.main_params(optimizer), clip_val)
        elif isinstance(_unwrap(optimizer), DistributedFusedAdam):
            raise ValueError(
                "gradient_clip_algorithm='value' with DistributedFusedAdam: its grads live in "
                "reduce-scattered shards (param.grad is None), so they cannot be clipped by value. "
                "Use gradient_clip_algorithm='norm'."
            )
        else:
            self.clip_grad_by_value(optimizer, clip_val)


class _Precision(_ClipThroughOptimizer, Precision):
    pass


class _HalfPrecision(_ClipThroughOptimizer, HalfPrecision):
    pass


class _MixedPrecision(_ClipThroughOptimizer, MixedPrecision):
    pass


def _sharded_scaler(scaler: Optional[torch.amp.GradScaler], device: str) -> Optional[ShardedGradScaler]:
    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return scaler
    return ShardedGradScaler(  # same settings as the scaler Lightning (or the user) made
        device, init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
    )


def _route_precision(plugin: Precision) -> Precision:
    if getattr(plugin, "_shardamp", False):
        return plugin
    if type(plugin) is MixedPrecision:
        return _MixedPrecision(plugin.precision, plugin.device, _sharded_scaler(plugin.scaler, plugin.device))
    if type(plugin) is HalfPrecision:
        return _HalfPrecision(plugin.precision)
    if type(plugin) is Precision:
        return _Precision()
    raise ValueError(
        f"ShardampStrategy: precision plugin {type(plugin).__name__} is not supported; use "
        "precision='32-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'."
    )


class ShardampStrategy(DDPStrategy):
    """Lightning's DDP launch and process group, without DDP: for ``DistributedFusedAdam``.

    Takes DDPStrategy's launch arguments (``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``,
    ``timeout``, ``start_method``) plus ``sharded_checkpoint`` (write the optimizer state per rank
    through DCP into ``<checkpoint>.optim<i>/`` instead of into the checkpoint file; the
    checkpoint stores that directory's absolute path). Every optimizer must be a
    DistributedFusedAdam: nothing else would reduce the grads.
    """

    strategy_name = "shardamp"

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        start_method: str = "popen",
        sharded_checkpoint: bool = False,
        **kwargs: Any,
    ) -> None:
        unknown = set(kwargs) - {"timeout"}
        if unknown:
            raise ValueError(
                f"ShardampStrategy: unexpected arguments {sorted(unknown)} (DDP options do not apply: "
                "the model is not wrapped in DDP)"
            )
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, start_method=start_method, **kwargs,
        )
        self.sharded_checkpoint = bool(sharded_checkpoint)

    # ------------------------------------------------------------------ no DDP
    def configure_ddp(self) -> None:
        """Keep the LightningModule unwrapped (DDPStrategy.setup would wrap it here). As DDP's
        constructor does, start every rank from rank 0's buffers (the optimizer broadcasts the
        params itself); unlike DDP's default, buffers are not re-broadcast at every forward."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            for buf in self.model.buffers():
                torch.distributed.broadcast(buf, src=0)

    @property
    def precision_plugin(self) -> Precision:
        """The precision plugin in use, with clipping routed through the optimizer.

        Lightning's own plugins are wrapped on first access: ``gradient_clip_val`` (norm) then clips
        through ``shardamp.optim.clip_grad_norm_`` in every precision, and ``"16-mixed"`` uses a
        ``ShardedGradScaler`` with the same settings. An unsupported plugin raises ``ValueError``.
        """
        plugin = self._precision_plugin
        if plugin is not None and not getattr(plugin, "_shardamp", False):
            plugin = self._precision_plugin = _route_precision(plugin)
        return plugin if plugin is not None else _Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = plugin

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's optimizer setup, then a check that every optimizer is a ``DistributedFusedAdam``.

        Raises:
            ValueError: ``configure_optimizers`` returned another optimizer (nothing else would
                reduce the grads without DDP; use ``strategy="ddp"`` for it).
        """
        super().setup_optimizers(trainer)
        for opt in self.optimizers:
            if not isinstance(_unwrap(opt), DistributedFusedAdam):
                raise ValueError(
                    f"ShardampStrategy: configure_optimizers returned {type(_unwrap(opt)).__name__}; "
                    "ShardampStrategy does not wrap the model in DDP, so only "
                    "shardamp.optim.DistributedFusedAdam reduces the grads. Return a "
                    "DistributedFusedAdam, or use strategy='ddp' for other optimizers."
                )

    def _shardamp_optimizers(self) -> List[DistributedFusedAdam]:
        return [_unwrap(opt) for opt in self.optimizers if isinstance(_unwrap(opt), DistributedFusedAdam)]

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulating micro-batches: grads stay local until the last one's backward."""
        with contextlib.ExitStack() as stack:
            for opt in self._shardamp_optimizers():
                stack.enter_context(opt.no_sync())
            yield None

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> Optional[Dict[str, Any]]:
        """Called on every rank by Trainer.save_checkpoint: the collective state dict, whole on
        rank 0 (which writes the file) and None elsewhere."""
        opt = _unwrap(optimizer)
        if not isinstance(opt, DistributedFusedAdam):
            return super().optimizer_state(optimizer)
        if self.sharded_checkpoint:
            return {_DCP_KEY: None}  # filled in by save_checkpoint, which knows the path
        return opt.state_dict(rank0_only=True)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write the checkpoint; with ``sharded_checkpoint``, every rank first writes its optimizer
        shard through DCP into ``<filepath>.optim<i>/`` and the checkpoint keeps that absolute path.

        Called on every rank by ``Trainer.save_checkpoint`` (the sharded save is a collective).
        """
        if self.sharded_checkpoint and "optimizer_states" in checkpoint:
            states = checkpoint["optimizer_states"]
            for i, (opt, state) in enumerate(zip(self.optimizers, states)):
                if isinstance(state, dict) and _DCP_KEY in state:
                    path = os.path.abspath(f"{os.fspath(filepath)}.optim{i}")
                    save_sharded(_unwrap(opt), path)  # every rank writes its own shard
                    states[i] = {_DCP_KEY: path}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load each optimizer's state from ``checkpoint``: a full state dict, or the DCP directory a
        sharded checkpoint names. A collective (every rank loads), at any world size.
        """
        states = checkpoint["optimizer_states"]
        for opt, state in zip(self.optimizers, states):
            if isinstance(state, dict) and _DCP_KEY in state:
                load_sharded(_unwrap(opt), state[_DCP_KEY])
            else:
                _unwrap(opt).load_state_dict(state)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint, and with ``sharded_checkpoint`` its ``.optim<i>/`` directories (on
        global rank 0).
        """
        super().remove_checkpoint(filepath)
        if self.sharded_checkpoint and self.is_global_zero:
            for i in range(len(self.optimizers)):
                shutil.rmtree(f"{os.fspath(filepath)}.optim{i}", ignore_errors=True)
