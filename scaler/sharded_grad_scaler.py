"""ShardedGradScaler: torch.amp.GradScaler that asks sharded optimizers to unscale themselves.

The protocol, optimizer by optimizer:

* an optimizer with ``unscale_grads`` (DistributedFusedAdam and subclasses): ``unscale_`` calls
  ``optimizer.unscale_grads(1/scale, grad_scaler=self)`` instead of walking ``param.grad`` (which
  is None for reduce-scattered grads) and records the GLOBAL found-inf it returns. ``step`` then
  calls ``optimizer.step()`` directly when ``_step_supports_amp_scaling`` is true (the skip
  happens on the device, no host sync, no deprecated ``grad_scaler=`` hand-over), or goes through
  torch's ordinary skip-or-step (one ``.item()``) when a subclass sets it False (NeMo style);
* any other optimizer: exactly ``torch.amp.GradScaler``, with the found-infs additionally agreed
  (MAX) over ``process_group`` when torch.distributed is initialised, so every rank skips the
  same steps and keeps the same scale.

Beyond torch: ``hysteresis=N`` backs the scale off only after N consecutive overflowing steps
(1 is torch's behaviour), kept in ``state_dict``; ``last_step_skipped`` is a device tensor saying
whether the last update saw an overflow.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from shardamp.optim import _compat, comm


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded optimizers: one found-inf and one scale on every rank.

    Use it exactly as torch's scaler (``scale(loss).backward()``, ``unscale_(opt)``,
    ``step(opt)``, ``update()``). The protocol per optimizer:

    * an optimizer with ``unscale_grads`` (``DistributedFusedAdam`` and subclasses):
      ``unscale_`` hands it ``1/scale`` instead of walking ``param.grad`` (which is ``None`` for
      reduce-scattered grads); nothing is rewritten, and the GLOBAL found-inf it returns (agreed
      by every rank in the optimizer's one stats all-reduce) is recorded. ``step`` then calls
      ``optimizer.step()`` directly when ``_step_supports_amp_scaling`` is true (the kernel
      skips on the device: no host sync), or goes through torch's ordinary skip-or-step (one
      ``.item()``) when a subclass sets it ``False``;
    * any other optimizer (e.g. ``torch.optim.AdamW`` over FSDP2's DTensor params): exactly
      torch's scaler, with each found-inf additionally agreed (MAX all-reduce over
      ``process_group``) when ``torch.distributed`` is initialised, so every rank skips the same
      steps and keeps the same scale.

    ``update`` never syncs the host. Beyond torch: ``hysteresis``, and ``last_step_skipped``.

    Args:
        device: the device type of the scale, ``"cuda"`` or ``"cpu"``, as torch's.
        init_scale: the initial scale, a finite float > 0.
        growth_factor: factor the scale grows by after ``growth_interval`` clean steps (> 1).
        backoff_factor: factor the scale shrinks by on an overflow, in (0, 1).
        growth_interval: clean steps between two growths (> 0).
        enabled: ``False`` makes every method a pass-through, as torch's.
        process_group: the group found-infs of non-sharded optimizers are agreed over; default
            the WORLD group. (A ``DistributedFusedAdam`` agrees over its own group.)
        hysteresis: back the scale off only after this many consecutive overflowing steps
            (1 = torch's behaviour); kept in ``state_dict``.

    Raises:
        ValueError: an invalid argument, naming it and what it accepts.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Optional[Any] = None,
        hysteresis: int = 1,
    ) -> None:
        if not (isinstance(hysteresis, int) and not isinstance(hysteresis, bool) and hysteresis >= 1):
            raise ValueError(f"hysteresis={hysteresis!r}: expected an int >= 1 (1 = torch's behaviour)")
        if isinstance(init_scale, bool) or not (isinstance(init_scale, (int, float)) and 0 < init_scale < math.inf):
            raise ValueError(f"init_scale={init_scale!r}: expected a finite float > 0")
        if not (isinstance(growth_factor, (int, float)) and growth_factor > 1.0):
            raise ValueError(f"growth_factor={growth_factor!r}: expected a float > 1")
        if not (isinstance(backoff_factor, (int, float)) and 0.0 < backoff_factor < 1.0):
            raise ValueError(f"backoff_factor={backoff_factor!r}: expected a float in (0, 1)")
        if not (isinstance(growth_interval, int) and growth_interval > 0):
            raise ValueError(f"growth_interval={growth_interval!r}: expected an int > 0")
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.process_group = process_group
        self.hysteresis = hysteresis
        self._hysteresis_tracker: Optional[Tensor] = None  # overflows still tolerated
        self._init_hysteresis_tracker = hysteresis
        self._last_found_inf: Optional[Tensor] = None

    # ------------------------------------------------------------------ unscale / step
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s grads (sharded optimizers: without touching them) and record
        the global found-inf. Raises, as torch does, when called twice before ``update()`` or
        after ``step()``."""
        if not self.is_enabled():
            return
        if not hasattr(optimizer, "unscale_grads"):
            super().unscale_(optimizer)
            self._agree_found_inf(_compat.scaler_optimizer_state(self, optimizer))
            return
        _compat.scale_and_growth_tracker(self, "unscale_")
        state = _compat.scaler_optimizer_state(self, optimizer)
        if state["stage"] is _compat.OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is _compat.OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = _compat.scaler_scale(self).double().reciprocal().float()
        if hasattr(optimizer, "_note_scaler"):
            optimizer._note_scaler(self)  # its step_stats() reports this scaler's scale
        found_inf = optimizer.unscale_grads(inv_scale, grad_scaler=self)
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = _compat.OptState.UNSCALED

    def _agree_found_inf(self, state: dict) -> None:
        for found_inf in state["found_inf_per_device"].values():
            comm.all_reduce_max(found_inf, self.process_group)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if not done yet, then step, skipping the update if any rank overflowed."""
        if not self.is_enabled() or not hasattr(optimizer, "unscale_grads"):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        _compat.scale_and_growth_tracker(self, "step")
        state = _compat.scaler_optimizer_state(self, optimizer)
        if state["stage"] is _compat.OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is _compat.OptState.READY:
            self.unscale_(optimizer)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # the kernel skips on the device flag. After unscale_ and another backward (a new round
            # over the unscaled grads plus the new, scaled ones, not unscaled again) the step acts
            # on the new round's found-inf: update() reads that one, so an inf only that backward
            # produced backs the scale off (the step skipped on it)
            refresh = getattr(optimizer, "_found_inf_after_backward", None)
            found_inf = refresh(self) if refresh is not None else None
            if found_inf is not None:
                state["found_inf_per_device"] = {found_inf.device: found_inf}
            retval = optimizer.step(*args, **kwargs)
        else:
            # torch's skip-or-step: found-inf read on the host once (as torch reads it); a skipped
            # step is counted (and its non-finite grads reported) by the optimizer's step health
            skipped = bool(sum(float(f) for f in state["found_inf_per_device"].values()))
            retval = None
            if not skipped:
                retval = optimizer.step(*args, **kwargs)
            elif hasattr(optimizer, "_note_step_skipped_by_scaler"):
                optimizer._note_step_skipped_by_scaler()
        state["stage"] = _compat.OptState.STEPPED
        return retval

    # ------------------------------------------------------------------ update
    def update(self, new_scale: Optional[float | Tensor] = None) -> None:
        """As torch's ``update`` (no host sync), with hysteresis and ``last_step_skipped``."""
        if not self.is_enabled():
            return
        _check_new_scale(new_scale)
        scale, growth_tracker = _compat.scale_and_growth_tracker(self, "update")
        found_infs = [
            f.to(device=scale.device, non_blocking=True)
            for state in _compat.all_scaler_optimizer_states(self)
            for f in state["found_inf_per_device"].values()
        ]
        if len(found_infs) == 1:
            self._last_found_inf = found_infs[0] > 0
        elif found_infs:
            self._last_found_inf = torch.stack(found_infs).sum() > 0
        if new_scale is not None or self.hysteresis == 1:
            super().update(new_scale)
            if new_scale is not None and self._hysteresis_tracker is not None:
                self._hysteresis_tracker.fill_(self.hysteresis)
            return
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        tracker = self._lazy_hysteresis_tracker(scale.device)
        found = self._last_found_inf
        # consecutive overflows use up the hysteresis; a clean step restores it
        tracker.copy_(torch.where(found, tracker - 1, torch.full_like(tracker, self.hysteresis)))
        back_off = found & (tracker <= 0)
        grown_tracker = growth_tracker + 1
        grow = ~found & (grown_tracker >= self.get_growth_interval())
        grown_scale = scale * self.get_growth_factor()
        grow = grow & torch.isfinite(grown_scale)
        new = torch.where(back_off, scale * self.get_backoff_factor(), torch.where(grow, grown_scale, scale))
        scale.copy_(new)
        growth_tracker.copy_(torch.where(found | grow, torch.zeros_like(growth_tracker), grown_tracker))
        tracker.clamp_(min=0)
        _compat.refresh_scaler_states(self)

    def _lazy_hysteresis_tracker(self, device: torch.device) -> Tensor:
        if self._hysteresis_tracker is None:
            self._hysteresis_tracker = torch.full(
                (), self._init_hysteresis_tracker, dtype=torch.int32, device=device
            )
        return self._hysteresis_tracker

    @property
    def last_step_skipped(self) -> Optional[Tensor]:
        """0-d bool device tensor: did the last ``update()`` see an overflow (so the optimizer
        step was skipped)? None before the first update. Reading it on the host is a sync."""
        return self._last_found_inf

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """torch's scaler state plus ``hysteresis`` and the overflows still tolerated.

        Local (no collective); reads the hysteresis counter on the host (a sync once the scaler
        has updated on a GPU). Empty when disabled, as torch's.
        """
        sd = super().state_dict()
        if sd:
            sd["hysteresis"] = self.hysteresis
            sd["_hysteresis_tracker"] = (
                int(self._hysteresis_tracker.item()) if self._hysteresis_tracker is not None
                else self._init_hysteresis_tracker
            )
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this scaler or of ``torch.amp.GradScaler`` (whose hysteresis is 1).

        Local (no collective, no host sync); a no-op when disabled, as torch's.

        Raises:
            RuntimeError: an empty dict (saved from a disabled scaler), as torch's.
        """
        super().load_state_dict(state_dict)
        if not self.is_enabled():
            return
        self.hysteresis = int(state_dict.get("hysteresis", 1))
        self._init_hysteresis_tracker = int(state_dict.get("_hysteresis_tracker", self.hysteresis))
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)


def _check_new_scale(new_scale: Any) -> None:
    """``update(new_scale)``: a float must be finite and > 0 (0 would skip every step from then
    on, inf/NaN would make NaN params); a tensor must hold one float element (its value is on
    the device: a step with a scale of 0/inf/NaN is skipped there)."""
    if new_scale is None:
        return
    if isinstance(new_scale, Tensor):
        if new_scale.numel() != 1 or not new_scale.is_floating_point():
            raise ValueError(f"new_scale: expected a one-element float tensor, got shape {tuple(new_scale.shape)} "
                             f"{new_scale.dtype}")
        return
    if isinstance(new_scale, bool) or not (isinstance(new_scale, (int, float)) and 0 < new_scale < math.inf):
        raise ValueError(f"new_scale={new_scale!r}: expected a finite float > 0")
