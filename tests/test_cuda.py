"""The parity tests and the AMP loops on GPUs: NCCL at world 1 (and world 2 where two GPUs are
visible), CUDA tensors, native CUDA kernels, and no host sync in unscale_/clip/step/update (loops
A-D, F-I). Skipped without a GPU; run with ``python -m pytest -q tests/test_cuda.py``."""
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

# E's skip is torch's own .item(); F/H/H0/I clip with torch's functions over the p.grad views (torch_tools.py)
SYNC_FREE = {"A", "B", "C", "D", "D0", "F", "G", "Gf", "H", "H0", "I"}


def _cases(rank, world):
    torch.backends.cudnn.allow_tf32 = False  # the reference and ours must run the same convs
    torch.backends.cuda.matmul.allow_tf32 = False
    out = run_cases(rank, world, "cases_core", cases_core.CASES, {"device": "cuda"})
    for name in cases_scaler.CASES:
        if not name.startswith("case_loop_"):
            continue
        loop = name[len("case_loop_"):].replace("_no_scaler", "0")
        # the spike variants (skip_grad_norm_above) are as sync-free as their loops
        kw = {"device": "cuda", "sync_check": loop.removesuffix("_spike") in SYNC_FREE}
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


def test_cpu_tensor_lr_for_cuda_params_no_host_sync() -> None:
    """A CPU tensor lr (as a scheduler may keep it) for CUDA params is read once per step through
    pinned memory: no blocking copy under sync-debug "error", and the step is torch's with that lr."""
    import torch.nn as nn

    from shardamp.optim import DistributedFusedAdam
    from shardamp.scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).cuda()
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).cuda()
    ref.load_state_dict(model.state_dict())
    lr = torch.tensor(3e-3)  # on the CPU
    opt = DistributedFusedAdam([{"params": model[0].parameters(), "lr": lr}, {"params": model[2].parameters()}],
                               lr=1e-3, weight_decay=0.01)
    ropt = torch.optim.AdamW([{"params": ref[0].parameters(), "lr": 3e-3}, {"params": ref[2].parameters()}],
                             lr=1e-3, weight_decay=0.01)
    scaler = ShardedGradScaler("cuda")
    for step in range(4):
        x = torch.randn(4, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        opt.zero_grad()
        scaler.scale(model(x).square().sum()).backward()
        torch.cuda.synchronize()
        if step > 0:
            torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.unscale_(opt)
            opt.clip_grad_norm(1.0)
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ropt.zero_grad()
        ref(x).square().sum().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ropt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
