"""``offload="cpu"`` on every rank of one spawned gloo group (test_offload.py): the offloaded run
against the same run with the state on the params' device, which runs the same CPU kernels on the
same values, so every step's params, the state dicts, ``step_stats()``, ``grad_norm()`` and
``last_nonfinite()`` must be bitwise the same.

Each loop (A to G of docs/amp-loops.md: ``LOOPS``) runs over the parity MLP in two param groups
(bucket_cap_mb tiny: params straddle buckets and uneven shards at world 3), each rank its own
batch, an inf in the LAST rank's loss at step 2 only, the ``b`` layer left out on odd steps
(untouched params beside touched ones), a spike on rank 0 at step 3 where the loop sets
``skip_grad_norm_above`` (C, D, G), ``no_sync`` micro-batches in D and F, ``max_grad_norm`` in D
and E. ``run_loop`` takes more optimizer options (a hybrid ``device_mesh``: cases_mesh.py).
On GPUs (test_cuda_offload.py, ``run(..., device="cuda")``) the offloaded run's CPU kernels stand
against the CUDA kernels: the same to their documented tolerance.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import cases_checkpoint as cc
from dist_helper import run_cases
from parity import batches, two_groups
import shardamp.optim as so
from shardamp.optim import DistributedFusedAdam
from shardamp.optim.checkpoint import load_sharded, save_sharded
from shardamp.scaler import ShardedGradScaler

STEPS = 5
INF_STEP = 2  # the last rank's loss is inf at this step: every rank skips it
SPIKE_STEP = 3  # loop D: rank 0's loss scaled up: the norm spikes above skip_grad_norm_above
DEVICE = "cpu"  # where the cases build (run() sets it in a spawned group)

# name -> (model dtype, optimizer options besides the loop's)
CONFIGS: Dict[str, Any] = {
    "fp32": (torch.float32, {}),
    "bf16_params": (torch.bfloat16, {}),
    "bf16_moments": (torch.float32, dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)),
    "q8_q4": (torch.float32, dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit")),
    "fp32_half_offloaded": (torch.float32, dict(offload_fraction=0.5)),
    # the new params go back into the bf16 all-gather buffer (world > 1), then to the fp32 params
    "fp32_bf16_gather": (torch.float32, dict(param_sync_dtype=torch.bfloat16)),
    "bf16_overlap_param_sync": (torch.bfloat16, dict(overlap_param_sync=True)),
}
# the loops each config runs (default: all, A-G); the blockwise formats run on CPU params only here
CONFIG_LOOPS = {"q8_q4": ("B", "D", "C", "G"), "bf16_moments": ("B", "D", "E", "F"), "fp32_bf16_gather": ("B", "D"),
                "bf16_overlap_param_sync": ("B",)}


def _loss(model: torch.nn.Module, step: int, rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    x, y = batches(step, world, device=DEVICE)[rank]
    out = model(x.to(dtype), skip=("b",) if step % 2 else ())
    loss = F.mse_loss(out.float(), y)
    if step == INF_STEP and rank == world - 1:
        loss = loss * float("inf")
    return loss


def loop_b(model, opt, rank, world, dtype, record) -> None:
    """Loop B: ShardedGradScaler, unscale_, opt.clip_grad_norm, scaler.step, update."""
    scaler = ShardedGradScaler(DEVICE, init_scale=2.0 ** 8, growth_interval=2)
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(_loss(model, step, rank, world, dtype)).backward()
        scaler.unscale_(opt)
        norm = opt.clip_grad_norm(0.05)
        scaler.step(opt)
        scaler.update()
        record(step, norm=norm, scale=float(scaler.get_scale()))


def loop_a(model, opt, rank, world, dtype, record) -> None:
    """Loop A: torch.amp.GradScaler handing itself to opt.step(grad_scaler=)."""
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0 ** 8, growth_interval=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's note about the hand-over
        for step in range(STEPS):
            opt.zero_grad()
            scaler.scale(_loss(model, step, rank, world, dtype)).backward()
            scaler.step(opt)
            scaler.update()
            record(step, scale=float(scaler.get_scale()))


def loop_d(model, opt, rank, world, dtype, record) -> None:
    """Loop D: max_grad_norm= and skip_grad_norm_above= (a spike at SPIKE_STEP), no_sync
    accumulation of two micro-batches, no scaler (the inf step is skipped by found-inf)."""
    for step in range(STEPS):
        opt.zero_grad()
        with opt.no_sync():
            (_loss(model, step + 100, rank, world, dtype) * 0.5).backward()
        loss = _loss(model, step, rank, world, dtype)
        if step == SPIKE_STEP and rank == 0:
            loss = loss * 1e6
        loss.backward()
        opt.step()
        record(step, norm=opt.grad_norm())


def _spiked(loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """Rank 0's loss scaled up at SPIKE_STEP: the global norm spikes above skip_grad_norm_above."""
    return loss * 1e6 if step == SPIKE_STEP and rank == 0 else loss


