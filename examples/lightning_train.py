"""PyTorch Lightning + shardamp: ``strategy="shardamp"`` is the one changed line (importing
``shardamp.integrations.lightning`` registers the name; ``strategy=ShardampStrategy(...)`` takes
its options as arguments).

    python examples/lightning_train.py                       # 2 CPU ranks (gloo), Lightning's launcher
    python examples/lightning_train.py --device cuda         # the visible GPUs (NCCL), bf16
    python examples/lightning_train.py --device cuda --precision fp16
    python examples/lightning_train.py --strategy-name shardamp_sharded_checkpoint   # per-rank optimizer shards

Trains a small MLP with gradient_clip_val, accumulate_grad_batches and a ModelCheckpoint, checks
the result against unsharded torch.optim.AdamW, then times the same run with Lightning's default
(DDP + torch AdamW, fused on CUDA). See examples/framework_common.py for what is compared.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import framework_common as common
import shardamp.integrations.lightning  # noqa: F401  (registers strategy="shardamp" and its variants)
from shardamp.optim import DistributedFusedAdam

# the registered names this script can run: Lightning's own launcher starts a script per rank
# (popen); the spawn/fork variants would train in child processes this script cannot read back
STRATEGY_NAMES = ("shardamp", "shardamp_sharded_checkpoint")


class Indexed(Dataset):
    def __init__(self, args) -> None:
        self.x, self.y = common.data(args)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return torch.tensor(i), self.x[i], self.y[i]


class Module(pl.LightningModule):
    def __init__(self, args, shardamp: bool) -> None:
        super().__init__()
        self.args, self.shardamp = args, shardamp
        self.net = common.make_model(args)
        self.seen: List[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.seen.append(idx)
        return common.loss_fn(self.net(x), y)

    def configure_optimizers(self):
        groups = common.decay_groups(self.net)
        kw = dict(lr=common.LR, betas=common.BETAS, eps=common.EPS)
        if self.shardamp:
            return DistributedFusedAdam(groups, **kw)
        return torch.optim.AdamW(groups, fused=self.args.device == "cuda", **kw)


class Timer(pl.Callback):
    """Runs before ModelCheckpoint (Lightning orders checkpoint callbacks last): saves are not timed."""

    def __init__(self, args) -> None:
        self.args, self.timer, self.snapshots = args, common.StepTimer(args), common.Snapshots()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % self.args.accumulate == 0:
            self.timer.step_done(trainer.global_step)
            self.snapshots.step_done(trainer.global_step, module.net.parameters())


def fit(args, shardamp: bool) -> Dict[str, Any]:
    precision = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[args.precision]
    plugins = []
    if args.precision == "fp16" and args.device == "cpu":  # the string would turn into bf16 on CPU
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins, precision = [MixedPrecision("16-mixed", "cpu")], None
    clip = args.max_grad_norm
    if not shardamp and args.precision != "fp32" and args.device == "cuda":
        clip = None  # Lightning refuses to clip a fused optimizer under AMP: the default runs unclipped
    module, timer = Module(args, shardamp), Timer(args)
    ckpt_dir = os.path.join(args.out, "shardamp" if shardamp else "default")
    trainer = pl.Trainer(
        strategy=args.strategy_name if shardamp else ("ddp" if args.world_size > 1 else "auto"),
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=args.world_size,
        precision=precision, plugins=plugins, gradient_clip_val=clip, accumulate_grad_batches=args.accumulate,
        max_steps=args.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer, pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.steps, save_top_k=1)],
    )
    trainer.fit(module, DataLoader(Indexed(args), batch_size=args.batch_size, shuffle=False))
    return {"params": list(module.net.parameters()), "seen": module.seen, "ms": timer.timer.ms,
            "snapshots": timer.snapshots.params,
            "ckpts": os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy-name", choices=STRATEGY_NAMES, default="shardamp",
                   help="Trainer(strategy=NAME); shardamp_sharded_checkpoint: each rank writes its optimizer shard "
                        "beside the checkpoint file")


def main() -> None:
    args = common.start(__doc__.splitlines()[0], torchrun=False, add_args=add_args)
    ours = fit(args, shardamp=True)
    ok = common.report_parity(args, f"Lightning strategy={args.strategy_name!r}", ours["params"], ours["seen"],
                              snapshots=ours["snapshots"])
    if common.rank() == 0:
        print(f"checkpoint written by ModelCheckpoint: {sorted(ours['ckpts'])}", flush=True)
    common.finish(args, "Lightning", ours["ms"], lambda: fit(args, shardamp=False)["ms"], ok)


if __name__ == "__main__":
    main()
