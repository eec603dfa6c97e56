"""DDP around a DistributedFusedAdam's model raises naming DDP; FSDP2 + torch AdamW (fused and
foreach) + ShardedGradScaler trains like unsharded torch, inf on one rank's shard included."""
from __future__ import annotations

import functools

import pytest
import torch

import cases_wrappers as cases
import framework_ref as ref
from dist_helper import case_values, run_cases, run_distributed

WORLD = 2


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_distributed(run_cases, world, "cases_wrappers", cases.CASES)


@pytest.mark.parametrize("world", [WORLD])
@pytest.mark.parametrize("case", ["case_ddp_after_optimizer", "case_ddp_before_optimizer"])
def test_ddp_wrapped_model_raises_naming_ddp_and_the_fix(world, case) -> None:
    for message in case_values(_results(world), case):  # on every rank
        assert "DistributedDataParallel" in message and "Do not wrap the model in DDP" in message, message
        assert "ShardampStrategy" in message


def fsdp2_reference(values, dtype, clip, device="cpu"):
    """Unsharded AdamW + torch.amp.GradScaler(init 1024) on the union, the same inf at INF_STEP."""
    model = ref.make_model().to(device)
    opt = torch.optim.AdamW(ref.decay_groups(model), lr=ref.LR, betas=ref.BETAS, eps=ref.EPS)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    scales, norms = [], []
    for step in range(cases.STEPS):
        opt.zero_grad()
        for v in values:  # per rank chunk, loss / world: the products bf16/fp16 round are the ranks'
            xb, yb = (t.to(device) for t in v["seen"][step])
            with torch.autocast(device, dtype=dtype):
                loss = ref.loss_fn(model(xb), yb) / len(values)
            scaler.scale(loss).backward()
        if step == cases.INF_STEP:
            model.fc1.weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), ref.MAX_NORM)))
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return [p.detach().cpu() for p in model.parameters()], scales, norms


FSDP2 = [
    ("case_fsdp2_fused_fp16", torch.float16, True),
    ("case_fsdp2_fused_fp16_step_only", torch.float16, False),
    ("case_fsdp2_foreach_fp16", torch.float16, True),
    ("case_fsdp2_fused_bf16", torch.bfloat16, True),
    ("case_fsdp2_foreach_bf16", torch.bfloat16, True),
]


@pytest.mark.parametrize("world", [WORLD])
@pytest.mark.parametrize("case, dtype, clip", FSDP2)
def test_fsdp2_with_sharded_grad_scaler_matches_torch(world, case, dtype, clip) -> None:
    check_fsdp2(case_values(_results(world), case), dtype, clip)


def check_fsdp2(values, dtype, clip, device="cpu") -> None:
    params, scales, norms = fsdp2_reference(values, dtype, clip, device)
    assert scales[cases.INF_STEP] == scales[cases.INF_STEP - 1] / 2  # the reference backed off once
    for v in values:
        assert v["scales"] == scales  # every rank: the same scale as torch, step by step
        assert v["skipped"] == [s == cases.INF_STEP for s in range(cases.STEPS)]  # both ranks skipped
        if clip:
            finite = [n for i, n in enumerate(norms) if i != cases.INF_STEP]
            assert min(finite) > ref.MAX_NORM
            assert [n for i, n in enumerate(v["norms"]) if i != cases.INF_STEP] == pytest.approx(finite, rel=1e-4)
        ref.assert_params_close(v["params"], params, bf16=True)