def loop_c(model, opt, rank, world, dtype, record) -> None:
    """Loop C: ShardedGradScaler, unscale_, the drop-in shardamp.optim.clip_grad_norm_ over
    model.parameters(); skip_grad_norm_above with a spike at SPIKE_STEP."""
    scaler = ShardedGradScaler(DEVICE, init_scale=2.0 ** 8, growth_interval=2)
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(_spiked(_loss(model, step, rank, world, dtype), step, rank)).backward()
        scaler.unscale_(opt)
        norm = so.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        record(step, norm=norm, scale=float(scaler.get_scale()))


class NeMoStyleAdam(DistributedFusedAdam):
    """Loop E: a subclass opting out of in-step scaling (ShardedGradScaler skips an overflowing
    step through torch's path, reading found-inf on the host), as NeMo does."""

    _step_supports_amp_scaling = False


def loop_e(model, opt, rank, world, dtype, record) -> None:
    """Loop E: the NeMo-style subclass (built by run_loop), ShardedGradScaler, unscale_ and
    max_grad_norm= clipping in the step."""
    assert isinstance(opt, NeMoStyleAdam)
    scaler = ShardedGradScaler(DEVICE, init_scale=2.0 ** 8, growth_interval=2)
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(_loss(model, step, rank, world, dtype)).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        record(step, scale=float(scaler.get_scale()), skipped=bool(scaler.last_step_skipped))


def loop_f(model, opt, rank, world, dtype, record) -> None:
    """Loop F: torch.amp.GradScaler, unscale_ and torch.nn.utils.clip_grad_norm_ (through the
    grads param.grad shows), two micro-batches accumulated under no_sync."""
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0 ** 8, growth_interval=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's note about the hand-over
        for step in range(STEPS):
            opt.zero_grad()
            with opt.no_sync():
                scaler.scale(_loss(model, step + 100, rank, world, dtype) * 0.5).backward()
            scaler.scale(_loss(model, step, rank, world, dtype)).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
            record(step, norm=norm, scale=float(scaler.get_scale()))


