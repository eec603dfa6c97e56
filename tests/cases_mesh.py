"""Hybrid sharding over a DeviceMesh: cases for ONE spawned group of 4 gloo ranks
(tests/test_mesh.py), each case run for every mesh shape: 1x4 (flat, as a 2-D mesh), 2x2
(replicate 2, shard 2), 4x1 (pure replication) and the 1-D mesh of 4.

Every parity case compares with unsharded torch fed the union of all 4 ranks' batches, with
two param groups, tiny buckets (uneven shards) and an inf on one rank only (the AMP loops).
``run`` also saves a checkpoint on 2x2 and loads it on every other shape; the test loads it
once more at world 1 in its own process. Last, ``offload="cpu"`` on the 2x2 mesh against the same
runs without offload (``offload_cases``).
"""
from __future__ import annotations

import os
import traceback
import warnings
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

import cases_checkpoint as cc
from amp_loops import run_loop
from parity import train
from shardamp.optim import DistributedFusedAdam, _compat
from shardamp.optim.checkpoint import load_sharded, save_sharded
from shardamp.scaler import ShardedGradScaler

WORLD = 4
SHAPES: List[Tuple[int, ...]] = [(1, 4), (2, 2), (4, 1), (4,)]
PER_STEP = 12  # samples per checkpoint step: divisible by 4 and by 1
LOOPS = ("A", "B", "C", "D", "E")
LOW_BIT_LOOPS = ("B", "D")


