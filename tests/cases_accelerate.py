"""ShardampAccelerator cases, run on 2 gloo ranks in one spawned group (see test_accelerate.py).

The ranks come from tests/dist_helper.py with the process group initialised and torchrun's
environment variables set; accelerate's state picks up the existing group. The loop is
accelerate's documented one: prepare, accumulate, backward, clip_grad_norm_, step, zero_grad.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Optional

import torch

import framework_ref as ref

N_STEPS, BATCH = 4, 4


def _env(rank: int, world: int) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # one Accelerator configuration per case in this process
    GradientState._reset_state()


def _train(rank: int, world: int, mixed_precision: str = "no", accumulate: int = 1, steps: int = N_STEPS,
           save: Optional[str] = None, load: Optional[str] = None, skip_steps: int = 0,
           poison_step: Optional[int] = None, skip_above: Optional[float] = None,
           **opt_kwargs: Any) -> Dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    from shardamp.integrations.accelerate import ShardampAccelerator
    from shardamp.optim import DistributedFusedAdam

    _env(rank, world)
    acc = ShardampAccelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=accumulate, cpu=True)
    if mixed_precision == "fp16":
        # accelerate applies no fp16 on the CPU; switch on its CUDA fp16 path (autocast + a torch
        # GradScaler that prepare must replace) as Accelerator.__init__ does on a GPU
        acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu")
    model = ref.make_model()
    opt = DistributedFusedAdam(ref.decay_groups(model), lr=ref.LR, betas=ref.BETAS, eps=ref.EPS,
                               bucket_cap_mb=0.0004, skip_grad_norm_above=skip_above, **opt_kwargs)
    initial = [p.detach().clone() for p in model.parameters()]
    x, y = ref.dataset(N_STEPS * world * BATCH * accumulate)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    # with spike skips: a prepared LR scheduler, which accelerate advances only after steps not skipped
    sched = None if skip_above is None else torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    if sched is None:
        model, opt, loader = acc.prepare(model, opt, loader)
    else:
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    if load is not None:
        acc.load_state(load)
        loader = acc.skip_first_batches(loader, skip_steps * accumulate)
    seen, norms, skipped, reduce_scatters = [], [], [], 0
    done = skip_steps
    for xb, yb in loader:
        if done == poison_step and rank == 0:
            xb = xb.clone()
            xb[0, 0] = 1e6  # inf in fp16: an overflow on this rank only
        with acc.accumulate(model):
            seen.append((xb.clone(), yb.clone()))
            loss = ref.loss_fn(model(xb), yb)
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), ref.MAX_NORM)))
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            skipped.append(acc.optimizer_step_was_skipped)
            done += 1
            if save is not None and done == N_STEPS // 2:
                acc.save_state(save)
            if done == steps:
                break
    inner = opt.optimizer
    return {
        "params": [p.detach().clone() for p in model.parameters()], "initial": initial,
        "lr": [g["lr"] for g in opt.param_groups],
        "seen": seen, "norms": norms, "skipped": skipped, "wrapped": type(model).__name__,
        "scaler": type(acc.scaler).__name__ if acc.scaler is not None else None,
        "world": inner.world_size, "buckets": len(inner._buckets),
        "files": sorted(os.listdir(save)) if save is not None else [],
        "moments": (inner.exp_avg_dtype, inner.exp_avg_sq_dtype),
    }


def case_fp32_clip(rank, world, **kw):
    return _train(rank, world)


def case_bf16_clip(rank, world, **kw):
    return _train(rank, world, mixed_precision="bf16")


def case_fp16_sharded_grad_scaler(rank, world, **kw):
    return _train(rank, world, mixed_precision="fp16", poison_step=1)


def case_spike_skips_are_skipped_steps(rank, world, **kw):
    """skip_grad_norm_above below every step's norm: accelerate sees each step skipped (the LR
    scheduler does not advance) and the params never move."""
    return _train(rank, world, mixed_precision="bf16", skip_above=1e-6)


def case_accumulate_no_sync(rank, world, **kw):
    return ref.count_reduce_scatters(lambda: _train(rank, world, accumulate=3))


def case_save_load_state(rank, world, tmp: str = "", **kw):
    path = os.path.join(tmp, "acc_state")
    full = _train(rank, world, mixed_precision="bf16", save=path)
    resumed = _train(rank, world, mixed_precision="bf16", load=path, skip_steps=N_STEPS // 2)
    return {"full": full, "resumed": resumed}


def case_low_bit_accumulate_save_load_state(rank, world, tmp: str = "", **kw):
    """Blockwise moments chosen through the optimizer's kwargs: accumulation under no_sync, clip,
    save_state half-way, load_state and resume."""
    path = os.path.join(tmp, "acc_state_low_bit")
    formats = dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the low-bit state dict's note for torch (test_low_bit.py)
        full = _train(rank, world, accumulate=2, save=path, **formats)
        resumed = _train(rank, world, accumulate=2, load=path, skip_steps=N_STEPS // 2, **formats)
    return {"full": full, "resumed": resumed}


def case_plain_accelerator_is_unchanged_for_torch_optimizers(rank, world, **kw):
    """Another optimizer: ShardampAccelerator wraps in DDP and clips param.grad as Accelerator."""
    from torch.utils.data import DataLoader, TensorDataset

    from shardamp.integrations.accelerate import ShardampAccelerator

    _env(rank, world)
    acc = ShardampAccelerator(cpu=True)
    model = ref.make_model()
    opt = torch.optim.AdamW(ref.decay_groups(model), lr=ref.LR, betas=ref.BETAS, eps=ref.EPS)
    x, y = ref.dataset(N_STEPS * world * BATCH)
    model, opt, loader = acc.prepare(model, opt, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    seen, norms = [], []
    for xb, yb in loader:
        seen.append((xb.clone(), yb.clone()))
        acc.backward(ref.loss_fn(model(xb), yb))
        norms.append(float(acc.clip_grad_norm_(model.parameters(), ref.MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in acc.unwrap_model(model).parameters()], "seen": seen,
            "norms": norms, "wrapped": type(model).__name__}


def case_model_not_prepared_raises(rank, world, **kw):
    from shardamp.integrations.accelerate import ShardampAccelerator
    from shardamp.optim import DistributedFusedAdam

    _env(rank, world)
    acc = ShardampAccelerator(cpu=True, mixed_precision="bf16")
    model = ref.make_model()
    opt = DistributedFusedAdam(model.parameters())
    try:
        acc.prepare(opt)
    except ValueError as e:
        return str(e)
    return None


def case_ddp_kwargs_handler_raises_for_distributed_fused_adam_only(rank, world, **kw):
    """The user's DistributedDataParallelKwargs: refused for a DistributedFusedAdam's model, which
    is never DDP-wrapped; applied, as by Accelerator, to a torch optimizer's DDP-wrapped model."""
    from accelerate.utils import DistributedDataParallelKwargs

    from shardamp.integrations.accelerate import ShardampAccelerator
    from shardamp.optim import DistributedFusedAdam

    def accelerator():
        _env(rank, world)
        handler = DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=5)
        return ShardampAccelerator(cpu=True, kwargs_handlers=[handler])

    model = ref.make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=ref.LR)
    try:
        accelerator().prepare(model, opt)
        message = None
    except ValueError as e:
        message = str(e)
    model = ref.make_model()
    wrapped, _ = accelerator().prepare(model, torch.optim.AdamW(model.parameters(), lr=ref.LR))
    return {"message": message, "wrapped": type(wrapped).__name__,
            "find_unused_parameters": wrapped.find_unused_parameters, "bucket_bytes_cap": wrapped.bucket_bytes_cap}