def loop_g(model, opt, rank, world, dtype, record) -> None:
    """Loop G: clipping before unscale_: opt.clip_grad_norm on even steps (the plain max_norm,
    resolved at step), torch's idiom shardamp.optim.clip_grad_norm_(params, max_norm * scale) on
    odd ones (the scaled norm); skip_grad_norm_above with a spike at SPIKE_STEP."""
    scaler = ShardedGradScaler(DEVICE, init_scale=2.0 ** 8, growth_interval=2)
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(_spiked(_loss(model, step, rank, world, dtype), step, rank)).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the clip-before-unscale warning (at the step's unscale)
            if step % 2 == 0:
                norm = opt.clip_grad_norm(0.05)
            else:
                norm = so.clip_grad_norm_(model.parameters(), 0.05 * scaler.get_scale())
            scaler.step(opt)
        scaler.update()
        record(step, norm=norm, scale=float(scaler.get_scale()))


LOOPS: Dict[str, Callable] = {"B": loop_b, "A": loop_a, "D": loop_d, "C": loop_c, "E": loop_e, "F": loop_f,
                              "G": loop_g}
SPIKE_ABOVE = 50.0  # the unscaled norms are below 10 here, millions at a spike
LOOP_OPTIONS = {"B": {}, "A": {}, "D": dict(max_grad_norm=0.05, skip_grad_norm_above=SPIKE_ABOVE),
                "C": dict(skip_grad_norm_above=SPIKE_ABOVE), "E": dict(max_grad_norm=0.05), "F": {},
                "G": dict(skip_grad_norm_above=SPIKE_ABOVE)}
SPIKE_LOOPS = ("D", "C", "G")  # the loops whose step SPIKE_STEP is skipped for a spike


def _quiet_sd(opt) -> Dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what torch cannot load as it is (bf16 / blockwise moments)
        return opt.state_dict()


def run_loop(config: str, loop: str, offload: Optional[str], rank: int, world: int, **extra: Any) -> Dict[str, Any]:
    """One config x loop, with ``offload`` or without; ``extra``: more optimizer options (a
    ``device_mesh``: cases_mesh.py)."""
    dtype, options = CONFIGS[config]
    options = dict(options, **extra)
    if offload is None:
        options.pop("offload_fraction", None)
    model = cc.new_model(dtype=dtype, device=DEVICE)
    cls = NeMoStyleAdam if loop == "E" else DistributedFusedAdam
    opt = cls(two_groups(model), bucket_cap_mb=cc.TINY, offload=offload, **options, **LOOP_OPTIONS[loop])
    steps: List[Dict[str, Any]] = []

    def record(step: int, **values: Any) -> None:
        opt.param_sync()
        values = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
        steps.append({"params": cc.params_of(model), "grad_norm": opt.grad_norm().cpu().clone(), **values})

    LOOPS[loop](model, opt, rank, world, dtype, record)
    stats = opt.step_stats()
    out = {"steps": steps, "sd": _quiet_sd(opt), "step_stats": {k: v for k, v in stats.items()},
           "last_nonfinite": opt.last_nonfinite(), "memory": opt.memory_stats(),
           "host_buckets": sorted(opt._host.shards), "buckets": len(opt._buckets),
           "host_separate": all(b.master.data_ptr() != b.params.data_ptr() + 0 and b.host is not None
                                and b.master is b.host.master for b in opt._buffers if b.host is not None)}
    del opt  # one live optimizer over the group at a time
    return out


def case_loops(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """Every config x loop, without and with offload."""
    out = {}
    for config in CONFIGS:
        for loop in CONFIG_LOOPS.get(config, tuple(LOOPS)):
            if config == "q8_q4" and DEVICE != "cpu":
                continue
            out[(config, loop)] = {off: run_loop(config, loop, off, rank, world) for off in (None, "cpu")}
    return out


def _train(model, opt, rank, world, steps) -> None:
    for step in steps:
        opt.zero_grad()
        _loss(model, step + 10, rank, world, torch.float32).backward()  # finite steps
        opt.step()
    opt.param_sync()


def case_save(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """Offloaded: SAVE_AT steps, then a state dict and a sharded checkpoint written."""
    model = cc.new_model()
    opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=cc.TINY, offload="cpu", max_grad_norm=0.05)
    _train(model, opt, rank, world, range(3))
    sd = _quiet_sd(opt)
    save_sharded(opt, os.path.join(tmp, f"dcp_w{world}"))
    cc._save({"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": sd}, tmp, f"w{world}.pt", rank)
    del opt
    return {"sd": sd}


def case_resume(rank: int, world: int, tmp: str, source: int) -> Dict[str, Any]:
    """What world ``source`` saved offloaded, loaded without and with offload here (a state dict, a
    sharded checkpoint), then trained on; the offloaded one saved again for the next world."""
    saved = cc._load(tmp, f"w{source}.pt")
    out: Dict[str, Any] = {}
    for how in ("sd", "dcp"):
        for off in (None, "cpu"):
            model = cc.new_model()
            model.load_state_dict(saved["model"])
            opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=cc.TINY, offload=off, max_grad_norm=0.05)
            if how == "sd":
                opt.load_state_dict(saved["opt"])
            else:
                load_sharded(opt, os.path.join(tmp, f"dcp_w{source}"))
            loaded = _quiet_sd(opt)
            _train(model, opt, rank, world, range(3, 6))
            out[(how, off)] = {"loaded": loaded, "final": cc.params_of(model), "final_sd": _quiet_sd(opt)}
            if how == "dcp" and off == "cpu":
                save_sharded(opt, os.path.join(tmp, f"dcp_w{world}"))
                cc._save({"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": _quiet_sd(opt)},
                         tmp, f"w{world}.pt", rank)
            del opt
    return out


def case_resume_from_3(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    return case_resume(rank, world, tmp, 3)


def case_resume_from_2(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    return case_resume(rank, world, tmp, 2)


def case_pipelined(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """The copies run where the design puts them: every offloaded bucket's grad shard copied in
    backward (before step), and the CUDA path free of host syncs outside step's one read
    (backward, unscale_ and clip under sync debug mode "error" on CUDA)."""
    model = cc.new_model(device=DEVICE)
    opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=cc.TINY, offload="cpu")
    scaler = ShardedGradScaler(DEVICE, init_scale=2.0 ** 8)
    out: Dict[str, Any] = {"copied_in_backward": [], "pinned": []}
    for step in range(3):
        opt.zero_grad()
        loss = scaler.scale(_loss(model, step + 10, rank, world, torch.float32))
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
            scaler.unscale_(opt)
            opt.clip_grad_norm(0.05)
        finally:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        out["copied_in_backward"].append(all(hs.copied is not None for hs in opt._host.shards.values()))
        scaler.step(opt)
        scaler.update()
    out["pinned"] = [hs.master.is_pinned() and hs.grad.is_pinned() for hs in opt._host.shards.values()]
    out["params"] = cc.params_of(model)
    del opt
    return out


def case_capture_refused(rank: int, world: int, tmp: str) -> str:
    """A CUDA graph capturing an offloaded step: the error names it (CUDA only)."""
    model = cc.new_model(device=DEVICE)
    opt = DistributedFusedAdam(model.parameters(), offload="cpu")
    x, y = batches(0, world, device=DEVICE)[rank]
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            opt.step()
    except RuntimeError as exc:
        return str(exc)
    finally:
        del opt
    return ""


def run(rank: int, world: int, tmp: str, names: List[str], device: str = "cpu") -> Dict[str, Any]:
    """This module's cases in one spawned group, sharing the temp dir ``tmp``, on ``device``."""
    global DEVICE
    DEVICE = device
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the two runs must see the same grads
    return run_cases(rank, world, __name__, names, {"tmp": tmp})