def shape_name(shape: Tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if len(shape) == 2 else f"1d{shape[0]}"


def mesh_of(shape: Tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _skip(step: int, r: int):
    # rank 0 never uses b, the others alternate c: different buckets fill on different ranks
    if r == 0:
        return ("b",)
    return ("c",) if (step + r) % 2 else ()


class StatsHookAdam(DistributedFusedAdam):
    """The NeMo-style extension point: ``_reduce_grad_stats`` overridden, calling super()."""

    calls: List[Tuple[str, int]]

    def _reduce_grad_stats(self, stats, op):
        super()._reduce_grad_stats(stats, op)
        self.calls = getattr(self, "calls", []) + [(str(op), stats.numel())]


def case_parity(rank: int, world: int, mesh) -> Dict[str, Any]:
    """Plain training, unused params per rank, averaged grads: torch AdamW's params."""
    return train(rank, world, steps=5, skip=_skip, opt_kwargs=dict(device_mesh=mesh, bucket_cap_mb=cc.TINY))


def case_parity_sum_micro(rank: int, world: int, mesh) -> Dict[str, Any]:
    """Summed grads (average_grad_sync=False), two micro-batches under no_sync, params in flight
    after the step (overlap_param_sync)."""
    return train(rank, world, steps=4, micro_batches=2, sum_grads=True,
                 opt_kwargs=dict(device_mesh=mesh, bucket_cap_mb=cc.TINY, average_grad_sync=False,
                                 overlap_param_sync=True))


def case_parity_reduce_each_micro(rank: int, world: int, mesh) -> Dict[str, Any]:
    """Three backwards per step, each reduced (reduce-scatter, then the replicas' all-reduce):
    the reduced shards accumulate, as param.grad does in torch."""
    return train(rank, world, steps=3, micro_batches=3, reduce_each_micro=True, skip=_skip,
                 opt_kwargs=dict(device_mesh=mesh, bucket_cap_mb=cc.TINY))


def case_parity_capturable_no_overlap(rank: int, world: int, mesh) -> Dict[str, Any]:
    """Grads reduced at step (overlap_grad_sync=False), buffers kept (capturable), two reduced
    micro-batches."""
    return train(rank, world, steps=3, micro_batches=2, reduce_each_micro=True,
                 opt_kwargs=dict(device_mesh=mesh, bucket_cap_mb=cc.TINY, overlap_grad_sync=False,
                                 capturable=True))


def case_loops(rank: int, world: int, mesh) -> Dict[str, Any]:
    """The AMP loops (amp_loops.py), an inf on the last rank only at INF_STEP."""
    return {loop: run_loop(rank, world, loop, device_mesh=mesh) for loop in LOOPS}


def case_parity_low_bit(rank: int, world: int, mesh) -> Dict[str, Any]:
    """Blockwise moments (8-bit exp_avg, 4-bit exp_avg_sq), unused params per rank, two
    micro-batches under no_sync: the same quantized math unsharded (tests/low_bit_reference.py)."""
    return train(rank, world, steps=4, micro_batches=2, skip=_skip,
                 opt_kwargs=dict(device_mesh=mesh, bucket_cap_mb=cc.TINY, exp_avg_dtype="8bit",
                                 exp_avg_sq_dtype="4bit"))


def case_loops_low_bit(rank: int, world: int, mesh) -> Dict[str, Any]:
    """Loops B and D with 4-bit / 8-bit moments, an inf on the last rank only."""
    return {loop: run_loop(rank, world, loop, device_mesh=mesh, exp_avg_dtype="4bit", exp_avg_sq_dtype="8bit")
            for loop in LOW_BIT_LOOPS}


def case_collectives(rank: int, world: int, mesh) -> Dict[str, Any]:
    """Per step: exactly one stats all-reduce (over all 4 ranks), one replica all-reduce per
    bucket when there are replicas; the subclass hook sees every stats reduction."""
    from parity import MLP, batches, two_groups

    torch.manual_seed(0)
    model = MLP()
    opt = StatsHookAdam(two_groups(model), bucket_cap_mb=cc.TINY, device_mesh=mesh)
    scaler = ShardedGradScaler("cpu")
    stats, replicas = [], []
    original_sync, original_async = _compat.all_reduce, _compat.all_reduce_async

    def counting_sync(tensor, op, group, **kwargs):
        stats.append(tensor.numel())
        return original_sync(tensor, op, group, **kwargs)

    def counting_async(tensor, op, group):
        replicas.append(group)
        return original_async(tensor, op, group)

    per_step = []
    _compat.all_reduce, _compat.all_reduce_async = counting_sync, counting_async
    try:
        for step in range(3):
            x, y = batches(step, world)[rank]
            stats.clear()
            replicas.clear()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            scaler.unscale_(opt)
            opt.clip_grad_norm(1.0)
            scaler.step(opt)
            scaler.update()
            per_step.append({"stats": len(stats), "replicas": len(replicas)})
            opt.zero_grad()
    finally:
        _compat.all_reduce, _compat.all_reduce_async = original_sync, original_async
    return {"per_step": per_step, "buckets": len(opt._buckets), "hook_calls": len(opt.calls),
            "replicate": opt._comm.replicate_size, "shard": opt._comm.shard_size}


def case_memory(rank: int, world: int, mesh) -> Dict[str, Any]:
    """Optimizer state lives on the shard dim only: 1 / shard_size of every bucket per rank."""
    from parity import MLP, two_groups

    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=cc.TINY, device_mesh=mesh,
                               dtype=torch.float32)
    stats = opt.memory_stats()
    return {"moments": stats["moments"], "shard_numel": sum(b.shard_numel for b in opt._buckets),
            "bucket_numel": sum(b.numel for b in opt._buckets),
            "n": sum(p.numel() for p in model.parameters()), "shard": opt._comm.shard_size}


def case_norm_types(rank: int, world: int, mesh) -> Dict[str, Any]:
    """grad_norm for p = 1, 3 (second norm types: one more all-reduce each) and inf (MAX) against
    torch's on the union's grads; clipping by the inf-norm."""
    import cases_scaler

    return cases_scaler.case_norm_types(rank, world, opt_kwargs=dict(device_mesh=mesh))


def case_group_norms(rank: int, world: int, mesh) -> Dict[str, Any]:
    """grad_norms_by_group against torch's per group: replicas hold the same shard, so only
    replicate rank 0 contributes the group partials, as the whole norm's."""
    import cases_scaler

    return cases_scaler.case_group_norms(rank, world, device_mesh=mesh)


CASES = ["case_parity", "case_parity_sum_micro", "case_parity_reduce_each_micro",
         "case_parity_capturable_no_overlap", "case_parity_low_bit", "case_loops", "case_loops_low_bit", "case_collectives", "case_memory",
         "case_norm_types", "case_group_norms"]


# ====================================================================== checkpoints across meshes
def checkpoint_cases(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """Train on 2x2 to SAVE_AT, save a state dict and a DCP checkpoint, train on to TOTAL (the
    uninterrupted run); then on 1x4, 4x1 and the 1-D mesh: load both, resume, compare. The same
    with blockwise moments under ``"low_bit"`` (loaded in the same bucket layout: bitwise)."""
    out = _checkpoint_round(rank, world, tmp, "", 2 * cc.TINY)
    out["low_bit"] = _checkpoint_round(rank, world, tmp, "_low_bit", cc.TINY, **LOW_BIT_CKPT)
    return out


LOW_BIT_CKPT = dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit")


def _checkpoint_round(rank: int, world: int, tmp: str, tag: str, load_cap: float, **opts: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    model, opt = cc.build(bucket_cap_mb=cc.TINY, device_mesh=mesh_of((2, 2)), **opts)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    cc.train(model, opt, range(cc.SAVE_AT), rank, world, scaler=scaler, per_step=PER_STEP)
    sd = _sd(opt)
    out["rank0_only"] = _sd(opt, rank0_only=True)  # gathered over the shard dim, kept on rank 0
    save_sharded(opt, os.path.join(tmp, f"dcp_2x2{tag}"), scaler=scaler)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    cc._save({"model": weights, "opt": sd, "scaler": scaler.state_dict()}, tmp, f"mesh_2x2{tag}.pt", rank)
    cc.train(model, opt, range(cc.SAVE_AT, cc.TOTAL), rank, world, scaler=scaler, per_step=PER_STEP)
    out["saved_sd"] = sd
    out["final"] = cc.params_of(model)
    del opt
    for shape in [(1, 4), (4, 1), (4,)]:
        resumed = {}
        for how in ("sd", "dcp"):
            model, opt = cc.build(bucket_cap_mb=load_cap, device_mesh=mesh_of(shape), **opts)
            model.load_state_dict(weights)
            scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
            if how == "sd":
                opt.load_state_dict(sd)
                scaler.load_state_dict(cc._load(tmp, f"mesh_2x2{tag}.pt")["scaler"])
            else:
                load_sharded(opt, os.path.join(tmp, f"dcp_2x2{tag}"), scaler=scaler)
            loaded = _sd(opt)
            cc.train(model, opt, range(cc.SAVE_AT, cc.TOTAL), rank, world, scaler=scaler, per_step=PER_STEP)
            resumed[how] = {"sd": loaded, "final": cc.params_of(model)}
            del opt
        out[shape_name(shape)] = resumed
    return out


def _sd(opt: DistributedFusedAdam, **kw: Any):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # low-bit moments: torch needs to_torch_state_dict (test_low_bit.py)
        return opt.state_dict(**kw)


# ====================================================================== offload on a hybrid mesh
# (cases_offload.CONFIGS name, loop): offload="cpu" on the 2x2 mesh against the same run without
OFFLOAD_CASES = [("fp32", "B"), ("bf16_params", "D"), ("q8_q4", "C"), ("fp32_half_offloaded", "F"),
                 ("bf16_moments", "G"), ("fp32", "E"), ("fp32_half_offloaded", "A")]


def offload_cases(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """``offload="cpu"`` on the 2x2 mesh (shard inside each replica, replicate across): the loops
    of cases_offload.py (two groups, uneven shards, an inf on the last rank, spikes, no_sync,
    blockwise moments, half the buckets offloaded), each without and with offload."""
    import cases_offload as co

    mesh = mesh_of((2, 2))
    return {(config, loop): {off: co.run_loop(config, loop, off, rank, world, device_mesh=mesh)
                             for off in (None, "cpu")} for config, loop in OFFLOAD_CASES}


def run(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """Every case for every mesh shape (one spawned group), then the checkpoint cases."""
    out: Dict[str, Any] = {}
    for shape in SHAPES:
        mesh = mesh_of(shape)
        for name in CASES:
            key = f"{name}[{shape_name(shape)}]"
            try:
                out[key] = ("ok", globals()[name](rank, world, mesh))
            except BaseException:  # noqa: BLE001
                out[key] = ("error", traceback.format_exc())
                return out  # the ranks' collectives may be out of step now
    for key, cases in (("checkpoint", checkpoint_cases), ("offload", offload_cases)):
        try:
            out[key] = ("ok", cases(rank, world, tmp))
        except BaseException:  # noqa: BLE001
            out[key] = ("error", traceback.format_exc())
            break
    dist.barrier()
    return out
