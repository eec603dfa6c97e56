"""DistributedFusedAdam in one process (no process group: world 1) against torch.optim.AdamW:
the torch.optim behaviours a drop-in must keep."""
from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from conftest import set_env
import torch.nn as nn

from shardamp.optim import DistributedFusedAdam


def _pair(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    kw.setdefault("weight_decay", 0.02)
    torch_kw = {k: v for k, v in kw.items() if k != "max_grad_norm"}
    return (model, DistributedFusedAdam(model.parameters(), lr=0.01, **kw),
            ref, torch.optim.AdamW(ref.parameters(), lr=0.01, **torch_kw))


def _close(model, ref):
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _loss(m, step):
    g = torch.Generator().manual_seed(step)
    return nn.functional.mse_loss(m(torch.randn(5, 6, generator=g)), torch.randn(5, 3, generator=g))


def test_zero_grad_set_to_none_false_keeps_updating_like_torch() -> None:
    model, opt, ref, ropt = _pair()
    for m, o in ((model, opt), (ref, ropt)):
        _loss(m, 0).backward()
        o.step()
        o.zero_grad(set_to_none=False)
        o.step()  # zero grads: weight decay and momentum still move the params
        o.step()
    _close(model, ref)
    assert not torch.equal(model[0].weight, _pair()[0][0].weight)


def test_step_twice_without_new_grads_reapplies_them_like_torch() -> None:
    model, opt, ref, ropt = _pair()
    for m, o in ((model, opt), (ref, ropt)):
        _loss(m, 1).backward()
        o.step()
        o.step()
    _close(model, ref)


def test_accumulation_without_no_sync_like_torch() -> None:
    model, opt, ref, ropt = _pair()
    for m, o in ((model, opt), (ref, ropt)):
        for step in range(3):
            _loss(m, 10 + step).backward()
            _loss(m, 20 + step).backward()  # two backwards, one step: grads add up
            o.step()
            o.zero_grad()
    _close(model, ref)


def test_closure_like_torch() -> None:
    model, opt, ref, ropt = _pair()
    for m, o in ((model, opt), (ref, ropt)):
        for step in range(3):
            def closure(m=m, o=o, step=step):
                o.zero_grad()
                loss = _loss(m, step)
                loss.backward()
                return loss

            loss = o.step(closure)
            assert isinstance(loss, torch.Tensor) and loss.dim() == 0  # step returns the closure's loss
    _close(model, ref)


@pytest.mark.filterwarnings("ignore:DistributedFusedAdam. backward after step")
def test_grad_norm_after_step_is_that_steps_norm() -> None:
    model, opt, ref, _ = _pair(max_grad_norm=0.1)
    _loss(model, 3).backward()
    _loss(ref, 3).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    opt.step()
    assert float(opt.grad_norm()) == pytest.approx(float(expected), rel=1e-5)
    _loss(model, 4).backward()  # new grads: the cache is dropped
    assert float(opt.grad_norm()) != pytest.approx(float(expected), rel=1e-5)


def test_non_finite_grads_skip_without_a_scaler() -> None:
    model, opt, _, _ = _pair()
    before = [p.detach().clone() for p in model.parameters()]
    (_loss(model, 5) * float("nan")).backward()
    opt.step()
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    assert torch.all(opt._steps == 0)  # the per-param step counts did not advance


def test_lr_tensor_and_param_group_edits_take_effect() -> None:
    model, opt, ref, ropt = _pair()
    for step in range(4):
        for o in (opt, ropt):
            o.param_groups[0]["lr"] = 0.01 * (step + 1)
            o.param_groups[0]["weight_decay"] = 0.1 * step
            o.param_groups[0]["betas"] = (0.8, 0.99)
        for m, o in ((model, opt), (ref, ropt)):
            _loss(m, 30 + step).backward()
            o.step()
            o.zero_grad()
    _close(model, ref)


@pytest.mark.parametrize("key, bad, match", [
    ("lr", -0.01, "lr=-0.01"), ("lr", True, "lr=True"), ("lr", float("nan"), "lr=nan"), ("lr", float("inf"), "lr=inf"),
    ("betas", [0.9, 0.99, 0.5], "betas="), ("betas", (0.9, 1.0), "betas="), ("eps", float("inf"), "eps=inf"),
    ("weight_decay", -1, "weight_decay=-1"), ("amsgrad", True, "amsgrad=True"),
])
def test_a_value_made_invalid_after_steps_with_the_same_values_still_raises(key, bad, match) -> None:
    """The step skips validating groups whose values validated last time (a host-time cache): any
    change, to a value equal in float but of another type (True for 1) too, is checked again."""
    model, opt, ref, ropt = _pair()
    for step in range(3):  # the same values every step: the cached path after the first
        for m, o in ((model, opt), (ref, ropt)):
            _loss(m, 40 + step).backward()
            o.step()
            o.zero_grad()
    _close(model, ref)
    if key == "lr" and bad is True:
        opt.param_groups[0]["lr"] = 1  # an int equal to the float: valid, trains as torch would
        ropt.param_groups[0]["lr"] = 1
        for m, o in ((model, opt), (ref, ropt)):
            _loss(m, 50).backward()
            o.step()
            o.zero_grad()
        _close(model, ref)
    opt.param_groups[0][key] = bad
    _loss(model, 51).backward()
    with pytest.raises(ValueError, match=re.escape(f"param_groups[0]: {match}")):
        opt.step()


def test_repr_names_layout_and_groups() -> None:
    _, opt, _, _ = _pair()
    text = repr(opt)
    assert "world_size=1" in text and "group 0: 4 params" in text and "lr=0.01" in text


def test_lr_scheduler_with_grad_scaler_handover_like_torch() -> None:
    """torch's LR schedulers wrap opt.step; GradScaler must still see the grad_scaler keyword."""
    import warnings

    model, opt, ref, ropt = _pair()
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, ropt)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            for m, o, sched, scaler in zip((model, ref), (opt, ropt), scheds, scalers):
                scaler.scale(_loss(m, 40 + step)).backward()
                scaler.step(o)
                scaler.update()
                sched.step()
                o.zero_grad()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert scalers[0].get_scale() == scalers[1].get_scale()
    _close(model, ref)


