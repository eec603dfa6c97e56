"""The AMP training loops that must all train exactly like unsharded torch.optim.AdamW, run
sharded and against the unsharded torch reference:

  A  torch.amp.GradScaler: backward; scaler.step; update (the optimizer unscales in step)
  B  ShardedGradScaler: backward; unscale_; opt.clip_grad_norm; step; update
  C  as B with shardamp.optim.clip_grad_norm_(model.parameters())
  D  any scaler or none, max_grad_norm= set: backward; step; opt.grad_norm() after
  E  as B with a subclass setting _step_supports_amp_scaling = False (torch's skip path)
  F  torch.amp.GradScaler + unscale_ + torch's clip_grad_norm_ (torch's tools see the grads:
     optim/torch_tools.py; true norm, clipped in the step)
  G  opt.clip_grad_norm BEFORE unscale_: resolved at step with the true scale; Gf torch's idiom
     there, shardamp.optim.clip_grad_norm_(params, max_norm * scale): the scaled norm, as torch
  H  as B with torch.nn.utils.clip_grad_norm_; H0 the same without a scaler (fp32)
  I  as F with get_total_norm([p.grad ...]) + clip_grads_with_norm_ (the two halves of torch's clip)

``run_loop(rank, world, loop)`` trains the MLP of parity.py for a few steps with loop A..G,
injecting an inf into ONE rank's batch at ``INF_STEP``, and returns per step the params, the
scale and the returned norm for both runs, what ``last_nonfinite()`` named, and at the end
``step_stats()`` beside the reference's counts. Blockwise moments in ``opt_kwargs``
(``exp_avg_dtype="8bit"``, ...): the reference is the same quantized math unsharded
(tests/low_bit_reference.py) under torch's GradScaler and clip. ``spike=True``: ``skip_grad_norm_above`` is set
and the batches of ``SPIKE_STEPS`` are scaled up; the reference skips the steps whose unscaled
norm exceeds it (its scaler neither backs off nor stops counting toward growth).
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

import low_bit_reference
import shardamp.optim as so
from parity import MLP, batches, two_groups
from shardamp.optim import DistributedFusedAdam
from shardamp.scaler import ShardedGradScaler

INF_STEP = 2
STEPS = 7
SPIKE_STEPS = (4, 5, 8)  # two in a row, then one more
SPIKE_STEPS_TOTAL = 11
SPIKE_ABOVE = 40.0  # unscaled norms are ~1-3 here, hundreds at a spike
SPIKE_FACTOR = 1000.0
MAX_NORM = 0.2
SCALER_KW = dict(init_scale=2.0**12, growth_interval=2)


class NeMoStyleAdam(DistributedFusedAdam):
    """Loop E: a subclass that opts out of in-step scaling, as NeMo does with Apex's optimizer."""

    _step_supports_amp_scaling = False


@contextlib.contextmanager
def _sync_debug(enabled: bool):
    if not enabled:
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _poison(x: torch.Tensor, step: int, rank: int, world: int) -> torch.Tensor:
    if step == INF_STEP and rank == world - 1:
        x = x.clone()
        x[0, 0] = float("inf")
    return x


