"""ShardampFabricStrategy cases (``lightning.fabric`` and the standalone ``lightning_fabric``),
run in the same spawned 2-rank group as the Trainer's (cases_lightning.py imports them; checked
in test_lightning.py).

The loop is Fabric's documented one: launch, setup, setup_dataloaders, no_backward_sync,
backward, clip_gradients, step, zero_grad, save/load. The ranks come from tests/dist_helper.py
with the process group initialised and LOCAL_RANK set: Fabric starts no processes.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

import framework_ref as ref
import fsspec_remote

N_STEPS, BATCH = 4, 4
FP16_INIT_SCALE = 2.0 ** 14


def _train(rank: int, world: int, pkg: str = "lightning", strategy: Any = "shardamp", fp16: bool = False,
           precision: Optional[str] = None, accumulate: int = 1, steps: int = N_STEPS, save: Optional[str] = None,
           load: Optional[str] = None, poison_step: Optional[int] = None) -> Dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    from shardamp.optim import DistributedFusedAdam

    if pkg == "lightning":
        from lightning.fabric import Fabric
        from lightning.fabric.plugins.precision import MixedPrecision

        import shardamp.integrations.lightning  # noqa: F401  (registers "shardamp" in lightning.fabric)
    else:
        from lightning_fabric import Fabric
        from lightning_fabric.plugins.precision import MixedPrecision

        import shardamp.integrations.lightning_fabric  # noqa: F401

    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun: this process is one of `devices`
    # on CPU the string "16-mixed" turns into bf16-mixed; the plugin stays fp16, its torch GradScaler
    # (settings carried over to the ShardedGradScaler) starting lower than torch's default: a rank's
    # fp16 bias grad of its whole mean loss would overflow at 2**16 where the union's half does not
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE))] if fp16 else None
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world, precision=precision, plugins=plugins)
    fabric.launch()
    model = ref.make_model()
    opt = DistributedFusedAdam(ref.decay_groups(model), lr=ref.LR, betas=ref.BETAS, eps=ref.EPS, bucket_cap_mb=0.0004)
    model, opt = fabric.setup(model, opt)
    x, y = ref.dataset(N_STEPS * world * BATCH * accumulate)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False))
    done = 0
    if load is not None:
        done = fabric.load(load, {"model": model, "optimizer": opt})["step"]
    scaler = getattr(fabric.strategy.precision, "scaler", None)
    seen: List = []
    norms: List[float] = []
    skipped: List[bool] = []
    for i, (xb, yb) in enumerate(loader):
        if i < done * accumulate:
            continue  # resumed: these micro-batches were trained before the save
        if done == poison_step and rank == 0:
            xb = xb.clone()
            xb[0, 0] = 1e6  # inf in fp16: an overflow on this rank only
        last = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            seen.append((xb.clone(), yb.clone()))
            fabric.backward(ref.loss_fn(model(xb), yb) / accumulate)
        if not last:
            continue
        norms.append(float(fabric.clip_gradients(model, opt, max_norm=ref.MAX_NORM)))
        opt.step()
        opt.zero_grad()
        if scaler is not None:
            skipped.append(bool(scaler.last_step_skipped))
        done += 1
        if save is not None and done == N_STEPS // 2:
            fabric.save(save, {"model": model, "optimizer": opt, "step": done})
        if done == steps:
            break
    inner = opt.optimizer
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "seen": seen, "norms": norms, "skipped": skipped,
        "strategy": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__,
        "wrapped": type(model._forward_module).__name__,
        "scaler": type(scaler).__name__ if scaler is not None else None,
        "scale": float(scaler.get_scale()) if scaler is not None else None,
        "init_scale": FP16_INIT_SCALE if fp16 else None,
        "world": inner.world_size, "buckets": len(inner._buckets),
    }


def case_fabric_fp32_clip(rank, world, **kw):
    return _train(rank, world)


def case_fabric_standalone_fp16_overflow(rank, world, **kw):
    return _train(rank, world, pkg="lightning_fabric", fp16=True, poison_step=1)


def case_fabric_accumulate_no_sync(rank, world, **kw):
    return ref.count_reduce_scatters(lambda: _train(rank, world, accumulate=3))


def _read(path: str) -> Dict[str, Any]:
    from fsspec.core import url_to_fs

    fs, p = url_to_fs(path)
    with fs.open(p, "rb") as f:
        return torch.load(f, weights_only=False)


def case_fabric_save_load(rank, world, tmp: str = "", **kw):
    """A full state in the file (rank 0 writes it), then sharded through a remote URL: both
    resume exactly where the uninterrupted run went."""
    from shardamp.integrations.lightning import ShardampFabricStrategy

    full_path = os.path.join(tmp, "fabric", "full.ckpt")
    remote = fsspec_remote.url(os.path.join(tmp, "fabric_remote", "state.ckpt"))
    full = _train(rank, world, save=full_path)
    resumed = _train(rank, world, load=full_path)
    _train(rank, world, strategy="shardamp_sharded_checkpoint", steps=N_STEPS // 2, save=remote)
    # a plain strategy reads the sharded format too: loading follows the file
    resumed_remote = _train(rank, world, strategy=ShardampFabricStrategy(), load=remote)
    out: Dict[str, Any] = {"full": full, "resumed": resumed, "resumed_remote": resumed_remote}
    dist.barrier()
    if rank == 0:
        file_state = _read(full_path)
        out["file_optimizer_params"] = sorted(file_state["optimizer"]["state"])
        out["file_step"] = file_state["step"]
        out["remote_entry"] = _read(remote)["optimizer"]
        out["remote_files"] = sorted(os.listdir(os.path.join(tmp, "fabric_remote")))
        out["shard_files"] = sorted(os.listdir(os.path.join(tmp, "fabric_remote", "state.ckpt.optimizer")))
    return out


def case_fabric_staging_dir_not_shared_raises(rank, world, tmp: str = "", **kw):
    """Rank 1 cannot see the staging directory rank 0 made (simulated: on one machine it always
    can): every rank raises, nothing is written at the URL, the staging directory is removed."""
    from shardamp.integrations import _sharded_checkpoint

    stage = os.path.join(tmp, "fabric_stage")
    os.makedirs(stage, exist_ok=True)
    remote_dir = os.path.join(tmp, "fabric_unshared")
    visible = _sharded_checkpoint._visible
    if rank == 1:
        _sharded_checkpoint._visible = lambda path: False
    from shardamp.integrations.lightning import ShardampFabricStrategy

    try:
        _train(rank, world, strategy=ShardampFabricStrategy(sharded_checkpoint=True, staging_dir=stage),
               steps=N_STEPS // 2, save=fsspec_remote.url(os.path.join(remote_dir, "state.ckpt")))
    except RuntimeError as exc:
        error = str(exc)
    else:
        error = None
    finally:
        _sharded_checkpoint._visible = visible
    dist.barrier()
    return {"error": error, "written": sorted(os.listdir(remote_dir)) if os.path.isdir(remote_dir) else [],
            "stage_left": sorted(os.listdir(stage))}


FABRIC_CASES = [name for name in dir() if name.startswith("case_fabric")]
