"""torch.amp.GradScaler's hand-over to ``DistributedFusedAdam.step(grad_scaler=)`` (loops A and F).

torch's GradScaler calls ``step(grad_scaler=self)`` for optimizers with
``_step_supports_amp_scaling``; its internals are reached through ``_compat`` only.
"""
from __future__ import annotations

import warnings
from typing import Any

from .. import _compat


def take_over(opt: Any, scaler: Any) -> None:
    """Loop A/F: ``torch.amp.GradScaler.step`` handed itself to ``opt.step(grad_scaler=)``.

    Unscale by the scaler's scale unless ``unscale_grads`` already ran (loop F: torch's
    ``unscale_`` found no grads, so its clip clipped nothing: warn once), and write the GLOBAL
    found-inf into the scaler's per-optimizer state, so ``update()`` agrees on every rank."""
    state = _compat.scaler_optimizer_state(scaler, opt)
    opt._note_scaler(scaler)  # step_stats() reports its scale
    if opt._inv_scale is None:
        if state["stage"] is _compat.OptState.UNSCALED and not opt._warned_unscaled_by_torch:
            opt._warned_unscaled_by_torch = True
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
        opt.unscale_grads(scale.double().reciprocal().float(), grad_scaler=scaler)
    found_inf = opt._current_round().stats.found_inf
    scale_device = _compat.scaler_scale(scaler).device
    state["found_inf_per_device"] = {scale_device: found_inf.to(scale_device)}
