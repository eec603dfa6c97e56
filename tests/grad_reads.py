"""Reading a DistributedFusedAdam's grads with torch's tools and with full_grad / local_grad,
against the unsharded torch reference (what ``param.grad`` holds there at the same point).

``run_reads(rank, world, scaler)`` trains a channels_last ConvNet in two param groups with tiny
buckets (params straddle shards unevenly), an inf in ONE rank's batch at ``INF_STEP``, with
``scaler`` "none" (fp32), "sharded" (ShardedGradScaler) or "torch" (torch.amp.GradScaler, loop F).
Per step it records, on both sides: the grads before unscaling (``full_grad`` / ``local_grad`` vs
the reference's scaled ``p.grad``), after ``unscale_`` (also Lightning's ``grad_norm`` and
``get_total_norm([p.grad ...])``), torch's ``clip_grad_norm_`` (its norm and the clipped grads),
the grads after ``step`` and after ``zero_grad``, and the params; then, after one more step, both
models cast (a Trainer's teardown moving its model while the optimizer holds grads).
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from parity import ConvNet, _to_format, batches, two_groups
from shardamp.optim import DistributedFusedAdam
from shardamp.scaler import ShardedGradScaler

STEPS = 4
INF_STEP = 2
MAX_NORM = 0.05
TINY = 0.0004  # MB: about 100 fp32 elements per bucket
SCALER_KW = dict(init_scale=2.0**10, growth_interval=2)


def _lightning_grad_norm():
    try:
        from lightning.pytorch.utilities import grad_norm
    except ImportError:
        return None
    return grad_norm


def _poison(x: torch.Tensor, step: int, rank: int, world: int) -> torch.Tensor:
    if step == INF_STEP and rank == world - 1:
        x = x.clone()
        x[0, 0, 0, 0] = float("inf")
    return x


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in storage order (``t`` dense, its own storage from offset 0)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset()).clone()


def _grads(opt: DistributedFusedAdam, model: nn.Module) -> List[Optional[torch.Tensor]]:
    out = []
    for p in model.parameters():
        g = opt.full_grad(p)
        out.append(None if g is None else g.detach().clone())
    return out


def _locals(opt: DistributedFusedAdam, model: nn.Module) -> List[Any]:
    out = []
    for p in model.parameters():
        lg = opt.local_grad(p)
        out.append(None if lg is None else (lg.tensor.clone(), lg.start, lg.end))
    return out


def _moved_at_the_end(model: nn.Module, ref: nn.Module, opt: DistributedFusedAdam, ropt: Any, scaler: Any,
                      rscaler: Any, rank: int, world: int) -> Dict[str, Any]:
    """One more step on both sides, its grads kept, then both models cast to float64 (every rank, as a
    Trainer's teardown moves its model): the grads and params each side then holds."""
    loss_fn = nn.MSELoss()
    data = batches(STEPS, world, "conv")
    total = sum(loss_fn(ref(x), y) for x, y in data) / world
    x, y = data[rank]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for side, o, s, loss in ((ref, ropt, rscaler, total), (model, opt, scaler, loss_fn(model(x), y))):
            (s.scale(loss) if s else loss).backward()
            if s:
                s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(side.parameters(), MAX_NORM)
            if s:
                s.step(o)
                s.update()
            else:
                o.step()
    model.double()
    ref.double()
    out: Dict[str, Any] = {"types": [(type(p.grad).__name__, p.grad.dtype, p.dtype) for p in model.parameters()],
                           "grads": [p.grad.clone() for p in model.parameters()],
                           "ref_grads": [p.grad.clone() for p in ref.parameters()],
                           "params": [p.detach().clone() for p in model.parameters()],
                           "ref_params": [p.detach().clone() for p in ref.parameters()]}
    try:
        opt.step()
        out["step_after"] = ""
    except RuntimeError as e:
        out["step_after"] = str(e)
    opt.zero_grad()
    out["after_zero"] = [p.grad is None for p in model.parameters()]
    return out


def run_reads(rank: int, world: int, scaler_kind: str) -> Dict[str, Any]:
    grad_norm = _lightning_grad_norm()
    torch.manual_seed(0)
    model = _to_format(ConvNet(), torch.channels_last)
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=TINY)
    ropt = torch.optim.AdamW(two_groups(ref))
    scaler = rscaler = None
    if scaler_kind != "none":
        scaler = (torch.amp.GradScaler if scaler_kind == "torch" else ShardedGradScaler)("cpu", **SCALER_KW)
        rscaler = torch.amp.GradScaler("cpu", **SCALER_KW)
    loss_fn = nn.MSELoss()
    steps: List[Dict[str, Any]] = []
    for step in range(STEPS):
        rec: Dict[str, Any] = {}
        data = batches(step, world, "conv")
        # ---- the reference: one process, every rank's batch, torch's own loop
        total = sum(loss_fn(ref(_poison(x, step, r, world)), y) for r, (x, y) in enumerate(data)) / world
        (rscaler.scale(total) if rscaler else total).backward()
        rec["ref_scaled"] = [p.grad.clone() for p in ref.parameters()]
        if rscaler:
            rscaler.unscale_(ropt)
        rec["ref_grads"] = [p.grad.clone() for p in ref.parameters()]
        rec["ref_lightning"] = None if grad_norm is None else {k: float(v) for k, v in grad_norm(ref, 2).items()}
        rec["ref_total"] = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
        rec["ref_norm"] = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        rec["ref_clipped"] = [p.grad.clone() for p in ref.parameters()]
        if rscaler:
            rscaler.step(ropt)
            rscaler.update()
        elif torch.isfinite(torch.tensor(rec["ref_norm"])):
            ropt.step()
        ropt.zero_grad()
        # ---- ours: one batch per rank; every read below is a collective but local_grad
        x, y = data[rank]
        loss = loss_fn(model(_poison(x, step, rank, world)), y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.amp.GradScaler's hand-over
            (scaler.scale(loss) if scaler else loss).backward()
            rec["views"] = [(type(p.grad).__name__, tuple(p.grad.shape), p.grad.stride(), p.grad.dtype)
                            for p in model.parameters()]
            rec["scaled"] = _grads(opt, model)
            rec["local_scaled"] = _locals(opt, model)
            if scaler:
                scaler.unscale_(opt)
            rec["grads"] = _grads(opt, model)
            rec["lightning"] = None if grad_norm is None else {k: float(v) for k, v in grad_norm(model, 2).items()}
            rec["total"] = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
            rec["norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            rec["clipped"] = _grads(opt, model)
            rec["local_clipped"] = _locals(opt, model)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            rec["after_step"] = _grads(opt, model)
            opt.zero_grad()
        rec["after_zero"] = [p.grad is None for p in model.parameters()] + [opt.full_grad(p) is None
                                                                         for p in model.parameters()]
        rec["params"] = [p.detach().clone() for p in model.parameters()]
        rec["ref_params"] = [p.detach().clone() for p in ref.parameters()]
        rec["flat"] = [None if g is None else _memory_order(g) for g in rec["clipped"]]
        steps.append(rec)
    moved = _moved_at_the_end(model, ref, opt, ropt, scaler, rscaler, rank, world)
    return {"steps": steps, "moved": moved, "numel": [p.numel() for p in model.parameters()],
            "channels_last": [p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
                              for p in model.parameters() if p.dim() == 4]}
