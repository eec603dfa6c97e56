"""Other wrappers around the model, on 2 gloo ranks (see test_wrappers.py):

* DDP around a DistributedFusedAdam's model, before or after building the optimizer: a clear
  error naming DDP and the fix, on every rank;
* FSDP2 (``fully_shard``) with ``torch.optim.AdamW`` (fused and foreach) and ShardedGradScaler,
  fp16 and bf16 autocast, an inf in one rank's grad shard only: both ranks skip that step and keep
  the same scale, and the model equals unsharded AdamW + torch.amp.GradScaler fed the union.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import framework_ref as ref

STEPS, BATCH, INF_STEP = 4, 4, 1


def _ddp_error(fn) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return ""


def case_ddp_after_optimizer(rank, world, **kw):
    from shardamp.optim import DistributedFusedAdam

    model = ref.make_model()
    opt = DistributedFusedAdam(model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model)

    def step():
        ref.loss_fn(ddp(torch.randn(4, ref.DIM)), torch.randn(4, ref.OUT)).backward()
        opt.step()

    return _ddp_error(step)


def case_ddp_before_optimizer(rank, world, **kw):
    from shardamp.optim import DistributedFusedAdam

    model = ref.make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    return _ddp_error(lambda: DistributedFusedAdam(ddp.parameters()))


def _fsdp2(rank, world, dtype, fused, unscale_and_clip, device="cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardamp.scaler import ShardedGradScaler

    mesh = init_device_mesh(device, (world,))
    model = ref.make_model().to(device)
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(ref.decay_groups(model), lr=ref.LR, betas=ref.BETAS, eps=ref.EPS,
                            fused=fused, foreach=None if fused else True)
    scaler = ShardedGradScaler(device, init_scale=2.0**10)
    x, y = ref.dataset(STEPS * world * BATCH)
    x, y = x.to(device), y.to(device)
    seen, scales, skipped, norms = [], [], [], []
    for step in range(STEPS):
        lo = (step * world + rank) * BATCH
        xb, yb = x[lo:lo + BATCH], y[lo:lo + BATCH]
        seen.append((xb.cpu(), yb.cpu()))
        opt.zero_grad()
        with torch.autocast(device, dtype=dtype):
            loss = ref.loss_fn(model(xb), yb)
        scaler.scale(loss).backward()
        if step == INF_STEP and rank == 0:
            with torch.no_grad():  # an inf in rank 0's shard only: rank 1's grads are all finite
                model.fc1.weight.grad.to_local()[0, 0] = float("inf")
        before = [p.to_local().clone() for p in model.parameters()]
        if unscale_and_clip:
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), ref.MAX_NORM).full_tensor()))
        scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters())))
        scales.append(float(scaler.get_scale()))
    return {"params": [p.full_tensor().cpu() for p in model.parameters()], "seen": seen, "scales": scales,
            "skipped": skipped, "norms": norms}


def case_fsdp2_fused_fp16(rank, world, device="cpu", **kw):
    return _fsdp2(rank, world, torch.float16, fused=True, unscale_and_clip=True, device=device)


def case_fsdp2_fused_fp16_step_only(rank, world, device="cpu", **kw):
    return _fsdp2(rank, world, torch.float16, fused=True, unscale_and_clip=False, device=device)


def case_fsdp2_foreach_fp16(rank, world, device="cpu", **kw):
    return _fsdp2(rank, world, torch.float16, fused=False, unscale_and_clip=True, device=device)


def case_fsdp2_fused_bf16(rank, world, device="cpu", **kw):
    return _fsdp2(rank, world, torch.bfloat16, fused=True, unscale_and_clip=True, device=device)


def case_fsdp2_foreach_bf16(rank, world, device="cpu", **kw):
    return _fsdp2(rank, world, torch.bfloat16, fused=False, unscale_and_clip=True, device=device)


CASES = [name for name in dir() if name.startswith("case_")]
FSDP2_CASES = [name for name in CASES if name.startswith("case_fsdp2")]