def test_frozen_params_are_never_updated() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = DistributedFusedAdam(model.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(3):
        _loss_small = nn.functional.mse_loss(model(torch.randn(3, 4)), torch.randn(3, 2))
        _loss_small.backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(model[0].weight, frozen)
    assert 0 not in opt.state_dict()["state"]  # no state for a param never updated, as torch


def _train_three_steps():
    model, opt, ref, ropt = _pair()
    for step in range(3):
        for m, o in ((model, opt), (ref, ropt)):
            _loss(m, 50 + step).backward()
            o.step()
            o.zero_grad()
    _close(model, ref)


def test_reference_kernels_forced_by_env(monkeypatch) -> None:
    from shardamp.optim import kernels

    set_env(monkeypatch, "SHARDAMP_KERNELS", "reference")
    assert kernels.backend(torch.device("cpu")) == "reference"
    _train_three_steps()


def test_failed_build_warns_once_and_falls_back(monkeypatch) -> None:
    from shardamp.optim.kernels import build as _build, dispatch as kernels

    def broken(cuda, device=None):
        raise RuntimeError("compiler said no\n" + "\n".join(f"log line {i}" for i in range(50)))

    monkeypatch.setattr(_build, "load_extension", broken)
    monkeypatch.setattr(kernels, "_native_cache", {})
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.delenv("SHARDAMP_KERNELS", raising=False)
    with pytest.warns(RuntimeWarning, match="could not be built: the build failed: compiler said no\\. Running the"):
        assert kernels.backend(torch.device("cpu")) == "reference"
    _train_three_steps()
    monkeypatch.setattr(kernels, "_native_cache", {})
    set_env(monkeypatch, "SHARDAMP_KERNELS", "native")
    with pytest.raises(RuntimeError, match="SHARDAMP_KERNELS=native"):
        kernels.backend(torch.device("cpu"))
    with pytest.raises(ValueError, match="SHARDAMP_KERNELS"):
        set_env(monkeypatch, "SHARDAMP_KERNELS", "fast")


@pytest.mark.parametrize("param_dtype, state_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64)])
def test_float64_params_or_state_take_the_reference_path(param_dtype, state_dtype) -> None:
    """Dtypes the kernels do not take (fp64 grads, fp64 master/moments) still train like torch."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3).to(param_dtype)
    ref = copy.deepcopy(model).double()
    opt = DistributedFusedAdam(model.parameters(), lr=0.05, dtype=state_dtype)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.0)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 6, generator=g, dtype=torch.float64)
        model(x.to(param_dtype)).square().mean().backward()
        ref(x).square().mean().backward()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_model_zero_grad_instead_of_opt_zero_grad_warns() -> None:
    """model.zero_grad() cannot clear grads that live in the optimizer's shards: the next
    backward after a step without opt.zero_grad() says so (once), instead of silently
    accumulating; with opt.zero_grad() nothing is said."""
    import warnings

    model, opt, _, _ = _pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
    _loss(model, 4).backward()
    opt.step()
    model.zero_grad()  # what many training loops call: it does not reach the optimizer's shards
    with pytest.warns(UserWarning, match="call opt.zero_grad\\(\\) every step"):
        _loss(model, 5).backward()
    opt.step()
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per optimizer
        _loss(model, 6).backward()


def test_load_state_dict_keeps_a_tensor_lr_object() -> None:
    """capturable users give lr as a tensor that graphs and schedulers hold: loading a state
    dict writes the loaded lr INTO that tensor instead of replacing it."""
    model, _, _, _ = _pair()
    lr = torch.tensor(0.01)
    opt = DistributedFusedAdam(model.parameters(), lr=lr, capturable=True)
    _loss(model, 60).backward()
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = 0.5
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == 0.5
    sd["param_groups"][0]["lr"] = torch.tensor(0.25)  # a saved tensor lr: its value, same object
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == 0.25


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
def test_norm_math_matches_torch(norm_type: float) -> None:
    """norms.py, the one home of the norm math (partials over shards from kernels/partials.py): partials combined and rooted,
    norms of disjoint sets combined, and the clip coefficients, against torch's."""
    from shardamp.optim import norms
    from shardamp.optim.kernels import partials

    torch.manual_seed(0)
    grads = [torch.randn(7), torch.randn(3, 5), torch.randn(1)]
    want = torch.nn.utils.get_total_norm(grads, norm_type)
    parts = torch.empty(norms.PARTIAL)
    partials.partial([g.reshape(-1) for g in grads], norm_type, parts)
    assert parts[1] == 0.0  # all finite
    torch.testing.assert_close(norms.root(parts[0], norm_type), want, rtol=1e-5, atol=0)
    each = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    torch.testing.assert_close(norms.combine(each, norm_type, torch.device("cpu")), want, rtol=1e-5, atol=0)
    # clipping: torch's coefficient, and two clips in a row clip the already-clipped grads
    torch.testing.assert_close(norms.clip_coef(1.0, want), torch.clamp(1.0 / (want + 1e-6), max=1.0))
    two = norms.chained_clip_coef([(2.0, want), (1.0, want)])
    first = torch.clamp(2.0 / (want + 1e-6), max=1.0)
    torch.testing.assert_close(two, first * torch.clamp(1.0 / (want * first + 1e-6), max=1.0))
    assert norms.chained_clip_coef([]) is None
    nan = torch.tensor(float("nan"))
    assert norms.clip_coef(1.0, nan) == 1.0 and torch.isnan(norms.torch_clip_coef(1.0, nan))
    bad = grads + [torch.tensor([float("inf")])]
    partials.partial([g.reshape(-1) for g in bad], norm_type, parts)
    assert parts[1] > 0  # the non-finite flag


def test_single_process_comm_has_nothing_to_communicate() -> None:
    """World 1 is a Comm whose policies say so (no reduction, no peers, no all-gather), and the
    optimizer built there asks them instead of comparing world sizes."""
    from shardamp.optim.comm import Comm, make_comm

    comm = make_comm()
    assert type(comm) is Comm and not (comm.reduces_grads or comm.has_peers or comm.gathers_params)
    opt = DistributedFusedAdam(nn.Linear(3, 2).parameters())
    assert opt._grad_sync.in_place and opt._grad_sync.release_shards


def test_deferred_flags_reuse_two_pinned_slots_in_turn(monkeypatch) -> None:
    """The CUDA path of deferred_checks.DeferredChecks (pinned buffers and events faked): two
    slots used in turn, so the next push never writes the buffer whose flags are still pending,
    reused while the flags' shape repeats, made anew when it changes; the values read back are
    the ones pushed."""
    from shardamp.optim.checks import deferred as deferred_checks

    made = []

    class FakeEvent:
        def record(self, stream=None) -> None:
            pass

        def query(self) -> bool:
            return True

    def empty(shape, dtype, pin_memory):
        assert pin_memory
        made.append(torch.zeros(shape, dtype=dtype))
        return made[-1]

    from shardamp.optim import _compat

    monkeypatch.setattr(deferred_checks.torch, "empty", empty)
    monkeypatch.setattr(deferred_checks.torch.cuda, "Event", FakeEvent)
    # the stream, event and capture queries go through _compat's shortcuts to torch.cuda's C functions
    monkeypatch.setattr(_compat, "cuda_capturing", lambda: False)
    monkeypatch.setattr(_compat, "cuda_current_stream", lambda device: None)
    monkeypatch.setattr(_compat, "cuda_event_record", lambda event, stream: event.record(stream))
    monkeypatch.setattr(_compat, "cuda_event_query", lambda event: event.query())
    checks = deferred_checks.DeferredChecks(torch.device("cuda"))
    buffers = []
    for step, flags in enumerate([[1.0, 0.0], [0.0, 0.0], [2.0, 1.0], [3.0, 0.0, 1.0], [4.0, 1.0, 0.0], [5.0, 5.0, 5.0]]):
        previous = checks.pending
        checks.push(torch.tensor(flags), {"step": step})
        host = checks.pending[0]
        assert previous is None or host is not previous[0], step  # never the pending buffer
        buffers.append(host)
        values, context = checks.ready(force=True)
        assert values == flags and context == {"step": step}
    assert buffers[2] is buffers[0] and buffers[1] is not buffers[0]  # shape repeats: reused in turn
    assert buffers[3] is not buffers[1] and buffers[5] is buffers[3]  # a new shape: new slots, then reused
    assert len(made) == 4


def test_scaled_steps_read_nothing_back_and_train_as_torch(monkeypatch) -> None:
    """A step whose scaler unscaled it, with found-inf the only flag, records nothing for the
    host (the scaler acts on found-inf itself): no flags pushed. It still trains as
    torch.amp.GradScaler + AdamW, an inf step included, and resets the count of unscaled skips,
    so the no-scaler warning still needs three skipped steps in a row without a scaler."""
    from shardamp.optim.step import health as step_health
    from shardamp.scaler import ShardedGradScaler

    pushed = []  # each step record the host read back (pushed: copied, or written by the step's native call)
    real_observe = step_health.StepHealth.observe
    monkeypatch.setattr(step_health.StepHealth, "observe",
                        lambda self, step, values, scaled: (pushed.append(list(values)),
                                                            real_observe(self, step, values, scaled)))
    model, opt, ref, ropt = _pair()
    scaler, rscaler = ShardedGradScaler("cpu", init_scale=2.0 ** 8), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for step in range(4):
        for m, o, s in ((model, opt, scaler), (ref, ropt, rscaler)):
            o.zero_grad()
            loss = _loss(m, step) * (float("inf") if step == 1 else 1.0)
            s.scale(loss).backward()
            s.unscale_(o)
            s.step(o)
            s.update()
        assert scaler.get_scale() == rscaler.get_scale(), step
        _close(model, ref)
    assert pushed == []

    def skipped_step(step: int) -> None:  # without a scaler: each step's flags are read back
        opt.zero_grad()
        (_loss(model, step) * float("nan")).backward()
        opt.step()

    def scaled_step() -> None:
        opt.zero_grad()
        scaler.scale(_loss(model, 9)).backward()
        scaler.step(opt)
        scaler.update()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # two in a row do not warn yet, and a scaled step clears them
        skipped_step(0)
        skipped_step(1)
        n = len(pushed)
        scaled_step()
        assert len(pushed) == n  # a scaled step reads nothing back
        skipped_step(2)
        skipped_step(3)
    with pytest.warns(RuntimeWarning, match="skipped"):
        skipped_step(4)
    # the health record alone (no other flag was checked): [reason 1 (non-finite), unscaled norm
    # NaN, ranks with own non-finite grads 1, inverse scale 1 (no scaler)], as the step wrote it
    assert len(pushed) == 5
    for flags in pushed:
        assert flags[0] == 1.0 and math.isnan(flags[1]) and flags[2:] == [1.0, 1.0], flags


def test_clean_interpreter_exit_after_training(tmp_path) -> None:
    """A script that trains and ends without cleaning up exits quietly: no "Exception ignored"
    from the grad hooks' finaliser while the interpreter tears its modules down."""
    import subprocess
    import sys

    script = tmp_path / "train_and_exit.py"
    script.write_text(
        "import torch\n"
        "from shardamp.optim import DistributedFusedAdam\n"
        "m = torch.nn.Linear(4, 4)\n"
        "opt = DistributedFusedAdam(m.parameters(), lr=0.1)\n"
        "m(torch.randn(2, 4)).sum().backward()\n"
        "opt.step()\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "Exception ignored" not in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("set_to_none", [True, False])
def test_landed_norm_over_buckets_and_rounds_is_torchs(set_to_none: bool) -> None:
    """One process: each bucket's norm partial is formed as it lands (the first bucket of a round
    replaces the shared row, the others add) and the step reads it. Several buckets, two param
    groups, two backward rounds before a step (the second leaves one layer without a grad), and
    zero_grad between steps: every step's norm and the clipped params equal torch's AdamW after
    ``clip_grad_norm_``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 3))
    ref = copy.deepcopy(model)
    groups = lambda m: [{"params": list(m[0].parameters()) + list(m[4].parameters())},  # noqa: E731
                        {"params": m[2].parameters(), "weight_decay": 0.0}]
    opt = DistributedFusedAdam(groups(model), lr=0.01, weight_decay=0.02, bucket_cap_mb=0.004, max_grad_norm=0.5)
    ropt = torch.optim.AdamW(groups(ref), lr=0.01, weight_decay=0.02)
    assert len(opt._buckets) >= 3  # the per-bucket partials are added, not just one
    for step in range(4):
        for m in (model, ref):
            _loss(m, 10 + step).backward()
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(50 + step))
            m[2:](m[1](m[0](x)).detach()).square().mean().backward()  # layer 0 gets no grad this round
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(opt.grad_norm(), expected, rtol=1e-5, atol=0.0)
        opt.step()
        ropt.step()
        _close(model, ref)
        opt.zero_grad(set_to_none=set_to_none)
        ropt.zero_grad(set_to_none=set_to_none)
