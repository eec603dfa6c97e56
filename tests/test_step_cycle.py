"""The step cycle (optim/step/cycle.py): one object owns the step's phase and counters, every
loop walks the phases in order while training as torch does, and no module writes another
object's private attributes."""
from __future__ import annotations

import ast
import copy
import math
from pathlib import Path
from typing import List

import pytest
import torch
import torch.nn as nn

from shardamp.optim import DistributedFusedAdam
from shardamp.optim.step.cycle import StepCycle, StepPhase
from shardamp.scaler import ShardedGradScaler

ROOT = Path(__file__).resolve().parents[1]
IDLE, ACC, RED, UNS, STEP = (StepPhase.IDLE, StepPhase.ACCUMULATING, StepPhase.REDUCED, StepPhase.UNSCALED,
                             StepPhase.STEPPED)


def _cycle() -> StepCycle:
    return StepCycle(0.5, torch.tensor(0.5))


def test_transitions_and_counters() -> None:
    c = _cycle()
    assert c.phase is IDLE and not c.grad_since_zero and c.last_step() is None
    assert c.backward_began() is False  # nothing was stepped on yet
    assert c.phase is ACC and c.grad_since_zero and c.backwards == 1
    c.round_launched()
    assert c.rounds_since_step == 1
    c.reduced("", ["a", "b"])
    assert c.phase is RED and c.names == ["a", "b"] and c.problem == ""
    c.unscaled(torch.tensor(0.25))
    assert c.phase is UNS and c.scaled and float(c.inv_scale) == 0.25
    c.current().add_clip(1.0, torch.tensor(3.0))
    c.stepped([c_ for c_, _ in c.current().clips], {2.0: torch.tensor(3.0)}, cache_after_step=True)
    assert c.phase is STEP and c.rounds_since_step == 0 and c.stepped_since_zero
    assert c.clips_of_last_step() == ((1.0,), (2.0,))
    assert c.last_step() is not None and c.inv_scale is None  # a new round: the scale is the next step's
    assert c.position() == {"steps": 1, "backwards": 0, "dropped": 0}
    # zero_grad keeps the step's norms readable; a backward forgets them
    c.grads_dropped(set_to_none=True)
    assert c.phase is STEP and c.last_step() is not None and not c.grad_since_zero
    assert c.backward_began() is False and c.phase is ACC and c.last_step() is None
    # a round no step consumed, dropped: counted where the ranks' collectives are compared
    c.round_launched()
    c.grads_dropped(set_to_none=True)
    assert c.phase is IDLE and c.position() == {"steps": 1, "backwards": 1, "dropped": 1}


def test_backward_after_a_step_without_zero_grad_is_reported_once_per_step() -> None:
    c = _cycle()
    c.backward_began()
    c.stepped([], {2.0: torch.tensor(1.0)}, cache_after_step=True)
    assert c.backward_began() is True  # the caller warns: the new grads add to stepped ones
    assert c.backward_began() is False


def test_warn_once_and_zero_grad_keeping_zeros() -> None:
    c = _cycle()
    assert c.warn_once("x") and not c.warn_once("x") and c.warn_once("y")
    c.backward_began()
    c.grads_dropped(set_to_none=False)  # kept as zeros: the next step still updates them
    assert c.grad_since_zero and c.phase is IDLE


def _pair(seed: int = 0, groups: bool = True):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    ref.load_state_dict(model.state_dict())

    def param_groups(m):
        ps = list(m.parameters())
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "lr": 0.02}] if groups else ps

    opt = DistributedFusedAdam(param_groups(model), lr=0.05, weight_decay=0.0)
    torch_opt = torch.optim.AdamW(param_groups(ref), lr=0.05, weight_decay=0.0)
    return model, ref, opt, torch_opt


