"""ShardampStrategy on 2 gloo CPU ranks against unsharded torch.optim.AdamW (tests/framework_ref.py)."""
from __future__ import annotations

import functools
import tempfile

import pytest
import torch

pytest.importorskip("lightning")

import cases_lightning as cases  # noqa: E402
import framework_ref as ref  # noqa: E402
from dist_helper import case_values, run_cases, run_distributed  # noqa: E402

WORLD = 2
_TMP = tempfile.TemporaryDirectory()


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_distributed(run_cases, world, "cases_lightning", cases.CASES, {"tmp": _TMP.name})


def _check_run(values, autocast_dtype=None, accumulate=1, lr_lambda=None):
    for v in values:
        assert v["opt"] == "DistributedFusedAdam" and v["wrapped"] != "DistributedDataParallel"
        assert v["world"] == WORLD
    # "norms": opt.grad_norm() after each step
    return ref.check_run(values, cases.N_STEPS, "norms", autocast_dtype, accumulate, lr_lambda)


@pytest.mark.parametrize("world", [WORLD])
def test_fp32_with_gradient_clip_val(world) -> None:
    _check_run(case_values(_results(world), "case_fp32_clip"))


@pytest.mark.parametrize("world", [WORLD])
def test_lr_scheduler_from_configure_optimizers(world) -> None:
    _check_run(case_values(_results(world), "case_lr_scheduler"), lr_lambda=cases.lr_lambda)


@pytest.mark.parametrize("world", [WORLD])
def test_bf16_mixed_with_gradient_clip_val(world) -> None:
    _check_run(case_values(_results(world), "case_bf16_clip"), autocast_dtype=torch.bfloat16)


@pytest.mark.parametrize("world", [WORLD])
def test_16_mixed_uses_sharded_grad_scaler_and_clips(world) -> None:
    values = case_values(_results(world), "case_fp16_sharded_scaler")
    assert all(v["scaler"] == "ShardedGradScaler" for v in values)
    _check_run(values, autocast_dtype=torch.float16)


@pytest.mark.parametrize("world", [WORLD])
def test_accumulate_grad_batches_reduces_once_per_step(world) -> None:
    values = _check_run(case_values(_results(world), "case_accumulate_no_sync"), accumulate=3)
    for v in values:  # no_sync on the first two micro-batches: one reduce-scatter per bucket per step
        assert v["reduce_scatters"] == cases.N_STEPS * v["buckets"], v["reduce_scatters"]


@pytest.mark.parametrize("world", [WORLD])
@pytest.mark.parametrize("case", ["case_checkpoint_resume", "case_checkpoint_resume_sharded"])
def test_model_checkpoint_resume_equals_uninterrupted(world, case) -> None:
    for v in case_values(_results(world), case):
        assert "step=2.ckpt" in v["full"]["ckpts"]
        assert len(v["resumed"]["seen"]) == len(v["full"]["seen"]) // 2  # really resumed at step 2
        for a, b in zip(v["full"]["params"], v["resumed"]["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
