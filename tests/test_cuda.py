"""The parity tests and the AMP loops on GPUs: NCCL at world 1 (and world 2 where two GPUs are
visible), CUDA tensors, native CUDA kernels, and no host sync in unscale_/clip/step/update (loops
A, B, C, D, G). Skipped without a GPU; run with ``python -m pytest -q tests/test_cuda.py``."""
from __future__ import annotations

import functools

import pytest
import torch

import cases_core
import cases_scaler
from dist_helper import case_values, run_cases, run_distributed
from test_core import (PARITY_CASES, check_bf16_moments_case, check_memory_stats_dtypes, check_parity_case,
                       check_remainders_bitwise, check_staging_case)
from test_scaler_loops import check_loop_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SYNC_FREE = {"A", "B", "C", "D", "D0", "G", "Gf"}  # E's skip is torch's own .item(); F calls float()


def _cases(rank, world):
    torch.backends.cudnn.allow_tf32 = False  # the reference and ours must run the same convs
    torch.backends.cuda.matmul.allow_tf32 = False
    out = run_cases(rank, world, "cases_core", cases_core.CASES, {"device": "cuda"})
    for name in cases_scaler.CASES:
        if not name.startswith("case_loop_"):
            continue
        loop = name[len("case_loop_"):].replace("_no_scaler", "0")
        kw = {"device": "cuda", "sync_check": loop in SYNC_FREE}
        out.update(run_cases(rank, world, "cases_scaler", [name], kw))
    from shardamp.optim import kernels

    out["backend"] = ("ok", kernels.backend(torch.device("cuda")))
    return out


# world 1 on any GPU machine; NCCL world 2 where two GPUs are visible (one GPU per rank)
WORLDS = [1, 2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [1]


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_distributed(_cases, world, backend="nccl")


@pytest.mark.parametrize("world", WORLDS)
def test_native_cuda_kernels_are_used(world: int) -> None:
    status, backend = _results(world)[0]["backend"]
    assert backend == "native"


@pytest.mark.parametrize("world", WORLDS)
def test_grad_buffers_bounded_cuda(world: int) -> None:
    for value in case_values(_results(world), "case_grad_memory_bounded"):
        assert value["held"] <= value["limit"], value


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", PARITY_CASES)
def test_core_parity_cuda(world: int, case: str) -> None:
    check_parity_case(_results(world), case)


@pytest.mark.parametrize("world", WORLDS)
def test_grad_staging_bounded_and_world1_release_cuda(world: int) -> None:
    check_staging_case(_results(world), world)


@pytest.mark.parametrize("world", WORLDS)
def test_storage_options_cuda(world: int) -> None:
    """bf16 moments and param remainders through the CUDA kernels: remainders bitwise equal to a
    separate fp32 master, bf16 moments within the stated tolerance, memory_stats savings."""
    check_remainders_bitwise(_results(world), world)
    for case in ("case_bf16_moments", "case_bf16_exp_avg_sq_only"):
        check_bf16_moments_case(_results(world), case)
    check_memory_stats_dtypes(_results(world), world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", [c for c in cases_scaler.CASES if c.startswith("case_loop_")])
def test_amp_loops_cuda(world: int, case: str) -> None:
    check_loop_case(_results(world), case)
