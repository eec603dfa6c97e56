"""The scalers' side of the optimizer: torch.amp.GradScaler's hand-over to
``DistributedFusedAdam.step(grad_scaler=)`` (loops A and F), and the hooks ShardedGradScaler calls.

torch's GradScaler calls ``step(grad_scaler=self)`` for optimizers with
``_step_supports_amp_scaling``; its internals are reached through ``_compat`` only.
:class:`ScalerHooks` is a base of ``DistributedFusedAdam`` (as reads.py's ``OptimizerReads``):
the methods ``shardamp.scaler.ShardedGradScaler`` looks for on an optimizer, each handing the work
to the step's health or the step cycle. It keeps no state of its own.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .. import _compat
from .cycle import StepCycle


def unscale_after_backward(scaler: Any, optimizer: Any, cycle: StepCycle,
                           unscale_grads: Callable[..., Tensor]) -> Optional[Tensor]:
    """A scaler's ``unscale_`` reached the grads, then a backward added to them (folded by the
    step cycle: a new round): torch does not unscale twice, so neither does the step. The new
    round's stats and found-inf come from ``unscale_grads`` by one. Returns that found-inf (0-d,
    agreed by every rank, on the scale's device), or None where no backward followed an
    ``unscale_``. No host sync."""
    state = _compat.scaler_optimizer_state(scaler, optimizer)
    if cycle.inv_scale is None and state["stage"] is _compat.OptState.UNSCALED and cycle.unscaled_since_step:
        one = torch.ones((), dtype=torch.float32, device=_compat.scaler_scale(scaler).device)
        return unscale_grads(one, grad_scaler=scaler)
    return None


def take_over(scaler: Any, optimizer: Any, cycle: StepCycle, unscale_grads: Callable[..., Tensor]) -> None:
    """Loop A/F: ``torch.amp.GradScaler.step`` handed itself to ``optimizer.step(grad_scaler=)``.

    Unscale by the scaler's scale through ``unscale_grads`` (the optimizer's method: a
    subclass's override is honoured) unless that already ran this step (loop F: torch's
    ``unscale_`` found no grads, so its clip clipped nothing: warn once), and write the GLOBAL
    found-inf into the scaler's per-optimizer state, so ``update()`` agrees on every rank.

    Args:
        scaler: the ``torch.amp.GradScaler``.
        optimizer: the optimizer it steps (the key of the scaler's per-optimizer state).
        cycle: the optimizer's step cycle.
        unscale_grads: the optimizer's ``unscale_grads``.
    """
    state = _compat.scaler_optimizer_state(scaler, optimizer)
    unscale_after_backward(scaler, optimizer, cycle, unscale_grads)
    if cycle.inv_scale is None:
        if state["stage"] is _compat.OptState.UNSCALED and cycle.warn_once("unscaled by torch"):
            warnings.warn(
                "torch.amp.GradScaler.unscale_ found no gradients to unscale: DistributedFusedAdam "
                "keeps only reduce-scattered shards and leaves param.grad None, so torch's "
                "clip_grad_norm_ clipped nothing. The step unscales correctly but is NOT clipped. "
                "To clip, use shardamp.scaler.ShardedGradScaler with opt.clip_grad_norm() or "
                "shardamp.optim.clip_grad_norm_(), or pass max_grad_norm= to the optimizer.",
                UserWarning,
                stacklevel=4,
            )
        scale = _compat.scaler_scale(scaler)
        unscale_grads(scale.double().reciprocal().float(), grad_scaler=scaler)
    found_inf = cycle.current().stats.found_inf
    scale_device = _compat.scaler_scale(scaler).device
    state["found_inf_per_device"] = {scale_device: found_inf.to(scale_device)}


class ScalerHooks:
    """What ``ShardedGradScaler`` calls on ``DistributedFusedAdam`` besides ``unscale_grads`` and
    ``step`` (it looks each up by name: an optimizer without them still steps). No collective."""

    # what DistributedFusedAdam builds, used here
    _health: Any
    _cycle: StepCycle
    unscale_grads: Callable[..., Tensor]

    def _note_scaler(self, scaler: Any) -> None:
        """A scaler unscales (or steps) this optimizer: ``step_stats()`` reports its scale."""
        self._health.note_scaler(scaler)

    def _found_inf_after_backward(self, scaler: Any) -> Optional[Tensor]:
        """ShardedGradScaler.step's: :func:`unscale_after_backward` with this optimizer's ``unscale_grads``."""
        return unscale_after_backward(scaler, self, self._cycle, self.unscale_grads)

    def _note_step_skipped_by_scaler(self) -> None:
        """A scaler skipped this round's ``step`` on the host (``_step_supports_amp_scaling = False``): the
        health counts and reports a found-inf step (every rank: the scaler's found-inf is agreed). A host
        sync, as the scaler's own."""
        r = self._cycle.current()
        if r.stats is not None:
            self._health.host_skipped(r.norm(r.first_norm_type()), r.inv_scale)
