"""Scaler/clipping cases, run inside one spawned gloo group per world size (test_scaler_loops.py)."""
from __future__ import annotations

import torch

from amp_loops import run_loop
from grad_reads import run_reads
from parity import MLP, batches
from shardamp.optim import DistributedFusedAdam, _compat
from shardamp.scaler import ShardedGradScaler


def case_loop_A(rank, world, **kw):
    return run_loop(rank, world, "A", **kw)


def case_loop_B(rank, world, **kw):
    return run_loop(rank, world, "B", **kw)


def case_loop_C(rank, world, **kw):
    return run_loop(rank, world, "C", **kw)


def case_loop_D(rank, world, **kw):
    return run_loop(rank, world, "D", **kw)


def case_loop_D_no_scaler(rank, world, **kw):
    return run_loop(rank, world, "D0", **kw)


def case_loop_E(rank, world, **kw):
    return run_loop(rank, world, "E", **kw)


def case_loop_F(rank, world, **kw):
    return run_loop(rank, world, "F", **kw)


def case_loop_G(rank, world, **kw):
    return run_loop(rank, world, "G", **kw)


def case_loop_Gf(rank, world, **kw):
    return run_loop(rank, world, "Gf", **kw)


def case_loop_H(rank, world, **kw):
    return run_loop(rank, world, "H", **kw)


def case_loop_H0(rank, world, **kw):
    return run_loop(rank, world, "H0", **kw)


def case_loop_I(rank, world, **kw):
    return run_loop(rank, world, "I", **kw)


def case_one_all_reduce(rank, world, **kw):
    """unscale_ + clip_grad_norm + step issue exactly one all-reduce (norm + found-inf + touched)."""
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.0004)
    scaler = ShardedGradScaler("cpu")
    calls = []
    original = _compat.all_reduce

    def counting(tensor, op, group, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, op, group, **kwargs)

    counts = []
    _compat.all_reduce = counting
    try:
        for step in range(3):
            x, y = batches(step, world)[rank]
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            calls.clear()
            scaler.unscale_(opt)
            opt.clip_grad_norm(1.0)
            scaler.step(opt)
            scaler.update()
            counts.append(list(calls))
            opt.zero_grad()
    finally:
        _compat.all_reduce = original
    from shardamp.optim.checks import agreement

    # the per-step agreement entries ride in the same all-reduce (no tensor lr here)
    entries = opt._fingerprint.length(len(agreement.host_categories(opt, 2.0)), 0)
    return {"counts": counts, "n_params": len(list(model.parameters())), "agreement_entries": entries}



def case_one_all_reduce_torch_clip(rank, world, **kw):
    """Loops F and I: torch.amp.GradScaler's unscale_ and torch's clip functions over the p.grad
    views, then step, issue exactly the one stats all-reduce (the clip reuses its norm)."""
    import warnings

    out = {}
    original = _compat.all_reduce
    for loop in ("F", "I"):
        torch.manual_seed(0)
        model = MLP()
        opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.0004)
        scaler = torch.amp.GradScaler("cpu")
        calls, counts = [], []

        def counting(tensor, op, group, **kwargs):
            calls.append(tensor.numel())
            return original(tensor, op, group, **kwargs)

        _compat.all_reduce = counting
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's hand-over to step(grad_scaler=)
                for step in range(3):
                    x, y = batches(step, world)[rank]
                    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
                    calls.clear()
                    scaler.unscale_(opt)
                    if loop == "F":
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    else:
                        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
                        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)
                    scaler.step(opt)
                    scaler.update()
                    counts.append(list(calls))
                    opt.zero_grad()
        finally:
            _compat.all_reduce = original
        out[loop] = counts
    return out


def case_grad_reads_fp32(rank, world, **kw):
    return run_reads(rank, world, "none")


def case_grad_reads_sharded_scaler(rank, world, **kw):
    return run_reads(rank, world, "sharded")


def case_grad_reads_torch_scaler(rank, world, **kw):
    return run_reads(rank, world, "torch")


def case_found_inf_is_exactly_one(rank, world, device="cpu", **kw):
    """Two ranks overflow at once: the found-inf handed to the scaler is 1.0, not a sum (2.0),
    since torch's fused kernels skip only on == 1."""
    torch.manual_seed(0)
    model = MLP().to(device)
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.0004)
    scaler = ShardedGradScaler(device)
    x, y = batches(0, world, device=device)[rank]
    if rank > 0:
        x = x.clone()
        x[0, 0] = float("nan") if rank == 1 else float("inf")
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    found = list(_compat.scaler_optimizer_state(scaler, opt)["found_inf_per_device"].values())
    return [(f.dtype, f.dim(), float(f)) for f in found]


def case_foreign_optimizer_agrees(rank, world, device="cpu", **kw):
    """ShardedGradScaler with an ordinary optimizer (torch AdamW on a replica): the found-inf of
    one rank is agreed over the scaler's process group, so every rank skips and backs off."""
    torch.manual_seed(0)
    model = MLP().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ShardedGradScaler(device, init_scale=2.0**10)
    scales = []
    for step in range(3):
        x, y = batches(step, world, device=device)[rank]
        if step == 1 and rank == world - 1:
            x = x.clone()
            x[0, 0] = float("inf")
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def case_norm_types(rank, world, device="cpu", opt_kwargs=None, **kw):
    """grad_norm for p = 1, 3 and inf (MAX all-reduce) against torch's clip_grad_norm_ on the
    unsharded grads, and clipping by the inf-norm matches torch's."""
    import copy

    import torch.nn as nn

    from parity import two_groups

    torch.manual_seed(0)
    model = MLP().to(device)
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=0.0004, **(opt_kwargs or {}))
    ropt = torch.optim.AdamW(two_groups(ref))
    out = {"ours": [], "ref": []}
    for step in range(3):
        data = batches(step, world, device=device)
        total = sum(nn.functional.mse_loss(ref(x), y) for x, y in data) / world
        total.backward()
        ref_norms = [float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], p)) for p in (1.0, 3.0)]
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type="inf")))
        ropt.step()
        ropt.zero_grad()
        x, y = data[rank]
        nn.functional.mse_loss(model(x), y).backward()
        ours = [float(opt.grad_norm(1.0)), float(opt.grad_norm(3.0)), float(opt.clip_grad_norm(0.05, norm_type=float("inf")))]
        opt.step()
        opt.zero_grad()
        out["ours"].append(ours)
        out["ref"].append(ref_norms)
    out["params"] = [p.detach().cpu() for p in model.parameters()]
    out["ref_params"] = [p.detach().cpu() for p in ref.parameters()]
    return out


CASES = [name for name in dir() if name.startswith("case_")]
