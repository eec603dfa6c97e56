"""GPU variants of test_wrappers.py's FSDP2 cases: fully_shard + torch AdamW (fused and foreach)
+ ShardedGradScaler on NCCL (world 2 where two GPUs are visible, else 1), fp16 and bf16 autocast,
against unsharded AdamW + torch.amp.GradScaler on the same GPU. Skipped without a GPU."""
from __future__ import annotations

import functools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

import cases_wrappers as cases  # noqa: E402
from dist_helper import case_values, run_cases, run_distributed  # noqa: E402
from test_wrappers import FSDP2, check_fsdp2  # noqa: E402


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_distributed(run_cases, world, "cases_wrappers", cases.FSDP2_CASES, {"device": "cuda"},
                           backend="nccl")


@pytest.mark.parametrize("case, dtype, clip", FSDP2)
def test_fsdp2_with_sharded_grad_scaler_on_cuda(case, dtype, clip) -> None:
    world = min(2, torch.cuda.device_count())
    check_fsdp2(case_values(_results(world), case), dtype, clip, device="cuda")
