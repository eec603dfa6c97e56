"""Blockwise moments ("8bit" / "4bit") on every rank of one spawned group (test_low_bit.py): the
same grads at world 1, 2 and 4 give bitwise the same states and params; a state dict and a DCP
checkpoint saved at world 4 resume at worlds 2 and 1 in other bucket layouts, bitwise; a loop
with a scaler, max_grad_norm and an inf on one rank only against the reference math.

"The same grads": every rank takes the same loss, ``sum(p * c)`` with ``c`` small integers over
16 times powers of two (six decades inside every block), so the grads are ``c`` exactly and
their sum over 2 or 4 ranks, and its average, are exact: the step then sees bitwise the same
grads at every world size (only clipping would differ, by its norm's summation order).
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List

import torch

import cases_checkpoint as cc
from dist_helper import run_cases
from parity import two_groups
from shardamp.optim import DistributedFusedAdam, kernels
from shardamp.optim.checkpoint import load_sharded, save_sharded
from shardamp.scaler import ShardedGradScaler

# name -> (model dtype, optimizer options)
CONFIGS = {
    "q8": (torch.float32, dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit")),
    "q4": (torch.float32, dict(exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit")),
    "q8_q4": (torch.float32, dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit")),
    "fp32_q4": (torch.float32, dict(exp_avg_sq_dtype="4bit")),
    "q4_q8_block64": (torch.float32, dict(exp_avg_dtype="4bit", exp_avg_sq_dtype="8bit", quant_block_size=64)),
    "remainders_q8_q4": (torch.bfloat16, dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit",
                                              store_param_remainders=True)),
}
SAVE_AT, TOTAL = 3, 6
UNUSED_ON_ODD_STEPS = "head.bias"  # no grad on odd steps: an untouched param beside touched ones


def build(name: str, bucket_cap_mb: float):
    dtype, opts = CONFIGS[name]
    return cc.build(dtype=dtype, bucket_cap_mb=bucket_cap_mb, **opts)


def exact_grads(model: torch.nn.Module, step: int) -> torch.Tensor:
    """The loss whose grads are exact small dyadic numbers (the module docstring)."""
    g = torch.Generator().manual_seed(900 + step)
    loss = torch.zeros(())
    for n, p in model.named_parameters():
        if n == UNUSED_ON_ODD_STEPS and step % 2:
            continue
        k = torch.randint(-8, 9, p.shape, generator=g).float() / 16
        c = k * 2.0 ** -torch.randint(0, 20, p.shape, generator=g).float()
        loss = loss + (p.float() * c.to(p.dtype).float()).sum()
    return loss


def train_exact(model, opt, steps) -> None:
    for step in steps:
        exact_grads(model, step).backward()
        opt.step()
        opt.zero_grad()
    opt.param_sync()


def quiet_sd(opt) -> Dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what torch cannot load as it is: test_low_bit.py
        return opt.state_dict()


def sd_equal(a: Dict[str, Any], b: Dict[str, Any]) -> str:
    """'' where bitwise equal (values, dtypes, strides; ints and layouts alike), else what differs."""
    if a["param_groups"] != b["param_groups"] or a.get("shardamp") != b.get("shardamp"):
        return "param_groups or extras differ"
    if sorted(a["state"]) != sorted(b["state"]):
        return f"state keys {sorted(a['state'])} != {sorted(b['state'])}"
    for i, entry in a["state"].items():
        other = b["state"][i]
        if sorted(entry) != sorted(other):
            return f"state[{i}] keys {sorted(entry)} != {sorted(other)}"
        for k, t in entry.items():
            u = other[k]
            if isinstance(t, torch.Tensor):
                if not (t.dtype == u.dtype and t.shape == u.shape and t.stride() == u.stride() and torch.equal(t, u)):
                    return f"state[{i}][{k!r}] differs"
            elif t != u:
                return f"state[{i}][{k!r}] = {t!r} != {u!r}"
    return ""


def case_steps(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """Per config: SAVE_AT steps (saved at world 4: a state dict and a DCP checkpoint), then on
    to TOTAL. Returns the state dicts at both points and the final params."""
    out = {}
    for name in CONFIGS:
        model, opt = build(name, cc.TINY)
        train_exact(model, opt, range(SAVE_AT))
        mid = quiet_sd(opt)
        if world == 4:
            save_sharded(opt, os.path.join(tmp, f"dcp_{name}"))
            cc._save({"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": mid}, tmp,
                     f"{name}.pt", rank)
        train_exact(model, opt, range(SAVE_AT, TOTAL))
        out[name] = {"mid": mid, "final_sd": quiet_sd(opt), "final": cc.params_of(model),
                     "moments_bytes": opt.memory_stats()["moments"],
                     "shard": sum(b.shard_numel for b in opt._buckets),
                     "backend": kernels.backend(torch.device("cpu"))}  # native: the compiled blockwise step ran
        del opt  # one live optimizer over the group at a time
    return out


def case_resume(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """Per config, what world 4 saved: loaded in the same bucket layout (a state dict; a DCP
    checkpoint) and trained on to TOTAL; loaded in other layouts (other block offsets: one
    rounding); and the saved state dict loaded into fp32 moments."""
    out: Dict[str, Any] = {}
    for name in CONFIGS:
        saved = cc._load(tmp, f"{name}.pt")
        got: Dict[str, Any] = {}
        for how, cap in (("sd", cc.TINY), ("dcp", cc.TINY), ("sd_other", 2 * cc.TINY), ("dcp_other", 1000.0)):
            model, opt = build(name, cap)
            model.load_state_dict(saved["model"])
            if how.startswith("sd"):
                opt.load_state_dict(saved["opt"])
            else:
                load_sharded(opt, os.path.join(tmp, f"dcp_{name}"))
            got[how] = quiet_sd(opt)
            train_exact(model, opt, range(SAVE_AT, TOTAL))
            got[how + "_final"] = cc.params_of(model)
            del opt  # one live optimizer over the group at a time
        model_f, opt_f = cc.build(dtype=CONFIGS[name][0], bucket_cap_mb=cc.TINY)  # fp32 moments
        model_f.load_state_dict(saved["model"])
        opt_f.load_state_dict(saved["opt"])
        got["as_fp32"] = quiet_sd(opt_f)
        del opt_f
        out[name] = got
    return out


def case_scaler_clip(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """A loop with ShardedGradScaler and max_grad_norm (clipping active), an inf in rank 1's grads
    at step 2 only (the step is skipped on every rank and the scale backs off), each rank its
    slice of the batch. Returns the params and the state dict after each step."""
    out: Dict[str, Any] = {}
    for name in ("q8_q4", "q4"):
        model = cc.new_model()
        opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=cc.TINY, max_grad_norm=0.05, **CONFIGS[name][1])
        scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
        n = cc.PER_STEP // world
        per_step = []
        for step in range(TOTAL):
            x, y = cc.batch(step)
            x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step == 2 and rank == world - 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            opt.param_sync()
            per_step.append({"params": cc.params_of(model), "scale": float(scaler.get_scale())})
        out[name] = {"steps": per_step, "sd": quiet_sd(opt)}
        del opt
    return out


def case_mixed_formats(rank: int, world: int, tmp: str) -> str:
    """Ranks that ask for different moment formats: the construction fails on every rank."""
    try:
        DistributedFusedAdam(two_groups(cc.new_model()), exp_avg_dtype="8bit" if rank == 0 else "4bit")
    except ValueError as exc:
        return str(exc)
    return ""


W4_CASES = ["case_steps"]
W2_CASES = ["case_steps", "case_resume", "case_scaler_clip", "case_mixed_formats"]
W1_CASES = ["case_steps", "case_resume"]


def run(rank: int, world: int, tmp: str, names: List[str]) -> Dict[str, Any]:
    """This module's cases in one spawned group, sharing the temp dir ``tmp``."""
    return run_cases(rank, world, __name__, names, {"tmp": tmp})
