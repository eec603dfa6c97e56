"""capturable=True: the WHOLE iteration (forward, backward with its hooks, unscale_, clip, step,
update) is captured in one CUDA graph and replayed, matching eager execution. Needs a GPU; the
multi-rank variant (NCCL reduce-scatter, all-reduce and all-gather inside the graph, an inf on
one rank only) needs two.

What a user must do, as this test does: build the optimizer with ``capturable=True`` and lr as
a device tensor (LR schedules then write that tensor), keep inputs in static tensors copied into
before each replay, warm up a few eager iterations on a side stream, then capture.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_helper import run_distributed
from parity import MLP
from shardamp.optim import DistributedFusedAdam
from shardamp.scaler import ShardedGradScaler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WARMUP, STEPS, INF_AT, LR_CHANGE_AT = 3, 24, 11, 16
INF_RANK = 1  # the multi-rank test puts its inf on this rank's batch only


def _data(step: int, rank: int = 0, inf_rank: int = 0):
    """Rank ``rank``'s batch for ``step`` (rank 0: the world-1 test's), with an inf at INF_AT on
    ``inf_rank`` only."""
    g = torch.Generator().manual_seed(step if rank == 0 else 1000 * rank + step)
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)
    if step == INF_AT and rank == inf_rank:
        x[2, 3] = float("inf")
    return x.cuda(), y.cuda()


def _setup(model: nn.Module, process_group: Optional[Any] = None):
    opt = DistributedFusedAdam(
        model.parameters(), lr=torch.tensor(2e-2, device="cuda"), weight_decay=0.01, capturable=True,
        process_group=process_group,
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


def _warm_up_and_capture(model, opt, scaler, batch: Callable[[int], Any], iteration: Optional[Callable] = None):
    """What a user does: WARMUP eager iterations on a side stream over static input tensors (on
    several ranks this also sets up NCCL's connections for exactly the collectives the graph
    will hold), then one iteration captured. ``iteration(x, y)``: one iteration (default: the
    scaler's loop, :func:`_iteration`). Returns the graph, the static inputs and what the captured
    iteration returned."""
    if iteration is None:
        iteration = lambda x, y: _iteration(model, opt, scaler, x, y)  # noqa: E731
    static_x, static_y = batch(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(WARMUP):
            x, y = batch(step)
            static_x.copy_(x)
            static_y.copy_(y)
            iteration(static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()  # no warm-up collective still in flight when capture begins

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = iteration(static_x, static_y)
    return graph, static_x, static_y, static_out


def _replay(graph, static_x, static_y, model, step: int) -> List[torch.Tensor]:
    """Step ``step``'s batch into the static inputs, one replay, synchronized; returns the
    params as they were before it."""
    x, y = _data(step)
    static_x.copy_(x)
    static_y.copy_(y)
    before = [p.detach().clone() for p in model.parameters()]
    graph.replay()
    torch.cuda.synchronize()
    return before


def test_whole_iteration_in_a_cuda_graph_matches_eager() -> None:
    torch.manual_seed(0)
    model = MLP().cuda()
    eager_model = copy.deepcopy(model)
    opt, scaler = _setup(model)
    eager_opt, eager_scaler = _setup(eager_model)

    graph, static_x, static_y, (static_loss, static_norm) = _warm_up_and_capture(model, opt, scaler, _data)

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
        before = _replay(graph, static_x, static_y, model, step)
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


def _plain_iteration(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def test_an_unclipped_step_without_a_scaler_in_a_cuda_graph_matches_eager() -> None:
    """No scaler and no clip: the step finishes its stats in its own native call, the finish,
    the scalars and the records in one launch into the optimizer's records buffer. Captured and
    replayed, it matches eager; the inf step is skipped inside the graph too."""
    torch.manual_seed(0)
    model = MLP().cuda()
    eager_model = copy.deepcopy(model)
    opt, eager_opt = (DistributedFusedAdam(m.parameters(), lr=torch.tensor(2e-2, device="cuda"), weight_decay=0.01,
                                           capturable=True) for m in (model, eager_model))
    graph, static_x, static_y, static_loss = _warm_up_and_capture(
        model, opt, None, _data, lambda x, y: _plain_iteration(model, opt, x, y))

    eager = []
    for step in range(STEPS):
        loss = _plain_iteration(eager_model, eager_opt, *_data(step))
        eager.append((float(loss), [p.detach().clone() for p in eager_model.parameters()]))
    for step in range(WARMUP, STEPS):
        before = _replay(graph, static_x, static_y, model, step)
        e_loss, e_params = eager[step]
        if step == INF_AT:
            for a, b in zip(before, model.parameters()):
                assert torch.equal(a, b)  # skipped inside the graph
        else:
            assert float(static_loss) == pytest.approx(e_loss, rel=1e-5)
        for a, b in zip(model.parameters(), e_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert opt.step_stats()["skipped_nonfinite"] == eager_opt.step_stats()["skipped_nonfinite"] == 1


SPIKE_AT, SPIKE_ABOVE = 14, 100.0


def test_step_health_inside_a_cuda_graph() -> None:
    """skip_grad_norm_above inside the graph: the spike step is skipped on the device, the scale
    neither backs off nor stops growing; the overflow step is named when asked (read from the
    device flags after the replay: no per-step read-back), and step_stats() counts the replayed
    steps (the counters live on the device)."""
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = DistributedFusedAdam(model.named_parameters(), lr=torch.tensor(2e-2, device="cuda"), weight_decay=0.01,
                               capturable=True, skip_grad_norm_above=SPIKE_ABOVE)
    scaler = ShardedGradScaler("cuda", init_scale=2.0**10, growth_interval=4)
    graph, static_x, static_y, (_loss, static_norm) = _warm_up_and_capture(model, opt, scaler, _data)
    applied, scale = WARMUP, scaler.get_scale()
    for step in range(WARMUP, STEPS):
        x, y = _data(step)
        static_x.copy_(x)
        static_y.copy_(y * 1000.0 if step == SPIKE_AT else y)
        before = [p.detach().clone() for p in model.parameters()]
        graph.replay()
        torch.cuda.synchronize()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert unchanged == (step in (INF_AT, SPIKE_AT)), step
        assert opt.last_nonfinite() == ([(0, "a.weight")] if step == INF_AT else []), step
        stats = opt.step_stats()
        applied += step not in (INF_AT, SPIKE_AT)
        assert stats["steps"] == applied and stats["skipped_nonfinite"] == (step >= INF_AT), (step, stats)
        assert stats["skipped_spike"] == (step >= SPIKE_AT), (step, stats)
        assert stats["consecutive_skips"] == (step in (INF_AT, SPIKE_AT)), (step, stats)
        assert stats["loss_scale"] == scaler.get_scale()
        if step == SPIKE_AT:
            assert float(static_norm) > SPIKE_ABOVE and not bool(scaler.last_step_skipped)
            assert scaler.get_scale() >= scale  # no back-off for a spike
        elif step != INF_AT:
            assert stats["last_grad_norm"] == pytest.approx(float(static_norm), rel=1e-6)
        scale = scaler.get_scale()


# ====================================================================== world 2, NCCL
def _params(model: nn.Module) -> List[torch.Tensor]:
    return [p.detach().cpu().clone() for p in model.parameters()]


def _graph_vs_eager_on_ranks(rank: int, world: int) -> Dict[str, List[Dict[str, Any]]]:
    """One rank of the multi-rank test: the world-1 test's graph and eager runs on this rank's
    batches. Records every step and asserts nothing: a rank that stopped early would leave the
    others waiting in a collective until the timeout; the test checks the records."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = MLP().cuda()
    eager_model = copy.deepcopy(model)
    opt, scaler = _setup(model)
    # the eager twin gets its own group: one DistributedFusedAdam per process group (docs/known-limits.md)
    eager_opt, eager_scaler = _setup(eager_model, dist.new_group(list(range(world))))

    graph, static_x, static_y, (static_loss, static_norm) = _warm_up_and_capture(
        model, opt, scaler, lambda step: _data(step, rank, INF_RANK))

    eager = []
    for step in range(STEPS):
        if step == LR_CHANGE_AT:
            eager_opt.param_groups[0]["lr"].fill_(5e-3)
        x, y = _data(step, rank, INF_RANK)
        loss, norm = _iteration(eager_model, eager_opt, eager_scaler, x, y)
        eager.append(dict(step=step, loss=float(loss.detach()), norm=float(norm), scale=eager_scaler.get_scale(),
                          skipped=bool(eager_scaler.last_step_skipped), params=_params(eager_model)))

    replayed = []
    for step in range(WARMUP, STEPS):
        if step == LR_CHANGE_AT:
            opt.param_groups[0]["lr"].fill_(5e-3)
        x, y = _data(step, rank, INF_RANK)
        static_x.copy_(x)
        static_y.copy_(y)
        before = [p.detach().clone() for p in model.parameters()]
        graph.replay()
        torch.cuda.synchronize()
        replayed.append(dict(
            step=step, loss=float(static_loss), norm=float(static_norm), scale=scaler.get_scale(),
            skipped=bool(scaler.last_step_skipped), params=_params(model),
            unchanged=all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
            # read from the device flags (every rank asks: after an overflow it all-gathers them)
            named=opt.last_nonfinite(),
        ))
    graph.reset()  # release the graph (and NCCL's resources it holds) before the group goes
    torch.cuda.synchronize()
    return {"eager": eager, "replayed": replayed}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank each)")
