"""ShardampStrategy cases (``lightning.pytorch`` and the standalone ``pytorch_lightning``, a
LightningCLI run) and, imported from cases_fabric.py, ShardampFabricStrategy's: all run on 2
gloo ranks in one spawned group (see test_lightning.py).

The ranks are started by tests/dist_helper.py (process group already initialised, LOCAL_RANK
set, as torchrun would): Lightning's launcher then starts no processes and its DDP setup picks up
the existing group. examples/lightning_train.py shows Lightning's own launcher (devices=2).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

import framework_ref as ref
import fsspec_remote
from cases_fabric import *  # noqa: F401,F403  (the Fabric cases run in this group too)
from cases_fabric import FABRIC_CASES

N_STEPS, BATCH = 4, 4
# the Trainer package -> the shardamp module registering its strategy
PACKAGES = {"lightning.pytorch": "shardamp.integrations.lightning",
            "pytorch_lightning": "shardamp.integrations.pytorch_lightning"}


def lr_lambda(step: int) -> float:
    return 1.0 - step / 8.0


def make_module_class(pl: Any, accumulate: int = 1, schedule: bool = False, poison_step: Optional[int] = None,
                      opt_kwargs: Optional[Dict[str, Any]] = None):
    """A LightningModule of package ``pl`` over framework_ref's model, recording what each rank saw
    (``opt_kwargs``: more keyword arguments for its DistributedFusedAdam)."""
    from shardamp.optim import DistributedFusedAdam

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = ref.make_model()
            self.seen: List = []
            self.norms: List[float] = []
            self.skipped: List[bool] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.trainer.global_step == poison_step and self.global_rank == 0:
                x = x.clone()
                x[0, 0] = 1e6  # inf in fp16: an overflow on this rank only
            self.seen.append((x.clone(), y.clone()))
            return ref.loss_fn(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            opt = self.trainer.optimizers[0]
            if (batch_idx + 1) % accumulate == 0 and self.trainer.global_step > len(self.norms):
                self.norms.append(float(opt.grad_norm()))  # the norm that step used, cached
                scaler = getattr(self.trainer.precision_plugin, "scaler", None)
                if scaler is not None:
                    self.skipped.append(bool(scaler.last_step_skipped))

        def configure_optimizers(self):
            opt = DistributedFusedAdam(ref.decay_groups(self.net), lr=ref.LR, betas=ref.BETAS, eps=ref.EPS,
                                       bucket_cap_mb=0.0004, **(opt_kwargs or {}))
            if not schedule:
                return opt
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Module


def _fit(rank: int, world: int, pkg: str = "lightning.pytorch", strategy: Any = None, precision: str = "32-true",
         accumulate: int = 1, max_steps: int = N_STEPS, ckpt_dir: Optional[str] = None, top1_dir: Optional[str] = None,
         resume: Optional[str] = None, sharded: bool = False, schedule: bool = False,
         poison_step: Optional[int] = None, opt_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    pl = importlib.import_module(pkg)
    integration = importlib.import_module(PACKAGES[pkg])  # registers "shardamp" in pkg's StrategyRegistry
    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun: this process is one of `devices`

    x, y = ref.dataset(2 * world * BATCH * accumulate)  # two optimizer steps per epoch
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1,
                                                      filename="{step}"))
    if top1_dir is not None:  # keeps the latest only: removes the older checkpoint (and its shards)
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=top1_dir, every_n_train_steps=2, save_top_k=1,
                                                      filename="{step}", mode="max"))  # mode: a state key of its own
    module = make_module_class(pl, accumulate, schedule, poison_step, opt_kwargs)()
    plugins = []
    if precision == "16-mixed":  # on CPU the string turns into bf16-mixed; the plugin stays fp16
        plugins, precision = [importlib.import_module(f"{pkg}.plugins.precision").MixedPrecision("16-mixed", "cpu")], None
    trainer = pl.Trainer(
        plugins=plugins, strategy=strategy or integration.ShardampStrategy(sharded_checkpoint=sharded),
        accelerator="cpu", devices=world, precision=precision, gradient_clip_val=ref.MAX_NORM,
        accumulate_grad_batches=accumulate, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
    )
    trainer.fit(module, loader, ckpt_path=resume)
    return _result(trainer, module, ckpt_dir, top1_dir)


def _result(trainer: Any, module: Any, ckpt_dir: Optional[str] = None, top1_dir: Optional[str] = None) -> Dict[str, Any]:
    opt = trainer.optimizers[0]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if ckpt_dir is not None or top1_dir is not None:
        dist.barrier()  # rank 0 removes old checkpoints after the save, without a barrier of its own

    def listing(d: Optional[str]) -> List[str]:
        if d is None:
            return []
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(d)
        return sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)) if fs.isdir(path) else []

    params = [p.detach().clone() for p in module.net.parameters()]
    return {
        "params": params,
        "seen": module.seen,
        "norms": module.norms,
        "skipped": module.skipped,
        "opt": type(opt).__name__,
        "strategy": type(trainer.strategy).__module__ + "." + type(trainer.strategy).__name__,
        "wrapped": type(trainer.strategy.model).__name__,
        "scaler": type(scaler).__name__ if scaler is not None else None,
        "scale": float(scaler.get_scale()) if scaler is not None else None,
        "init_scale": 2.0 ** 16,  # torch.amp.GradScaler's default, which Lightning's plugin makes
        "world": opt.world_size,
        "buckets": len(opt._buckets),
        "moments": (opt.exp_avg_dtype, opt.exp_avg_sq_dtype),
        "ckpts": listing(ckpt_dir),
        "top1": listing(top1_dir),
        **_after_teardown(module),
    }


def _after_teardown(module: Any) -> Dict[str, Any]:
    """What fit's teardown left: no grads, and a module that moves and casts (Lightning's teardown
    moves it to the CPU; on the CPU a cast walks the grads the same way)."""
    grads_none = all(p.grad is None for p in module.net.parameters())
    try:
        module.net.to(torch.float64)
        moved = "ok"
    except RuntimeError as exc:
        moved = str(exc)[:200]
    return {"grads_none_after_fit": grads_none, "moves_after_fit": moved}


def _checkpoint(path: str) -> Dict[str, Any]:
    from fsspec.core import url_to_fs

    fs, p = url_to_fs(path)
    with fs.open(p, "rb") as f:
        return torch.load(f, weights_only=False)


# ---------------------------------------------------------------------- lightning.pytorch
def case_fp32_clip(rank, world, **kw):
    return _fit(rank, world, strategy="shardamp")  # the registered name


def case_lr_scheduler(rank, world, **kw):
    return _fit(rank, world, schedule=True)


def case_bf16_clip(rank, world, **kw):
    return _fit(rank, world, precision="bf16-mixed")


def case_fp16_sharded_scaler(rank, world, **kw):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _fit(rank, world, precision="16-mixed")
    out["warnings"] = [str(w.message) for w in caught if "DistributedFusedAdam" in str(w.message)]
    return out


def case_accumulate_no_sync(rank, world, **kw):
    return ref.count_reduce_scatters(lambda: _fit(rank, world, accumulate=3))


def case_checkpoint_resume(rank, world, tmp: str = "", **kw):
    full = _fit(rank, world, max_steps=N_STEPS, ckpt_dir=os.path.join(tmp, "pl_full"))
    resumed = _fit(rank, world, max_steps=N_STEPS, resume=os.path.join(tmp, "pl_full", "step=2.ckpt"))
    return {"full": full, "resumed": resumed}


def case_checkpoint_resume_sharded(rank, world, tmp: str = "", **kw):
    full = _fit(rank, world, max_steps=N_STEPS, ckpt_dir=os.path.join(tmp, "pl_dcp"),
                top1_dir=os.path.join(tmp, "pl_dcp_top1"), sharded=True)
    resumed = _fit(rank, world, max_steps=N_STEPS, resume=os.path.join(tmp, "pl_dcp", "step=2.ckpt"), sharded=True)
    entry = _checkpoint(os.path.join(tmp, "pl_dcp", "step=2.ckpt"))["optimizer_states"][0]
    return {"full": full, "resumed": resumed, "entry": entry}


def case_low_bit_checkpoint_resume_sharded(rank, world, tmp: str = "", **kw):
    """Blockwise moments chosen in configure_optimizers: accumulation, clipping, a sharded
    checkpoint (codes and scales per rank) and a resume from it."""
    formats = dict(exp_avg_dtype="4bit", exp_avg_sq_dtype="8bit")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the low-bit state dict's note for torch (test_low_bit.py)
        full = _fit(rank, world, max_steps=N_STEPS, accumulate=2, ckpt_dir=os.path.join(tmp, "pl_low_bit"),
                    sharded=True, opt_kwargs=formats)
        resumed = _fit(rank, world, max_steps=N_STEPS, accumulate=2,
                       resume=os.path.join(tmp, "pl_low_bit", "step=2.ckpt"), sharded=True, opt_kwargs=formats)
    return {"full": full, "resumed": resumed}


def case_checkpoint_sharded_url_moved_and_old_format(rank, world, tmp: str = "", **kw):
    """Sharded checkpoints at a remote URL (staged, uploaded by rank 0), resumed from a moved
    copy (through the remote URL and through a file:// URL), and from checkpoints in the format
    before (an absolute path): while that path exists, and once it is gone (moved)."""
    original, moved = os.path.join(tmp, "pl_url"), os.path.join(tmp, "pl_url_moved")
    full = _fit(rank, world, strategy="shardamp_sharded_checkpoint", ckpt_dir=fsspec_remote.url(original))
    dist.barrier()
    if rank == 0:
        shutil.copytree(original, moved)
        state = _checkpoint(os.path.join(moved, "step=2.ckpt"))
        state["optimizer_states"][0] = {"shardamp_dcp_dir": os.path.join(original, "step=2.ckpt.optim0")}
        torch.save(state, os.path.join(moved, "old.ckpt"))  # as the strategy wrote them before
    dist.barrier()
    resumed = {
        "remote": _fit(rank, world, resume=fsspec_remote.url(os.path.join(moved, "step=2.ckpt"))),
        "file_url": _fit(rank, world, resume="file://" + os.path.join(moved, "step=2.ckpt")),
        "old_format": _fit(rank, world, resume=os.path.join(moved, "old.ckpt")),
    }
    dist.barrier()
    if rank == 0:
        shutil.rmtree(original)
    dist.barrier()
    resumed["old_format_moved"] = _fit(rank, world, resume=os.path.join(moved, "old.ckpt"))
    entry = _checkpoint(os.path.join(moved, "step=2.ckpt"))["optimizer_states"][0]
    shard_files = sorted(os.listdir(os.path.join(moved, "step=2.ckpt.optim0")))
    return {"full": full, "resumed": resumed, "entry": entry, "shard_files": shard_files}


def _cli_module_class(pl: Any):
    from torch.utils.data import DataLoader, TensorDataset

    base = make_module_class(pl)

    class CliFitModule(base):
        def train_dataloader(self):
            x, y = ref.dataset(2 * self.trainer.world_size * BATCH)
            return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)

    return CliFitModule


def case_cli_fit_from_yaml(rank, world, tmp: str = "", **kw):
    """LightningCLI picks ``trainer: strategy: shardamp`` from a YAML config and trains."""
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    import shardamp.integrations.lightning  # noqa: F401  (registers "shardamp")

    os.environ["LOCAL_RANK"] = str(rank)
    config = os.path.join(tmp, f"cli_rank{rank}.yaml")
    with open(config, "w") as f:
        f.write(
            "trainer:\n"
            "  strategy: shardamp\n"
            "  accelerator: cpu\n"
            f"  devices: {world}\n"
            f"  max_steps: {N_STEPS}\n"
            f"  gradient_clip_val: {ref.MAX_NORM}\n"
            "  logger: false\n"
            "  enable_checkpointing: false\n"
            "  enable_progress_bar: false\n"
            "  enable_model_summary: false\n"
            f"  default_root_dir: {tmp}\n"
        )
    cli = LightningCLI(_cli_module_class(pl), args=["fit", "--config", config], save_config_callback=None,
                       seed_everything_default=False)
    return _result(cli.trainer, cli.model)


# ---------------------------------------------------------------------- pytorch_lightning
def case_pl_standalone_fp16_overflow(rank, world, **kw):
    return _fit(rank, world, pkg="pytorch_lightning", strategy="shardamp", precision="16-mixed", poison_step=1)


def case_pl_standalone_accumulate_sharded_resume(rank, world, tmp: str = "", **kw):
    ckpt_dir = os.path.join(tmp, "standalone_dcp")
    full = _fit(rank, world, pkg="pytorch_lightning", strategy="shardamp_sharded_checkpoint", accumulate=2,
                ckpt_dir=ckpt_dir)
    resumed = _fit(rank, world, pkg="pytorch_lightning", strategy="shardamp_sharded_checkpoint", accumulate=2,
                   resume=os.path.join(ckpt_dir, "step=2.ckpt"))
    return {"full": full, "resumed": resumed}


# cases needing a package the integration does not require (test_lightning.py skips their tests)
NEEDS = {"case_cli_fit_from_yaml": "jsonargparse", "case_pl_standalone_fp16_overflow": "pytorch_lightning",
         "case_pl_standalone_accumulate_sharded_resume": "pytorch_lightning",
         "case_fabric_standalone_fp16_overflow": "lightning_fabric"}
CASES = [name for name in [n for n in dir() if n.startswith("case_") and n not in FABRIC_CASES] + FABRIC_CASES
         if name not in NEEDS or importlib.util.find_spec(NEEDS[name]) is not None]
