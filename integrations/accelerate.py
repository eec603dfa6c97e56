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

With any other optimizer it behaves exactly like ``Accelerator``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, List, Optional, Set

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from shardamp.optim import DistributedFusedAdam, clip_grad_norm_
from shardamp.scaler import ShardedGradScaler

__all__ = ["ShardampAccelerator"]


def _unwrap(optimizer: Any) -> Any:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _params(opt: DistributedFusedAdam) -> List[torch.nn.Parameter]:
    return [p for group in opt.param_groups for p in group["params"]]


class _ShardampAcceleratedOptimizer(AcceleratedOptimizer):
    """AcceleratedOptimizer whose ``step_was_skipped`` reads the ShardedGradScaler's verdict:
    the skip happens on the device inside ``step``, which accelerate would count as a step."""

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
        if skipped is None:
            return False
        cached = getattr(self, "_shardamp_skip_read", None)
        if cached is None or cached[0] is not skipped:
            cached = self._shardamp_skip_read = (skipped, bool(skipped))
        return cached[1]


class ShardampAccelerator(Accelerator):
    """``accelerate.Accelerator`` that trains a ``DistributedFusedAdam`` correctly (see the
    module docstring); takes exactly Accelerator's arguments."""

    # ------------------------------------------------------------------ which params are ours
    def _shardamp_optimizers(self) -> List[DistributedFusedAdam]:
        opts = list(getattr(self, "_shardamp_pending", []))
        opts += [_unwrap(o) for o in self._optimizers if isinstance(_unwrap(o), DistributedFusedAdam)]
        return list({id(o): o for o in opts}.values())

    def _optimizers_of(self, params: Iterable[torch.Tensor]) -> List[DistributedFusedAdam]:
        ids: Set[int] = {id(p) for p in params}
        return [o for o in self._shardamp_optimizers() if any(id(p) in ids for p in _params(o))]

    def _plain_setup(self) -> bool:
        """FSDP, DeepSpeed, Megatron and XLA keep their own paths (and refuse this optimizer)."""
        return self.distributed_type not in (
            DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA,
        )

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: Optional[List[bool]] = None) -> Any:
        """``Accelerator.prepare``, with a ``DistributedFusedAdam``'s model left unwrapped (no DDP).

        Raises:
            ValueError: a ``DistributedFusedAdam`` is prepared without its model (pass the model
                with or before the optimizer: otherwise autocast and ``save_state`` would silently
                miss it).
        """
        # the model comes before its optimizer in prepare's first pass: announce the optimizer
        pending = [_unwrap(a) for a in args if isinstance(_unwrap(a), DistributedFusedAdam)]
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
        """``Accelerator.prepare_model``; a model whose params a prepared ``DistributedFusedAdam``
        manages gets device placement, autocast and ``torch.compile`` as usual, but no DDP wrapper.
        """
        if not evaluation_mode and self._plain_setup() and self._optimizers_of(model.parameters()):
            # evaluation_mode=True is prepare_model minus the distributed wrapper (DDP): device
            # placement, autocast and torch.compile still apply
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> Any:
        """``Accelerator.prepare_optimizer``; for a ``DistributedFusedAdam``, fp16's ``GradScaler`` is
        replaced by a ``ShardedGradScaler`` with the same settings, and ``step_was_skipped`` reports
        its device-side skip (read on the host only when asked).
        """
        opt = _unwrap(optimizer)
        if not isinstance(opt, DistributedFusedAdam) or getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
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