def _loss(m: torch.nn.Module, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return m(x).pow(2).mean() * scale


def test_phases_of_the_loops_match_torch() -> None:
    """No scaler with a clip; a logged norm then more accumulation (the stats are computed
    anew); a scaler's unscale_; zero_grad dropping a round: every phase in order, and the
    params equal torch.optim.AdamW's throughout."""
    model, ref, opt, torch_opt = _pair()
    scaler = ShardedGradScaler("cpu", init_scale=8.0)
    seen: List[StepPhase] = []
    for it in range(4):
        x = torch.randn(7, 6, generator=torch.Generator().manual_seed(it))
        opt.zero_grad()
        torch_opt.zero_grad()
        seen.append(opt._cycle.phase)
        if it == 1:  # a norm logged between two accumulated backward passes
            _loss(model, x[:3]).backward()
            _loss(ref, x[:3]).backward()
            opt.grad_norm()
            seen.append(opt._cycle.phase)
            x = x[3:]
        if it == 2:  # the scaler loop: scaled backward, unscale_, clip, step, update
            scaler.scale(_loss(model, x)).backward()
            _loss(ref, x).backward()
            seen.append(opt._cycle.phase)
            scaler.unscale_(opt)
            seen.append(opt._cycle.phase)
            norm = opt.clip_grad_norm(0.5)
            torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5), rtol=1e-5,
                                       atol=1e-6)
            scaler.step(opt)
            scaler.update()
        else:
            _loss(model, x).backward()
            _loss(ref, x).backward()
            seen.append(opt._cycle.phase)
            norm = opt.clip_grad_norm(0.5)
            seen.append(opt._cycle.phase)
            torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5), rtol=1e-5,
                                       atol=1e-6)
            opt.step()
        torch_opt.step()
        seen.append(opt._cycle.phase)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert seen == [IDLE, ACC, RED, STEP,
                    STEP, RED, ACC, RED, STEP,
                    STEP, ACC, UNS, STEP,
                    STEP, ACC, RED, STEP]
    # zero_grad dropping a backward no step consumed: counted, and the phase says nothing to read
    opt.zero_grad()
    _loss(model, torch.randn(3, 6)).backward()
    opt.zero_grad()
    assert opt._cycle.phase is IDLE and opt._cycle.position()["dropped"] == 1
    assert opt._cycle.position()["steps"] == 4


def test_the_norm_after_step_is_the_cycles_last_round() -> None:
    model, ref, opt, torch_opt = _pair(groups=False)
    x = torch.randn(4, 6)
    _loss(model, x).backward()
    _loss(ref, x).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    got = opt.grad_norm()
    opt.step()
    opt.zero_grad()
    assert opt._cycle.last_step() is not None
    torch.testing.assert_close(opt.grad_norm(), got)  # from the last round: no collective
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="norm_type"):
        opt.grad_norm(1.0)  # that step computed only the 2-norm: the grads are consumed


# Private attributes a module may set on an object that is not its own ``self``, and why.
ALLOWED_FOREIGN_WRITES = {
    # torch's GradScaler per-optimizer state: every use of torch internals lives in _compat
    ("optim/_compat.py", "scaler._per_optimizer_states"),
    # a ShardedGrad view made by its own module's constructor function
    ("optim/torch_tools.py", "t._opt"), ("optim/torch_tools.py", "t._index"),
    # the launch's cached native struct, set by the module that defines AdamLaunch
    ("optim/kernels/adam_launch.py", "launch._native"), ("optim/kernels/adam_launch.py", "launch._tuned"),
    ("optim/kernels/adam_launch.py", "launch._grad_dtype"),
}


def _foreign_private_writes() -> List[tuple]:
    found = []
    for package in ("optim", "scaler", "integrations"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                else:
                    continue
                for target in targets:
                    for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                        if (isinstance(t, ast.Attribute) and t.attr.startswith("_") and not t.attr.startswith("__")
                                and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))):
                            found.append((path.relative_to(ROOT).as_posix(), ast.unparse(t)))
    return found


def test_no_module_writes_another_objects_private_attributes() -> None:
    unexpected = sorted(set(_foreign_private_writes()) - ALLOWED_FOREIGN_WRITES)
    assert not unexpected, (
        "these write another object's private attributes; ask the owner through a method instead "
        f"(or, for a tag on a torch object, add it to ALLOWED_FOREIGN_WRITES with the reason): {unexpected}")


def test_the_private_write_scan_finds_a_write() -> None:
    # the scan itself can fail: the launch module's write into the launch it caches is found
    assert ("optim/kernels/adam_launch.py", "launch._native") in _foreign_private_writes()