def case_sharding_setups_refuse_distributed_fused_adam(rank, world, **kw):
    """Distributed types and parallelism configs whose engine takes over the model, and NO while
    the optimizer spans both ranks: prepare raises before preparing anything (each stands in through a subclass overriding the one
    property that selects it, on an accelerator built as MULTI_CPU)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from shardamp.integrations.accelerate import ShardampAccelerator
    from shardamp.optim import DistributedFusedAdam

    model = ref.make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=ref.LR)
    setups = {dt.value: {"distributed_type": dt} for dt in (
        DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA,
        DistributedType.NO)}  # NO: what a MULTI_GPU launch gives every rank where no GPU is visible
    setups["tp"] = {"parallelism_config": SimpleNamespace(dp_replicate_size=1, dp_shard_size=1, tp_size=2, cp_size=1,
                                                          sp_size=1)}
    setups["dp_shard"] = {"parallelism_config": SimpleNamespace(dp_replicate_size=1, dp_shard_size=2, tp_size=1,
                                                                cp_size=1, sp_size=1)}
    messages = {}
    for name, attrs in setups.items():
        _env(rank, world)
        acc = ShardampAccelerator(cpu=True)
        acc.__class__ = type("Faked", (ShardampAccelerator,), attrs)
        try:
            acc.prepare(model, opt)
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
        messages[name + " prepared"] = len(acc._models) + len(acc._optimizers)
    return messages


CASES = [name for name in dir() if name.startswith("case_")]
