"""The step's wrapper (optim/_compat.py ``hook_optimizer_step``): torch's step hooks, global and
per instance, and the profiler's label behave as on torch's own optimizers, while an unobserved
step skips the label. One process, no process group."""
from __future__ import annotations

import warnings
from typing import Any, List

import pytest
import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from shardamp.optim import DistributedFusedAdam, kernels

native = pytest.mark.skipif(kernels.backend(torch.device("cpu")) != "native",
                            reason="the lean step needs the compiled kernels to tell whether a label is recorded")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _backward(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    nn.functional.mse_loss(model(torch.randn(5, 6, generator=g)), torch.randn(5, 3, generator=g)).backward()


def _hook_calls(make_opt: Any) -> List[tuple]:
    """The step hooks' calls ``(hook, optimizer class, args, kwargs keys)`` over two steps, with a
    pre hook replacing the step's arguments (a closure) as torch lets it."""
    model = _model()
    opt = make_opt(model.parameters())
    calls: List[tuple] = []
    closure_calls: List[int] = []

    def closure() -> torch.Tensor:
        closure_calls.append(1)
        return torch.zeros(())

    def global_pre(o: Any, args: tuple, kwargs: dict) -> Any:
        calls.append(("global_pre", type(o).__name__ == type(opt).__name__, len(args), sorted(kwargs)))
        return args, {"closure": closure}

    def instance_pre(o: Any, args: tuple, kwargs: dict) -> None:
        calls.append(("pre", o is opt, len(args), sorted(kwargs)))

    def instance_post(o: Any, args: tuple, kwargs: dict) -> None:
        calls.append(("post", o is opt, len(args), sorted(kwargs)))

    def global_post(o: Any, args: tuple, kwargs: dict) -> None:
        calls.append(("global_post", o is opt, len(args), sorted(kwargs)))

    handles = [register_optimizer_step_pre_hook(global_pre), opt.register_step_pre_hook(instance_pre),
               opt.register_step_post_hook(instance_post), register_optimizer_step_post_hook(global_post)]
    try:
        for step in range(2):
            opt.zero_grad()
            _backward(model, step)
            out = opt.step()
            assert out is not None and float(out) == 0.0  # the closure the pre hook put in ran
    finally:
        for h in handles:
            h.remove()
    assert len(closure_calls) == 2
    return calls


def test_step_hooks_are_called_as_on_torchs_adamw() -> None:
    ours = _hook_calls(lambda p: DistributedFusedAdam(p, lr=0.01))
    torchs = _hook_calls(lambda p: torch.optim.AdamW(p, lr=0.01))
    assert ours == torchs
    assert [c[0] for c in ours[:4]] == ["global_pre", "pre", "post", "global_post"]
    assert ours[2][3] == ["closure"]  # the post hooks see the arguments the pre hook returned


def _post_hook_calls(make_opt: Any) -> List[tuple]:
    """Post hooks alone (no pre hook: the lean step path): what each call receives."""
    model = _model()
    opt = make_opt(model.parameters())
    calls: List[tuple] = []
    handles = [opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt, len(a), a[0] is o,
                                                                         sorted(k)))),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global_post", o is opt, len(a),
                                                                               a[0] is o, sorted(k))))]
    try:
        for step in range(2):
            opt.zero_grad()
            _backward(model, step)
            opt.step()
            opt.step(closure=None)
    finally:
        for h in handles:
            h.remove()
    return calls


def test_post_hooks_alone_are_called_as_on_torchs_adamw() -> None:
    ours = _post_hook_calls(lambda p: DistributedFusedAdam(p, lr=0.01))
    assert ours == _post_hook_calls(lambda p: torch.optim.AdamW(p, lr=0.01))
    assert ours[:2] == [("post", True, 1, True, []), ("global_post", True, 1, True, [])]  # args: (optimizer,)