def _ranks_walk_the_same_cycle(rank: int, world: int) -> dict:
    """Two param groups over several uneven buckets, ShardedGradScaler, a clip; an inf in one
    rank's batch at step 2 only. Every phase is recorded, and the unsharded torch AdamW fed the
    union of the ranks' batches (skipping the step the scaler skips) is trained alongside."""
    import parity

    torch.manual_seed(0)
    model = parity.MLP()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(parity.two_groups(model), bucket_cap_mb=0.0003)
    ropt = torch.optim.AdamW(parity.two_groups(ref), weight_decay=0.0)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    loss_fn = nn.MSELoss()
    phases, norms = [], []
    for step in range(4):
        data = parity.batches(step, world)
        opt.zero_grad()
        ropt.zero_grad()
        phases.append(opt._cycle.phase.value)
        x, y = data[rank]
        if step == 2 and rank == world - 1:
            x = x.clone()
            x[0, 0] = math.inf
        scaler.scale(loss_fn(model(x), y)).backward()
        phases.append(opt._cycle.phase.value)
        scaler.unscale_(opt)
        phases.append(opt._cycle.phase.value)
        norms.append(float(opt.clip_grad_norm(1.0)))
        scaler.step(opt)
        scaler.update()
        phases.append(opt._cycle.phase.value)
        ref_x = [xb.clone() for xb, _ in data]
        if step == 2:
            ref_x[world - 1][0, 0] = math.inf
        (sum(loss_fn(ref(xb), yb) for xb, (_, yb) in zip(ref_x, data)) / world).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        if torch.isfinite(ref_norm):  # the scaler skips the step on every rank
            ropt.step()
    return {"phases": phases, "norms": norms, "position": opt._cycle.position(), "stats": opt.step_stats(),
            "buckets": len(opt._buckets),
            "params": [p.detach().clone() for p in model.parameters()],
            "ref": [p.detach().clone() for p in ref.parameters()]}


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_walks_the_same_cycle_and_trains_as_torch(world: int) -> None:
    from dist_helper import run_distributed

    results = run_distributed(_ranks_walk_the_same_cycle, world, pg_timeout=120)
    step = ["stepped", "accumulating", "unscaled", "stepped"]
    for r, v in enumerate(results):
        assert v["buckets"] >= 2
        assert v["phases"] == ["idle", "accumulating", "unscaled", "stepped"] + step * 3, (r, v["phases"])
        assert v["position"] == {"steps": 4, "backwards": 0, "dropped": 0}
        assert v["stats"]["steps"] == 3 and v["stats"]["skipped_nonfinite"] == 1
        assert not math.isfinite(v["norms"][2]) and all(math.isfinite(n) for i, n in enumerate(v["norms"]) if i != 2)
        assert v["norms"][:2] + v["norms"][3:] == results[0]["norms"][:2] + results[0]["norms"][3:]
        for p, q in zip(v["params"], v["ref"]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_phase_gates_a_step_and_an_unscale_in_one_place() -> None:
    """``require`` refuses a step without grads and a second unscale with the errors users get
    from ``step()`` and ``unscale_grads()``, and allows them everywhere else."""
    from shardamp.optim.checks.misuse import NO_GRAD_AT_STEP, UNSCALE_TWICE
    from shardamp.optim.step.cycle import Action

    c = _cycle()
    with pytest.raises(RuntimeError) as no_grads:
        c.require(Action.STEP)  # IDLE, nothing to step on
    assert str(no_grads.value) == NO_GRAD_AT_STEP
    c.require(Action.UNSCALE)
    c.backward_began()
    c.require(Action.STEP)
    c.reduced("", [])
    c.require(Action.UNSCALE)
    c.unscaled(torch.tensor(0.5))
    with pytest.raises(RuntimeError) as twice:
        c.require(Action.UNSCALE)  # UNSCALED: a second unscale before the step
    assert str(twice.value) == UNSCALE_TWICE
    c.require(Action.STEP)
    c.stepped([], {2.0: torch.tensor(1.0)}, cache_after_step=True)
    c.require(Action.STEP)  # the same grads stepped on again, as torch allows
    c.require(Action.UNSCALE)  # the next step's scale
    c.grads_dropped(set_to_none=False)  # kept as zeros: still grads to step on
    c.require(Action.STEP)
    c.grads_dropped(set_to_none=True)
    assert c.phase is STEP  # the last step's norms stay readable, but no grads are left
    with pytest.raises(RuntimeError, match="no parameter of this optimizer received a gradient"):
        c.require(Action.STEP)


def test_the_optimizer_refuses_through_the_gate() -> None:
    """``step()`` without a backward and a second ``unscale_grads()`` raise the gate's errors."""
    model, _, opt, _ = _pair()
    with pytest.raises(RuntimeError, match="no parameter of this optimizer received a gradient"):
        opt.step()
    _loss(model, torch.randn(4, 6)).backward()
    opt.unscale_grads(torch.tensor(0.5))
    with pytest.raises(RuntimeError, match=r"unscale_grads\(\) has already been called since the last step\(\)"):
        opt.unscale_grads(torch.tensor(0.5))
    opt.step()
    opt.unscale_grads(torch.tensor(0.5))  # the next step's


def test_grad_sync_alone_sets_its_launch_flags() -> None:
    """backward_order.py decides the order of launches over a group; the flags GradSync acts on
    are set by GradSync's own methods (``defer_launches_to_end``, ``hold_launches_to_step``, ...),
    never written from another module."""
    flags = {"defer_launches", "hold_launches", "refusal", "order_group", "build_index", "enabled",
             "_defer_launches", "_hold_launches", "_refusal", "_enabled"}
    writes = []
    for path in sorted((ROOT / "optim").rglob("*.py")):
        if path.name == "grad_sync.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute) and t.attr in flags and not (
                            isinstance(t.value, ast.Name) and t.value.id == "self"):
                        writes.append((path.relative_to(ROOT).as_posix(), ast.unparse(t)))
    assert not writes, writes


