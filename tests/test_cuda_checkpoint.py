"""Checkpoint resharding on GPUs: the cases of cases_checkpoint.py on CUDA tensors over NCCL.

One NCCL group at world W (the largest of 4, 2, 1 that the visible GPUs allow) trains and saves,
through torch-layout state dicts and DCP; groups at every smaller world (4 -> 2 and 1, 2 -> 1;
with one GPU: 1 -> 1 into other bucket layouts) resume from what it wrote. The resumed params are
compared with the uninterrupted unsharded torch.optim run (on the CPU), the reloaded state with
the saved one bit for bit. Skipped without a GPU.
"""
from __future__ import annotations

import functools
import os
import tempfile
from typing import Any, Dict, List, Tuple

import pytest
import torch

import cases_checkpoint as cc
from dist_helper import case_values, run_distributed
from parity import ATOL, RTOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PER_STEP = 12  # samples per step: an equal slice for every world used here (4, 2, 1)
# case_errors is left out: it checks validation that runs before any device work (the CPU
# tests cover it) and adds nothing NCCL-specific
SAVE_CASES = [c for c in cc.W3_CASES if c != "case_errors"]
RESUME_CASES = cc.W2_CASES + ["case_dcp_one_bucket"]


def _save_world() -> int:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return next((w for w in (4, 2, 1) if w <= n), 1)


SAVE_WORLD = _save_world()
# every smaller world; with one GPU, world 1 again (the resume cases use other bucket layouts)
RESUME_WORLDS = [w for w in (2, 1) if w < SAVE_WORLD] or [1]


def _run_cuda(rank: int, world: int, tmp: str, names: List[str]) -> Dict[str, Any]:
    """cases_checkpoint.run on this rank's GPU (dist_helper set the device before init)."""
    torch.backends.cudnn.allow_tf32 = False  # the CPU reference computes its convs in full fp32
    torch.backends.cuda.matmul.allow_tf32 = False
    return cc.run(rank, world, tmp, names, device="cuda", per_step=PER_STEP)


@functools.lru_cache(maxsize=None)
def _groups() -> Tuple[str, List[Any], Dict[int, List[Any]]]:
    tmp = tempfile.mkdtemp(prefix="shardamp-cuda-ckpt-")
    # torch.optim.Adam with L2 decay, 3 steps: its state dict is resumed by shardamp on GPUs
    model, opt = cc.torch_run(steps=range(cc.SAVE_AT), cls=torch.optim.Adam, weight_decay=0.01, per_step=PER_STEP)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.path.join(tmp, "torch.pt"))
    saved = run_distributed(_run_cuda, SAVE_WORLD, tmp, SAVE_CASES, backend="nccl", timeout=300.0)
    case_values(saved, "case_save")  # the resuming groups need what it wrote
    resumed = {w: run_distributed(_run_cuda, w, tmp, RESUME_CASES, backend="nccl", timeout=300.0)
               for w in RESUME_WORLDS}
    return tmp, saved, resumed


@pytest.fixture(scope="module")
def groups() -> Tuple[str, List[Any], Dict[int, List[Any]]]:
    return _groups()


@pytest.fixture(scope="module")
def reference() -> List[torch.Tensor]:
    """The uninterrupted unsharded run: torch.optim.AdamW, all TOTAL steps."""
    model, _ = cc.torch_run(per_step=PER_STEP)
    return cc.params_of(model)


def _close(ours: List[torch.Tensor], ref: List[torch.Tensor], what: str) -> None:
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.device.type == "cpu" and b.device.type == "cpu"
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} param {i}: {m}")


