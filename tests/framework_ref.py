"""Shared by the framework tests (tests/cases_{lightning,accelerate,transformers}.py): a tiny
model, its data, and the unsharded reference: ``torch.optim.AdamW`` + ``clip_grad_norm_`` fed, at
every step, the union of the micro-batches all ranks saw (the mean of their mean losses, which is
what averaging the grads over ranks and micro-batches computes).

The reference runs each micro-batch's forward/backward separately, in the same autocast dtype,
and sums the grads in fp32, so that under bf16 autocast it rounds the same products as the
ranks did; in fp32 that is the union's gradient up to summation order.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

LR, BETAS, EPS, WD = 0.02, (0.9, 0.99), 1e-7, 0.1
MAX_NORM = 0.05  # well below the grads' norm (about 0.5 here): clipping engages on every step
DIM, HIDDEN, OUT = 6, 20, 3
RTOL, ATOL = 1e-5, 1e-6
BF16_RTOL, BF16_ATOL = 1e-4, 1e-5  # bf16 autocast: same products rounded, fp32 sums in another order


class TinyNet(nn.Module):
    """Linear -> tanh -> Linear: 203 elements, so the two ranks' shards are uneven."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def dataset(n: int, seed: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g), torch.randn(n, OUT, generator=g)


def decay_groups(model: nn.Module, named: bool = False) -> List[Dict]:
    """Two param groups as the transformers Trainer splits them: biases without weight decay."""
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def reference(
    steps: Sequence[Sequence[Tuple[torch.Tensor, torch.Tensor]]],
    autocast_dtype: Optional[torch.dtype] = None,
    max_norm: Optional[float] = MAX_NORM,
    seed: int = 0,
    groups: bool = True,
    lr_lambda: Optional[Callable[[int], float]] = None,
) -> Tuple[List[torch.Tensor], List[float]]:
    """Train ``make_model(seed)`` unsharded: ``steps[s]`` holds every (x, y) micro-batch of all
    ranks for optimizer step ``s``. Returns the final params and each step's pre-clip norm
    (unscaled). Under fp16 autocast a ``torch.amp.GradScaler`` (default settings) scales the
    loss, as the frameworks do. ``lr_lambda``: a LambdaLR schedule stepped after every step."""
    model = make_model(seed)
    params = decay_groups(model) if groups else [{"params": list(model.parameters()), "weight_decay": WD}]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS)
    scaler = torch.amp.GradScaler("cpu", enabled=autocast_dtype == torch.float16)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    norms = []
    for micro in steps:
        opt.zero_grad()
        for x, y in micro:
            with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                loss = loss_fn(model(x), y) / len(micro)
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        else:
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        scaler.step(opt)
        scaler.update()
        if schedule is not None:
            schedule.step()
    return [p.detach().clone() for p in model.parameters()], norms


def union_steps(per_rank: Sequence[Sequence[Tuple[torch.Tensor, torch.Tensor]]], micro_per_step: int):
    """Regroup each rank's recorded micro-batches (in order) into the union per optimizer step."""
    n = len(per_rank[0])
    assert all(len(r) == n for r in per_rank) and n % micro_per_step == 0, [len(r) for r in per_rank]
    return [
        [b for r in per_rank for b in r[s * micro_per_step:(s + 1) * micro_per_step]]
        for s in range(n // micro_per_step)
    ]


def assert_params_close(ours: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], bf16: bool = False) -> None:
    rtol, atol = (BF16_RTOL, BF16_ATOL) if bf16 else (RTOL, ATOL)
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=lambda m: f"param {i}: {m}")


def check_run(values, n_steps: int, norm_key: str, autocast_dtype=None, accumulate: int = 1, lr_lambda=None):
    """Every rank's run of a framework case against unsharded AdamW fed the union of the ranks'
    batches: clipping engaged on every step, params within tolerance, the norms under
    ``norm_key`` (returned, logged or read after each step) equal torch's, and every rank holding
    the same model. Returns ``values`` for case-specific checks."""
    union = union_steps([v["seen"] for v in values], accumulate)
    assert len(union) == n_steps
    params, norms = reference(union, autocast_dtype=autocast_dtype, lr_lambda=lr_lambda)
    assert min(norms) > MAX_NORM, norms  # clipping engaged on every step
    for v in values:
        assert_params_close(v["params"], params, bf16=autocast_dtype is not None)
        assert v[norm_key] == pytest.approx(norms, rel=1e-4), norm_key
    for a, b in zip(values[0]["params"], values[1]["params"]):
        assert torch.equal(a, b)  # every rank holds the same model
    return values


def fp16_overflow_reference(values, n_steps: int) -> Tuple[List[torch.Tensor], List[float], List[bool]]:
    """torch's run for an fp16 case whose step 2 overflows on one rank only: ``(params, norms,
    finite)``, having checked that torch skips step 2 too and clips every other step."""
    params, norms = reference(union_steps([v["seen"] for v in values], 1), autocast_dtype=torch.float16)
    finite = [math.isfinite(n) for n in norms]
    assert finite == [True, False] + [True] * (n_steps - 2), norms  # torch skips step 2 too
    assert all(n > MAX_NORM for n, f in zip(norms, finite) if f)  # clipping engaged
    return params, norms, finite


def count_reduce_scatters(run: Callable[[], Dict]) -> Dict:
    """``run()``'s result, with ``"reduce_scatters"``: how many grad reduce-scatters it issued
    (counted where every one passes, shardamp.optim._compat; read there at call time)."""
    from shardamp.optim import _compat

    calls = {"n": 0}
    original = _compat.reduce_scatter

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    _compat.reduce_scatter = counting
    try:
        out = run()
    finally:
        _compat.reduce_scatter = original
    out["reduce_scatters"] = calls["n"]
    return out
