"""Checkpoint cases for the storage options (bf16 moments, param remainders), run on every rank
of one spawned group (test_state_dtypes.py): world 3 trains and saves, world 2 resumes.

Built on cases_checkpoint's fixed-batch training, so any world size sees the same average
gradient per step.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

import torch

import cases_checkpoint as cc
from dist_helper import run_cases
from shardamp.optim.checkpoint import load_sharded, save_sharded

BF16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
# name -> (model dtype, optimizer options)
CONFIGS = {
    "bf16_moments": (torch.float32, BF16),
    "remainders": (torch.bfloat16, dict(store_param_remainders=True)),
    "remainders_bf16_moments": (torch.bfloat16, dict(store_param_remainders=True, **BF16)),
    "separate_master": (torch.bfloat16, {}),  # the same bf16 model with an fp32 master tensor
}


def _build(name: str, bucket_cap_mb: float, **extra: Any):
    dtype, opts = CONFIGS[name]
    return cc.build(dtype=dtype, bucket_cap_mb=bucket_cap_mb, **opts, **extra)


def case_save(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """Per config: train SAVE_AT steps, save a state dict and a DCP checkpoint, check a load into
    another bucket layout round-trips bitwise, then train on to TOTAL (the uninterrupted run)."""
    out = {}
    for name in CONFIGS:
        model, opt = _build(name, cc.TINY)
        cc.train(model, opt, range(cc.SAVE_AT), rank, world)
        sd = opt.state_dict()
        save_sharded(opt, os.path.join(tmp, f"dcp_{name}"))
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        cc._save({"model": weights, "opt": sd}, tmp, f"{name}.pt", rank)
        cc.train(model, opt, range(cc.SAVE_AT, cc.TOTAL), rank, world)
        final = cc.params_of(model)
        del opt  # a second optimizer may be built over the group once the trained one is gone
        model2, opt2 = _build(name, 1000.0)
        model2.load_state_dict(weights)
        opt2.load_state_dict(sd)
        cc.assert_sd_equal(opt2.state_dict(), sd)
        loaded = cc.params_of(model2)  # with remainders the load rewrote them from the masters
        assert all(torch.equal(a, b) for a, b in zip(loaded, weights.values())), f"{name}: model changed by the load"
        out[name] = {"sd": sd, "final": final, "saved_model": loaded}
    return out


def case_resume(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """Per config, at a new world size and layout: the state dict and the DCP checkpoint load
    bitwise (the dicts equal the saved one; every rank holds the same model), then training
    continues. Also across configs: remainders <-> separate master load each other exactly."""
    out: Dict[str, Any] = {}
    for name in CONFIGS:
        saved = cc._load(tmp, f"{name}.pt")
        model, opt = _build(name, 2 * cc.TINY)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sd = opt.state_dict()
        cc.train(model, opt, range(cc.SAVE_AT, cc.TOTAL), rank, world)
        del opt  # it trained: a second live optimizer over the group is refused
        model_d, opt_d = _build(name, 3 * cc.TINY)
        model_d.load_state_dict(saved["model"])
        load_sharded(opt_d, os.path.join(tmp, f"dcp_{name}"))
        out[name] = {"sd": sd, "dcp_sd": opt_d.state_dict(), "params": cc.params_of(model),
                     "dcp_model": cc.params_of(model_d)}
    cross: List[bool] = []
    for src, dst in (("remainders", "separate_master"), ("separate_master", "remainders")):
        saved = cc._load(tmp, f"{src}.pt")
        model, opt = _build(dst, cc.TINY)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        got = opt.state_dict()
        cross.append(all(torch.equal(got["state"][i][k], saved["opt"]["state"][i][k])
                         for i in saved["opt"]["state"] for k in ("exp_avg", "exp_avg_sq", "master_param")))
    out["cross"] = cross
    return out


W3_CASES = ["case_save"]
W2_CASES = ["case_resume"]


def run(rank: int, world: int, tmp: str, names: List[str]) -> Dict[str, Any]:
    """This module's cases in one spawned group, sharing the temp dir ``tmp``."""
    return run_cases(rank, world, __name__, names, {"tmp": tmp})
