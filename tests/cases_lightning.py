"""ShardampStrategy cases, run on 2 gloo ranks in one spawned group (see test_lightning.py).

The ranks are started by tests/dist_helper.py (process group already initialised, LOCAL_RANK
set, as torchrun would): Lightning's launcher then starts no processes and its DDP setup picks up
the existing group. examples/lightning_train.py shows Lightning's own launcher (devices=2).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch

import framework_ref as ref

N_STEPS, BATCH = 4, 4


def lr_lambda(step: int) -> float:
    return 1.0 - step / 8.0


def _fit(rank: int, world: int, precision: str = "32-true", accumulate: int = 1, max_steps: int = N_STEPS,
         ckpt_dir: Optional[str] = None, resume: Optional[str] = None, sharded: bool = False,
         schedule: bool = False) -> Dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from shardamp.integrations.lightning import ShardampStrategy
    from shardamp.optim import DistributedFusedAdam

    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun: this process is one of `devices`

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = ref.make_model()
            self.seen: List = []
            self.norms: List[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen.append((x.clone(), y.clone()))
            return ref.loss_fn(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            opt = self.trainer.optimizers[0]
            if (batch_idx + 1) % accumulate == 0 and self.trainer.global_step > len(self.norms):
                self.norms.append(float(opt.grad_norm()))  # the norm that step used, cached

        def configure_optimizers(self):
            opt = DistributedFusedAdam(ref.decay_groups(self.net), lr=ref.LR, betas=ref.BETAS, eps=ref.EPS,
                                       bucket_cap_mb=0.0004)
            if not schedule:
                return opt
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    x, y = ref.dataset(2 * world * BATCH * accumulate)  # two optimizer steps per epoch
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1,
                                                      filename="{step}"))
    module = Module()
    plugins = []
    if precision == "16-mixed":  # on CPU the string turns into bf16-mixed; the plugin stays fp16
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins, precision = [MixedPrecision("16-mixed", "cpu")], None
    trainer = pl.Trainer(
        plugins=plugins, strategy=ShardampStrategy(sharded_checkpoint=sharded), accelerator="cpu", devices=world,
        precision=precision, gradient_clip_val=ref.MAX_NORM, accumulate_grad_batches=accumulate,
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=ckpt_dir is not None, callbacks=callbacks,
    )
    trainer.fit(module, loader, ckpt_path=resume)
    opt = trainer.optimizers[0]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "params": [p.detach().clone() for p in module.net.parameters()],
        "seen": module.seen,
        "norms": module.norms,
        "opt": type(opt).__name__,
        "wrapped": type(trainer.strategy.model).__name__,
        "scaler": type(scaler).__name__ if scaler is not None else None,
        "world": opt.world_size,
        "buckets": len(opt._buckets),
        "ckpts": sorted(os.listdir(ckpt_dir)) if ckpt_dir is not None and os.path.isdir(ckpt_dir) else [],
    }


def case_fp32_clip(rank, world, **kw):
    return _fit(rank, world)


def case_lr_scheduler(rank, world, **kw):
    return _fit(rank, world, schedule=True)


def case_bf16_clip(rank, world, **kw):
    return _fit(rank, world, precision="bf16-mixed")


def case_fp16_sharded_scaler(rank, world, **kw):
    return _fit(rank, world, precision="16-mixed")


def case_accumulate_no_sync(rank, world, **kw):
    return ref.count_reduce_scatters(lambda: _fit(rank, world, accumulate=3))


def case_checkpoint_resume(rank, world, tmp: str = "", **kw):
    full = _fit(rank, world, max_steps=N_STEPS, ckpt_dir=os.path.join(tmp, "pl_full"))
    resumed = _fit(rank, world, max_steps=N_STEPS, resume=os.path.join(tmp, "pl_full", "step=2.ckpt"))
    return {"full": full, "resumed": resumed}


def case_checkpoint_resume_sharded(rank, world, tmp: str = "", **kw):
    full = _fit(rank, world, max_steps=N_STEPS, ckpt_dir=os.path.join(tmp, "pl_dcp"), sharded=True)
    resumed = _fit(rank, world, max_steps=N_STEPS, resume=os.path.join(tmp, "pl_dcp", "step=2.ckpt"), sharded=True)
    return {"full": full, "resumed": resumed}


CASES = [name for name in dir() if name.startswith("case_")]
