"""capturable=True: the WHOLE iteration (forward, backward with its hooks, unscale_, clip, step,
update) is captured in one CUDA graph and replayed, matching eager execution. Needs a GPU.

What a user must do, as this test does: build the optimizer with ``capturable=True`` and lr as
a device tensor (LR schedules then write that tensor), keep inputs in static tensors copied into
before each replay, warm up a few eager iterations on a side stream, then capture.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from parity import MLP
from shardamp.optim import DistributedFusedAdam
from shardamp.scaler import ShardedGradScaler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WARMUP, STEPS, INF_AT, LR_CHANGE_AT = 3, 24, 11, 16


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)
    if step == INF_AT:
        x[2, 3] = float("inf")
    return x.cuda(), y.cuda()


def _setup(model: nn.Module):
    opt = DistributedFusedAdam(
        model.parameters(), lr=torch.tensor(2e-2, device="cuda"), weight_decay=0.01, capturable=True
    )
    scaler = ShardedGradScaler("cuda", init_scale=2.0**10, growth_interval=4)
    return opt, scaler


def _iteration(model, opt, scaler, x, y):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = opt.clip_grad_norm(0.5)
    scaler.step(opt)
    scaler.update()
    return loss, norm


def test_whole_iteration_in_a_cuda_graph_matches_eager() -> None:
    torch.manual_seed(0)
    model = MLP().cuda()
    eager_model = copy.deepcopy(model)
    opt, scaler = _setup(model)
    eager_opt, eager_scaler = _setup(eager_model)

    static_x, static_y = _data(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(WARMUP):
            x, y = _data(step)
            static_x.copy_(x)
            static_y.copy_(y)
            _iteration(model, opt, scaler, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, static_norm = _iteration(model, opt, scaler, static_x, static_y)

    eager = []
    for step in range(STEPS):
        if step == LR_CHANGE_AT:
            eager_opt.param_groups[0]["lr"].fill_(5e-3)
        x, y = _data(step)
        loss, norm = _iteration(eager_model, eager_opt, eager_scaler, x, y)
        eager.append((float(loss), float(norm), eager_scaler.get_scale(), [p.detach().clone() for p in eager_model.parameters()]))

    for step in range(WARMUP, STEPS):
        if step == LR_CHANGE_AT:
            opt.param_groups[0]["lr"].fill_(5e-3)  # what an LR scheduler does with a tensor lr
        x, y = _data(step)
        static_x.copy_(x)
        static_y.copy_(y)
        before = [p.detach().clone() for p in model.parameters()]
        graph.replay()
        torch.cuda.synchronize()
        e_loss, e_norm, e_scale, e_params = eager[step]
        assert scaler.get_scale() == e_scale, f"step {step}"
        if step == INF_AT:
            assert bool(scaler.last_step_skipped)
            assert e_scale == eager[step - 1][2] / 2  # backed off
            for a, b in zip(before, model.parameters()):
                assert torch.equal(a, b)  # skipped inside the graph
        else:
            assert not bool(scaler.last_step_skipped)
            assert float(static_norm) == pytest.approx(e_norm, rel=1e-5)
            assert float(static_loss) == pytest.approx(e_loss, rel=1e-5)
        for a, b in zip(model.parameters(), e_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert max(e[2] for e in eager) > 2.0**10  # the scale grew too, inside the graph
