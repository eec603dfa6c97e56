"""Hugging Face accelerate + shardamp: ``ShardampAccelerator`` instead of ``Accelerator`` is the
one changed line (plus building a DistributedFusedAdam instead of torch's AdamW).

    python examples/accelerate_train.py                      # 2 CPU ranks, launched through torchrun
    torchrun --nproc-per-node 2 examples/accelerate_train.py # the same, launched by hand
    python examples/accelerate_train.py --device cuda --precision fp16   # GPUs (NCCL)

accelerate's documented loop (prepare, accumulate, backward, clip_grad_norm_, step, zero_grad,
save_state), checked against unsharded torch.optim.AdamW and timed against the same loop with
``Accelerator`` + torch AdamW (fused on CUDA, DDP-wrapped by prepare). See framework_common.py.
"""
from __future__ import annotations

import os
from typing import Any, Dict

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import framework_common as common
from shardamp.integrations.accelerate import ShardampAccelerator
from shardamp.optim import DistributedFusedAdam


def train(args, shardamp: bool) -> Dict[str, Any]:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # a second Accelerator configuration in this process
    GradientState._reset_state()
    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[args.precision]
    cls = ShardampAccelerator if shardamp else Accelerator
    acc = cls(mixed_precision=mixed, gradient_accumulation_steps=args.accumulate, cpu=args.device == "cpu")
    model = common.make_model(args).to(acc.device)  # on its device before the optimizer is built
    kw = dict(lr=common.LR, betas=common.BETAS, eps=common.EPS)
    if shardamp:
        opt = DistributedFusedAdam(common.decay_groups(model), **kw)
    else:
        opt = torch.optim.AdamW(common.decay_groups(model), fused=args.device == "cuda", **kw)
    x, y = common.data(args)
    loader = DataLoader(TensorDataset(torch.arange(len(x)), x, y), batch_size=args.batch_size, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    timer, snapshots, seen, norms, steps = common.StepTimer(args), common.Snapshots(), [], [], 0
    for idx, xb, yb in loader:
        with acc.accumulate(model):
            seen.append(idx)
            acc.backward(common.loss_fn(model(xb), yb))
            if acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), args.max_grad_norm))
            opt.step()
            opt.zero_grad()
        if acc.sync_gradients:
            steps += 1
            timer.step_done(steps)
            snapshots.step_done(steps, acc.unwrap_model(model).parameters())
            if steps == args.steps:
                break
    path = os.path.join(args.out, "shardamp" if shardamp else "default")
    acc.save_state(path)  # model weights (safetensors), optimizer (every rank), RNG
    files = sorted(os.listdir(path)) if acc.is_main_process else []
    return {"params": list(acc.unwrap_model(model).parameters()), "seen": seen,
            "norms": [float(n) for n in norms], "ms": timer.ms, "files": files,
            "snapshots": snapshots.params}


def main() -> None:
    args = common.start(__doc__.splitlines()[0], torchrun=True)
    ours = train(args, shardamp=True)
    ok = common.report_parity(args, "accelerate ShardampAccelerator", ours["params"], ours["seen"], ours["norms"],
                              ours["snapshots"])
    if common.rank() == 0:
        print(f"save_state wrote: {ours['files']}", flush=True)
    common.finish(args, "accelerate", ours["ms"], lambda: train(args, shardamp=False)["ms"], ok)


if __name__ == "__main__":
    main()
