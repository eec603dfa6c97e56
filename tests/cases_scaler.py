"""Scaler/clipping cases, run inside one spawned gloo group per world size (test_scaler_loops.py)."""
from __future__ import annotations

import torch

from amp_loops import run_loop
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


def case_one_all_reduce(rank, world, **kw):
    """unscale_ + clip_grad_norm + step issue exactly one all-reduce (norm + found-inf + touched)."""
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.0004)
    scaler = ShardedGradScaler("cpu")
    calls = []
    original = _compat.all_reduce

    def counting(tensor, op, group):
        calls.append(tensor.numel())
        return original(tensor, op, group)

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
    return {"counts": counts, "n_params": len(list(model.parameters()))}


CASES = [name for name in dir() if name.startswith("case_")]