def test_hooks_removed_the_step_trains_as_torch() -> None:
    model, ref = _model(), _model()
    opt = DistributedFusedAdam(model.parameters(), lr=0.01, weight_decay=0.02)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.02)
    seen: List[int] = []
    handle = opt.register_step_post_hook(lambda o, a, k: seen.append(1))
    for step in range(4):
        if step == 2:
            handle.remove()
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            _backward(m, step)
            o.step()
    assert len(seen) == 2
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_profiler_sees_the_step_label() -> None:
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), lr=0.01)
    _backward(model, 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#DistributedFusedAdam.step" in names, sorted(names)[:20]
    # and without a profiler the step still reaches the profiler's entry point (its python tracer)
    reached: List[int] = []
    opt._optimizer_step_code = lambda: reached.append(1)  # instance attribute: this optimizer only
    opt.zero_grad()
    _backward(model, 1)
    opt.step()
    assert reached == [1]


def _counting(base: type) -> type:
    """A subclass of ``base`` overriding ``step`` (as NeMo's wrappers of apex's optimizer do)."""

    class Counting(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner_steps = 0
            super().__init__(*args, **kwargs)

        def step(self, closure: Any = None, **kwargs: Any) -> Any:
            self.inner_steps += 1
            return super().step(closure, **kwargs)

    return Counting


def test_a_subclass_step_is_hooked_as_torchs() -> None:
    """The hooks run once per wrapped ``step`` on the way, as on a subclass of torch's AdamW
    (where the base class's step is wrapped too, both run them)."""
    counts = []
    for base in (DistributedFusedAdam, torch.optim.AdamW):
        model = _model()
        base(model.parameters(), lr=0.01)  # the base class's own step wrapped, as in any program using it
        opt = _counting(base)(model.parameters(), lr=0.01)
        assert getattr(type(opt).step, "hooked", False)
        pre: List[int] = []
        opt.register_step_pre_hook(lambda o, a, k: pre.append(1))
        for step in range(3):
            opt.zero_grad()
            _backward(model, step)
            opt.step()
        assert opt.inner_steps == 3
        counts.append(len(pre))
    assert counts[0] == counts[1] == 6, counts


def test_an_lr_scheduler_sees_the_step() -> None:
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        for step in range(3):
            opt.zero_grad()
            _backward(model, step)
            opt.step()
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 3)


def _labels_recorded(opt: Any, model: nn.Module, run: Any) -> List[str]:
    """The optimizer-step labels an execution-trace observer records while ``run(step)`` steps."""
    import json
    import tempfile

    from torch.profiler import ExecutionTraceObserver

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/et.json"
        et = ExecutionTraceObserver().register_callback(path)
        et.start()
        try:
            opt.zero_grad()
            _backward(model, 0)
            run(opt.step)
        finally:
            et.stop()
            et.unregister_callback()
        with open(path) as f:
            nodes = json.load(f)["nodes"]
    return [n["name"] for n in nodes if n["name"].startswith("Optimizer.step#")]


@native
def test_an_execution_trace_observer_sees_the_step_label() -> None:
    """A RecordFunction observer that is no profiler (torch's execution-trace observer) sees the
    step's label, as on torch's AdamW."""
    model = _model()
    ours = _labels_recorded(DistributedFusedAdam(model.parameters(), lr=0.01), model, lambda step: step())
    model = _model()
    torchs = _labels_recorded(torch.optim.AdamW(model.parameters(), lr=0.01), model, lambda step: step())
    assert ours == ["Optimizer.step#DistributedFusedAdam.step"] and torchs == ["Optimizer.step#AdamW.step"]


@native
def test_a_profiler_of_all_threads_sees_a_step_in_another_thread() -> None:
    """The profiler started in one thread with ``profile_all_threads`` (as torch's remote debug
    handler starts it) sees a step that another thread runs, where this thread's profiler
    state is off."""
    import threading

    from torch._C._profiler import _ExperimentalConfig

    names = []
    for make in (lambda p: DistributedFusedAdam(p, lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01)):
        model = _model()
        opt = make(model.parameters())
        _backward(model, 0)
        config = _ExperimentalConfig(profile_all_threads=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    experimental_config=config) as prof:
            worker = threading.Thread(target=opt.step)
            worker.start()
            worker.join()
        names.append(sorted({e.name for e in prof.events() if e.name.startswith("Optimizer.step#")}))
    assert names == [["Optimizer.step#DistributedFusedAdam.step"], ["Optimizer.step#AdamW.step"]], names


def test_a_post_hook_registered_during_the_step_runs_as_on_torch() -> None:
    """torch's wrapper reads the post hooks after the step: one registered by the step's closure
    runs on that very step."""
    seen = []
    for make in (lambda p: DistributedFusedAdam(p, lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01)):
        model = _model()
        opt = make(model.parameters())
        calls: List[str] = []

        def closure() -> torch.Tensor:
            opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
            with torch.enable_grad():
                loss = nn.functional.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 3))
                loss.backward()
            return loss

        opt.zero_grad()
        opt.step(closure)
        seen.append(calls)
    assert seen == [["post"], ["post"]], seen