def test_the_gate_warns_once_of_a_clip_before_the_unscale() -> None:
    """A clip made while the loss was scaled, then the unscale: warned once, at the user's call
    of the scaler's ``unscale_`` (the gate's stacklevel), not again at the next step."""
    import warnings

    model, _, opt, _ = _pair()
    scaler = ShardedGradScaler("cpu", init_scale=8.0)
    for step in range(2):
        opt.zero_grad()
        scaler.scale(_loss(model, torch.randn(4, 6))).backward()
        opt.clip_grad_norm(8.0)  # before unscale_: compared with the scaled norm
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.unscale_(opt)
        found = [w for w in caught if "before unscaling" in str(w.message)]
        assert len(found) == (1 if step == 0 else 0), [str(w.message) for w in caught]
        if found:
            assert found[0].filename == __file__
        scaler.step(opt)
        scaler.update()


class _Sync:
    """What the gate asks of the grad sync (``Reductions``), set by hand."""

    def __init__(self) -> None:
        self.enabled, self.unreduced = True, False

    def holds_unreduced(self) -> bool:
        return self.unreduced


def _in_phase(phase: StepPhase, sync: _Sync, grads: bool = True) -> StepCycle:
    """A cycle in ``phase`` (the last step's 2-norm kept in STEPPED), with grads since zero_grad
    or without (``grads=False``: none arrived, or zero_grad(set_to_none=True) dropped them)."""
    c = _cycle()
    c.watch(sync)
    if grads:
        c.backward_began()
    if phase is IDLE and grads:
        c.grads_dropped(set_to_none=False)  # zeros kept: grads to step on, no step's norms
    if phase in (RED, UNS, STEP):
        c.reduced("", [])
        c.current().add_norm_type(2.0, torch.tensor(3.0))
    if phase is UNS:
        c.unscaled(torch.tensor(0.5))
    if phase is STEP:
        c.stepped([], [2.0], cache_after_step=True)
        if not grads:
            c.grads_dropped(set_to_none=True)  # the step's norms stay readable, its grads are gone
    assert c.phase is phase and c.grad_since_zero is grads
    return c