def test_whole_iteration_graph_on_two_nccl_ranks_matches_eager() -> None:
    """Each rank captures forward + backward (reduce-scatter) + unscale_ + clip + step
    (all-reduce, all-gather) + update in one graph and replays it; an inf on rank INF_RANK's
    batch only at INF_AT: every rank skips that step inside the graph and backs off the same
    scale, and the replayed params equal an eager run of the same ranks."""
    per_rank = run_distributed(_graph_vs_eager_on_ranks, 2, backend="nccl", timeout=300.0)
    for rank, result in enumerate(per_rank):
        eager = result["eager"]
        for rec in result["replayed"]:
            step = rec["step"]
            e = eager[step]
            where = f"rank {rank} step {step}"
            assert rec["skipped"] == e["skipped"] == (step == INF_AT), where
            assert rec["scale"] == e["scale"], where
            assert rec["named"] == ([(INF_RANK, "group 0, param 0, shape (20, 12)")] if step == INF_AT else []), where
            if step == INF_AT:
                assert rec["unchanged"], where  # skipped inside the graph
                assert e["scale"] == eager[step - 1]["scale"] / 2, where  # backed off
                # the norm is global: non-finite on the rank whose own batch was clean, too
                assert not math.isfinite(rec["norm"]) and not math.isfinite(e["norm"]), where
            else:
                assert not rec["unchanged"], where
                assert rec["norm"] == pytest.approx(e["norm"], rel=1e-5), where
                assert rec["loss"] == pytest.approx(e["loss"], rel=1e-5), where
            for i, (a, b) in enumerate(zip(rec["params"], e["params"])):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} param {i}: {m}")
        assert max(e["scale"] for e in eager) > 2.0**10  # the scale grew too, inside the graph
    # the ranks agree: same skipped step, same scale, same global norm, the same model
    first = per_rank[0]["replayed"]
    for rank, result in enumerate(per_rank[1:], start=1):
        for a, b in zip(first, result["replayed"]):
            where = f"rank {rank} step {a['step']}"
            assert (a["skipped"], a["scale"]) == (b["skipped"], b["scale"]), where
            if not a["skipped"]:
                assert a["norm"] == pytest.approx(b["norm"], rel=1e-6), where
            assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), where