def test_saved_state_dict_is_torch_layout_on_every_rank(groups) -> None:
    """Gathered over NCCL (all-gather, and gather for rank0_only): every rank holds the same
    CPU dict, equal to torch.optim.AdamW's after the same steps."""
    _, saved, _ = groups
    saves = case_values(saved, "case_save")
    for other in saves[1:]:
        cc.assert_sd_equal(saves[0]["sd"], other["sd"])
        assert other["scaler"] == saves[0]["scaler"]
    sd = saves[0]["sd"]
    _, ref = cc.torch_run(steps=range(cc.SAVE_AT), per_step=PER_STEP)
    ref_sd = ref.state_dict()
    assert sd["param_groups"] == [dict(g) for g in ref_sd["param_groups"]]
    assert sorted(sd["state"]) == sorted(ref_sd["state"])
    for i, entry in ref_sd["state"].items():
        for k, t in entry.items():
            assert sd["state"][i][k].device.type == "cpu"
            torch.testing.assert_close(sd["state"][i][k], t, rtol=RTOL, atol=ATOL, msg=lambda m: f"{i}.{k}: {m}")


def test_round_trip_is_bitwise(groups) -> None:
    """save at W, load into one big bucket at W, save again: the same dict bit for bit."""
    _, saved, _ = groups
    assert all(case_values(saved, "case_roundtrip"))


@pytest.mark.parametrize("world", RESUME_WORLDS)
def test_state_dict_resume_equals_uninterrupted_run(groups, reference, world: int) -> None:
    _, _, resumed = groups
    for rank, params in enumerate(case_values(resumed[world], "case_resume")):
        _close(params, reference, f"state dict {SAVE_WORLD} -> {world}, rank {rank}")


@pytest.mark.parametrize("world", RESUME_WORLDS)
@pytest.mark.parametrize("case", ["case_dcp", "case_dcp_one_bucket"])
def test_dcp_resume_equals_uninterrupted_run(groups, reference, world: int, case: str) -> None:
    """DCP written by W ranks (one file each) loads at ``world``, in the saved layout and in
    one big bucket: the reloaded state and scaler equal what was saved, and training continues
    as if never interrupted."""
    tmp, saved, resumed = groups
    save = case_values(saved, "case_save")[0]
    files = [f for f in os.listdir(os.path.join(tmp, "dcp")) if f.endswith(".distcp")]
    assert len(files) == SAVE_WORLD  # one shard file per saving rank
    for rank, value in enumerate(case_values(resumed[world], case)):
        cc.assert_sd_equal(value["sd"], save["sd"])
        assert value["scaler"] == save["scaler"]
        _close(value["params"], reference, f"dcp {SAVE_WORLD} -> {world} ({case}), rank {rank}")


@pytest.mark.parametrize("world", RESUME_WORLDS)
def test_bf16_master_survives_exactly(groups, world: int) -> None:
    _, saved, resumed = groups
    sd = case_values(saved, "case_bf16")[0]["sd"]
    assert all(e["master_param"].dtype == torch.float32 for e in sd["state"].values())
    for value in case_values(resumed[world], "case_bf16_resume"):
        cc.assert_sd_equal(value["sd"], sd)


@pytest.mark.parametrize("world", RESUME_WORLDS)
def test_channels_last_resume(groups, world: int) -> None:
    _, saved, resumed = groups
    sd = case_values(saved, "case_channels_last")[0]["sd"]
    model, _ = cc.torch_run("conv", channels_last=True, per_step=PER_STEP)
    expected = cc.params_of(model)
    for value in case_values(resumed[world], "case_channels_last_resume"):
        cc.assert_sd_equal(value["sd"], sd)
        assert value["channels_last"] and all(value["channels_last"])
        _close(value["params"], expected, f"channels_last {SAVE_WORLD} -> {world}")


@pytest.mark.parametrize("world", RESUME_WORLDS)
def test_torch_state_dict_into_shardamp_on_gpus(groups, world: int) -> None:
    """torch.optim.Adam's CPU state dict -> shardamp on GPUs at ``world`` -> continue like torch."""
    _, _, resumed = groups
    model, _ = cc.torch_run(cls=torch.optim.Adam, weight_decay=0.01, per_step=PER_STEP)
    expected = cc.params_of(model)
    for params in case_values(resumed[world], "case_from_torch"):
        _close(params, expected, f"torch Adam -> world {world}")