def run_loop(rank: int, world: int, loop: str, device: str = "cpu", sync_check: bool = False, spike: bool = False,
             **opt_kwargs: Any) -> Dict[str, Any]:
    """``sync_check``: on CUDA, run unscale_/clip/step/update after the first step under
    ``torch.cuda.set_sync_debug_mode("error")``, so any host sync there raises."""
    steps = SPIKE_STEPS_TOTAL if spike else STEPS
    if spike:
        opt_kwargs = dict(opt_kwargs, skip_grad_norm_above=SPIKE_ABOVE)
    torch.manual_seed(0)
    model = MLP().to(device)
    ref = copy.deepcopy(model)
    clip_in_ctor = loop in ("D", "D0")
    cls = NeMoStyleAdam if loop == "E" else DistributedFusedAdam
    kwargs = dict(bucket_cap_mb=0.0004, **opt_kwargs)
    if clip_in_ctor:
        kwargs["max_grad_norm"] = MAX_NORM
    opt = cls(two_groups(model), **kwargs)
    if low_bit_reference.blockwise(opt_kwargs):
        # blockwise moments: the same quantized math unsharded, in the optimizer's bucket layout
        ropt: torch.optim.Optimizer = low_bit_reference.reference_for(two_groups(ref), opt, opt_kwargs)
    else:
        ropt = torch.optim.AdamW(two_groups(ref))
    use_torch_scaler = loop in ("A", "F", "I")
    no_scaler = loop in ("D0", "H0")
    scaler = None
    if not no_scaler:
        scaler = (torch.amp.GradScaler if use_torch_scaler else ShardedGradScaler)(device, **SCALER_KW)
    rscaler = None if no_scaler else torch.amp.GradScaler(device, **SCALER_KW)
    ref_clips = loop in ("B", "C", "D", "D0", "E", "F", "G", "Gf", "H", "H0", "I")
    loss_fn = nn.MSELoss()
    out: Dict[str, List[Any]] = {k: [] for k in ("ours", "ref", "scale", "ref_scale", "norm", "ref_norm", "skipped",
                                                 "nonfinite", "ref_skip", "ref_unscaled")}
    caught: List[str] = []
    for step in range(steps):
        data = batches(step, world, device=device)
        if spike and step in SPIKE_STEPS:
            data = [(x, y * SPIKE_FACTOR) for x, y in data]  # the loss, so the grads, grow with it
        # ---- reference: one process, all ranks' batches, torch's own AMP loop
        total = sum(loss_fn(ref(_poison(x, step, r, world)), y) for r, (x, y) in enumerate(data)) / world
        (rscaler.scale(total) if rscaler else total).backward()
        if rscaler:
            rscaler.unscale_(ropt)
        overflow = not bool(torch.isfinite(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])))
        rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM) if ref_clips else None
        # the unscaled norm before clipping decides a spike (rnorm is clip_grad_norm_'s: pre-clip)
        unscaled = float(rnorm if rnorm is not None else torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
        spiked = spike and not overflow and unscaled > SPIKE_ABOVE
        out["ref_unscaled"].append(unscaled)
        if rscaler:
            if not spiked:  # a spike is not an overflow: the scaler updates as after any finite step
                rscaler.step(ropt)
            rscaler.update()
        elif not overflow and not spiked:
            ropt.step()
        out["ref_skip"].append("nonfinite" if overflow else "spike" if spiked else None)
        ropt.zero_grad()
        # ---- ours
        x, y = data[rank]
        loss = loss_fn(model(_poison(x, step, rank, world)), y)
        (scaler.scale(loss) if scaler else loss).backward()
        norm: Optional[torch.Tensor] = None
        guard = sync_check and step > 0 and device == "cuda"
        # torch's idiom reads the scale on the host itself (GradScaler.get_scale: .item()): the
        # user's sync, made before the guarded region that proves the library makes none
        scale = scaler.get_scale() if loop == "Gf" else None
        with warnings.catch_warnings(record=True) as w, _sync_debug(guard):
            warnings.simplefilter("always")
            if loop in ("B", "E"):
                scaler.unscale_(opt)
                norm = opt.clip_grad_norm(MAX_NORM)
            elif loop == "C":
                scaler.unscale_(opt)
                norm = so.clip_grad_norm_(model.parameters(), MAX_NORM)
            elif loop in ("F", "H"):
                scaler.unscale_(opt)  # F: torch's, over the grads p.grad shows
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            elif loop == "H0":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            elif loop == "I":
                scaler.unscale_(opt)
                norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), MAX_NORM, norm)
            elif loop == "G":
                norm = opt.clip_grad_norm(MAX_NORM)  # before unscaling: resolved at step
            elif loop == "Gf":
                # torch's idiom before unscale_: the scaled norm against the scaled threshold, as torch
                norm = so.clip_grad_norm_(model.parameters(), MAX_NORM * scale) / scale
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if loop in ("D", "D0"):
                norm = opt.grad_norm()
        caught += [f"{x.category.__name__}: {x.message}" for x in w]
        # on the CPU ready at once; on CUDA read from the device now (every rank calls it)
        out["nonfinite"].append(opt.last_nonfinite())
        opt.zero_grad()
        out["ours"].append([p.detach().cpu().clone() for p in model.parameters()])
        out["ref"].append([p.detach().cpu().clone() for p in ref.parameters()])
        out["scale"].append(scaler.get_scale() if scaler else None)
        out["ref_scale"].append(rscaler.get_scale() if rscaler else None)
        out["norm"].append(None if norm is None else float(norm))
        out["ref_norm"].append(None if rnorm is None else float(rnorm))
        out["skipped"].append(bool(scaler.last_step_skipped) if isinstance(scaler, ShardedGradScaler) else None)
    out["warnings"] = caught
    out["stats"] = opt.step_stats()
    out["ref_final_scale"] = rscaler.get_scale() if rscaler else None
    out["nonfinite_name"] = "group 0, param 0, shape (20, 12)"  # a.weight: where the poisoned input lands
    return out