def test_the_gate_table_action_by_phase() -> None:
    """Every action in every phase, each fact held then missing: allowed, or refused with the
    error users get (the texts of checks/misuse.py, formatted with the call's name)."""
    from shardamp.optim.checks import misuse
    from shardamp.optim.step.cycle import Action

    phases = [IDLE, ACC, RED, UNS, STEP]
    no_sync = misuse.READ_INSIDE_NO_SYNC.format(what="the call")
    unreduced = misuse.READ_UNREDUCED.format(what="the call")
    assert no_sync.startswith("the call: called inside opt.no_sync(): the grads accumulated there")
    assert unreduced.startswith("the call: this rank holds grads that are not reduced yet")
    # what each action meets in each phase: None allowed, else the error; the facts are all held
    # ("held"), or one is missing: no grads since zero_grad(set_to_none=True), inside no_sync,
    # grads waiting for their reduction, a norm type the last step did not compute (inf)
    expected = {
        ("held", Action.UNSCALE, UNS): misuse.UNSCALE_TWICE,
        **{("no grads", Action.STEP, ph): misuse.NO_GRAD_AT_STEP for ph in phases if ph is not ACC},
        ("no grads", Action.UNSCALE, UNS): misuse.UNSCALE_TWICE,
        **{("no_sync", a, ph): no_sync for a in (Action.CLIP, Action.READ, Action.LOCAL_READ) for ph in phases},
        ("no_sync", Action.UNSCALE, UNS): misuse.UNSCALE_TWICE,
        # after a step its grads are reduced: a local read is allowed whatever the sync holds
        **{("unreduced", Action.LOCAL_READ, ph): unreduced for ph in phases if ph is not STEP},
        ("unreduced", Action.UNSCALE, UNS): misuse.UNSCALE_TWICE,
        ("norm inf", Action.NORM, STEP): misuse.NORM_NOT_KEPT.format(norm_type=math.inf, computed=[2.0]),
        ("norm inf", Action.UNSCALE, UNS): misuse.UNSCALE_TWICE,
    }
    checked = 0
    for case in ("held", "no grads", "no_sync", "unreduced", "norm inf"):
        for phase in phases:
            for action in Action:
                if case == "no grads" and phase is ACC:
                    continue  # a backward is what accumulates: no such cycle
                sync = _Sync()
                c = _in_phase(phase, sync, grads=case != "no grads")
                sync.enabled = case != "no_sync"
                sync.unreduced = case == "unreduced"
                norm_type = math.inf if case == "norm inf" else 2.0
                want = expected.get((case, action, phase))
                if want is None:
                    c.require(action, "the call", norm_type)
                else:
                    with pytest.raises(RuntimeError) as refused:
                        c.require(action, "the call", norm_type)
                    assert str(refused.value) == want, (case, action, phase)
                checked += 1
    assert checked == (5 * len(phases) - 1) * len(Action) and len(Action) == 6


def test_the_gate_without_a_grad_sync_holds_nothing_back() -> None:
    """A cycle watching no grad sync (or one that is gone: it is held weakly) refuses no read."""
    from shardamp.optim.step.cycle import Action

    c = _cycle()
    c.backward_began()
    c.require(Action.LOCAL_READ, "local_grad")
    sync = _Sync()
    sync.enabled = False
    c.watch(sync)
    with pytest.raises(RuntimeError, match="local_grad: called inside opt.no_sync"):
        c.require(Action.LOCAL_READ, "local_grad")
    del sync
    c.require(Action.LOCAL_READ, "local_grad")


def test_the_optimizers_reads_refuse_through_the_gate() -> None:
    """The errors of reads out of order come from the gate: inside no_sync, local_grad before
    the reduction, a norm type the last step did not compute, and the optimizer's grad sync
    is what the gate asks."""
    from shardamp.optim.checks import misuse

    model, _, opt, _ = _pair(groups=False)
    assert opt._cycle._reductions() is opt._grad_sync
    p = next(model.parameters())
    with opt.no_sync():
        _loss(model, torch.randn(4, 6)).backward()
        with pytest.raises(RuntimeError) as inside:
            opt.full_grad(p)
        assert str(inside.value) == misuse.READ_INSIDE_NO_SYNC.format(what="full_grad")
        with pytest.raises(RuntimeError) as clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert str(clip.value).startswith("get_total_norm: called inside opt.no_sync()")
    with pytest.raises(RuntimeError) as local:
        opt.local_grad(p)  # the no_sync backward's grads are not reduced yet
    assert str(local.value) == misuse.READ_UNREDUCED.format(what="local_grad")
    opt.grad_sync()
    assert opt.local_grad(p) is not None
    opt.step()
    with pytest.raises(RuntimeError) as norm:
        opt.grad_norm(1.0)
    assert str(norm.value) == misuse.NORM_NOT_KEPT.format(norm_type=1.0, computed=[2.0])
