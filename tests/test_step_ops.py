"""The ops issued between backward and the step kernel: on a GPU each is a launch the host pays
for, so their number is pinned here (counted on the CPU with a dispatch mode); the compiled kernels'
entry points, which are not aten ops, are counted by name per iteration. The grad coefficient and the step counts are one native
launch (``kernels.step_scalars``), a tensor lr is read once per step."""
from __future__ import annotations

import copy
from collections import Counter
from typing import List

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardamp.optim import DistributedFusedAdam, kernels
from shardamp.scaler import ShardedGradScaler

from conftest import set_env
from landings import count_landings

# ops that launch nothing: views, metadata, allocation, profiler markers
FREE = {"slice", "select", "view", "detach", "empty", "alias", "as_strided", "_record_function_enter_new",
        "_record_function_exit", "reshape", "unsqueeze", "squeeze", "t", "expand"}


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []
        self.inputs: List[list] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in FREE:
            self.ops.append(name)
            flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
            self.inputs.append([t for t in flat if isinstance(t, torch.Tensor)])
        return func(*args, **(kwargs or {}))


def _iteration(opt, scaler, model, step: int, clip: bool, count: bool):
    """One iteration (``scaler`` None: no scaler, loop B's plain step)."""
    opt.zero_grad()
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(4, 8, generator=g)).square().sum()
    (loss if scaler is None else scaler.scale(loss)).backward()
    mode = Ops()
    with mode if count else torch.no_grad():
        if scaler is not None:
            scaler.unscale_(opt)
        if clip:
            opt.clip_grad_norm(1.0)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return mode


@pytest.mark.skipif(kernels.backend(torch.device("cpu")) != "native", reason="needs the CPU kernels")
@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("health", ["one group", "two groups, skip_grad_norm_above"])
def test_ops_between_backward_and_step_are_few(clip: bool, health: str) -> None:
    """The step's health costs no op here: its stats entries ride in the same cat (views), the
    skip and the counters are decided in the step_scalars launch, several groups' norm partials
    are one native call per bucket, and a scaled step at world 1 reads nothing back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    if health == "one group":
        opt = DistributedFusedAdam(model.parameters(), lr=1e-3)
    else:
        opt = DistributedFusedAdam([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=1e-3,
                                   skip_grad_norm_above=1e6)
    scaler = ShardedGradScaler("cpu")
    for step in range(3):
        _iteration(opt, scaler, model, step, clip, count=False)
    ops = _iteration(opt, scaler, model, 3, clip, count=True).ops
    # inv scale 3 (torch's double reciprocal), unscale_grads' found-inf 3, the clip's unscaled
    # norm 1, update 2; one native call each, not counted: the stats buffer (the header the
    # landing formed, the touched mask and the agreement entries, concatenated by memcpy inside
    # the call: was a cat), the stats' norm, found-inf and touched flags (kernels.stats_finish,
    # was 4 ops) and the coefficient (avg * inv_scale * clip) with the step counts. A scaled
    # step copies nothing back to the host (its flags were 1 op).
    budget = 9 if clip else 8
    assert len(ops) <= budget, (len(ops), ops)
    for folded in ("clamp", "clamp_", "sqrt", "clone", "copy_", "zero_", "nan_to_num", "addcmul_", "rsub", "reciprocal_",
                   "masked_fill_", "bitwise_and"):
        assert folded not in ops, (folded, ops)


def _native_calls(opt, scaler, model, clip: bool) -> Counter:
    """The compiled kernels' entry points called during one whole iteration (backward included),
    by name: what the aten count above cannot see."""
    ext = kernels.native_module(torch.device("cpu"))
    names = [n for n in dir(ext) if not n.startswith("_") and callable(getattr(ext, n))
             and not isinstance(getattr(ext, n), type)]
    saved = {n: getattr(ext, n) for n in names}
    calls: Counter = Counter()

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(ext, name, counted(name, fn))
    sync = opt._grad_sync  # the merged landings: the stager's hook under a landing plan
    stager = sync.landings.stager
    count_landings(sync, calls)
    try:
        _iteration(opt, scaler, model, 3, clip, count=False)
    finally:
        for name, fn in saved.items():
            setattr(ext, name, fn)
        sync.landings.stager = stager
    return calls


def _trained_small_buckets(groups: int, scaled: bool, clip: bool):
    """A two-layer model over buckets of a few params each (``groups`` 2: a group per layer),
    three iterations in: ``(model, opt, scaler or None)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    params = ([{"params": model[0].parameters()}, {"params": model[2].parameters()}] if groups == 2
              else model.parameters())
    opt = DistributedFusedAdam(params, lr=1e-3, bucket_cap_mb=0.0002)
    scaler = ShardedGradScaler("cpu") if scaled else None
    for step in range(3):
        _iteration(opt, scaler, model, step, clip, count=False)
    return model, opt, scaler


@pytest.mark.skipif(kernels.backend(torch.device("cpu")) != "native", reason="needs the CPU kernels")
@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("copy", [False, True])
def test_native_calls_per_iteration_are_pinned(clip: bool, groups: int, scaled: bool, copy: bool,
                                               monkeypatch) -> None:
    """Per bucket: one call that lands its grads and passes over them once for their non-finite
    flags (the step's health) and the norm partial (one rank: the bucket is the shard; the
    stager's hook under a landing plan, which runs ``bucket_stats``, or on the CPU the same pass
    over the grads where autograd left them, no copy: ``copy`` False); with several
    groups each group's partial too (over the held grads: ``group_partials_held``); per step one
    call that assembles and finishes the stats (one process: nothing reduces them in between)
    and one call for the scalar launch and every bucket's step (one rank: nothing is
    all-gathered between them); where nothing asked for the stats before the step (no unscale,
    no clip) those two and the group partials are the step's ONE call. A new pass over the grads, or a landing the
    zero-copy path should not make, shows up here."""
    if copy:
        set_env(monkeypatch, "SHARDAMP_COPY_GRADS", "1")
    model, opt, scaler = _trained_small_buckets(groups, scaled, clip)
    buckets = len(opt._buckets)
    assert buckets >= 2  # the per-bucket counts are told apart from the per-step ones
    want = {"stats_cat_finish": 1, "step_launch": 1} if scaled or clip else {"stats_step": 1}
    # (the step's wrapper also asks whether anything records its label, through the module's
    # query it found at the first step: not counted here, where the module's names are wrapped)
    if groups > 1 and (scaled or clip):  # unclipped and unscaled: the step's one call forms them too
        want["group_partials" if copy else "group_partials_held"] = buckets
    calls = _native_calls(opt, scaler, model, clip)
    # every bucket lands in the hook, under the plan set at zero_grad
    assert calls.pop("planned", 0) == buckets
    assert dict(calls) == want


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_zero_grad_after_a_step_issues_no_op(scaled: bool, clip: bool, groups: int) -> None:
    """``zero_grad`` after a step drops the grads and starts the next round's non-finite flags
    without an op of its own: the step's scalar launch zeroed the flags buffer that round swaps in
    (step/health.py), where a ``zero_`` at ``zero_grad`` cost a GPU host a launch every
    iteration. The flags' values across rounds: test_step_health.py."""
    model, opt, _ = _trained_small_buckets(groups, scaled, clip)
    mode = Ops()
    with mode:
        opt.zero_grad()
    assert mode.ops == []
    # a zero_grad with no step since the last landing still starts the flags over itself
    loss = model(torch.randn(4, 8)).square().sum()
    loss.backward()
    mode = Ops()
    with mode:
        opt.zero_grad()
    assert mode.ops == ["zero_"], mode.ops


@pytest.mark.skipif(kernels.backend(torch.device("cpu")) != "native", reason="needs the CPU kernels")
def test_tensor_lr_ops_of_one_rank_are_few() -> None:
    """A tensor lr (capturable, CUDA graphs) on one rank: its value is checked (finite, >= 0) in
    three ops and copied into the table; there is no other rank to compare it with, so no
    fingerprint entries are encoded or checked (59 ops before, 27 then, 2 of them the CPU's own
    validation reads; 20 since the stats header is one native call and is not zeroed twice; 19
    since a CPU stats buffer is concatenated inside the native call)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = DistributedFusedAdam(model.parameters(), lr=torch.tensor(1e-3))
    scaler = ShardedGradScaler("cpu")
    for step in range(3):
        _iteration(opt, scaler, model, step, True, count=False)
    ops = [op for op in _iteration(opt, scaler, model, 3, True, count=True).ops if op != "_local_scalar_dense"]
    assert len(ops) <= 17, (len(ops), ops)
    for encoded in ("__rshift__", "bitwise_xor", "addcmul", "amax", "stack", "bitwise_not"):
        assert encoded not in ops, (encoded, ops)


def test_tensor_lr_is_read_once_per_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    lrs = [torch.tensor(1e-3), torch.tensor(2e-3, dtype=torch.float64)]
    groups = [{"params": model[0].parameters(), "lr": lrs[0]}, {"params": model[2].parameters(), "lr": lrs[1]}]
    opt = DistributedFusedAdam(groups, lr=1e-3)
    scaler = ShardedGradScaler("cpu")
    for step in range(2):
        _iteration(opt, scaler, model, step, True, count=False)
    mode = _iteration(opt, scaler, model, 2, True, count=True)
    for lr in lrs:
        # _local_scalar_dense: the CPU-only validation reading the value (free there; on CUDA the
        # value is checked on the device)
        reads = [op for op, ins in zip(mode.ops, mode.inputs) if op != "_local_scalar_dense"
                 and any(t.untyped_storage().data_ptr() == lr.untyped_storage().data_ptr() for t in ins)]
        assert len(reads) == 1, reads
    # the values reached the table
    assert opt._hparam_table.table[:, 0].tolist() == [float(lrs[0]), float(lrs[1])]


@pytest.mark.skipif(kernels.backend(torch.device("cpu")) != "native", reason="needs the CPU kernels")
@pytest.mark.parametrize("clip", [True, False])
def test_unscaled_step_reads_its_record_back_without_a_copy(clip: bool) -> None:
    """No scaler: the step's health record is read back on the host every step (deferred.py). The
    step's one native call writes it into a persistent buffer itself (``record_host``), so the
    push costs no op (it was a ``clone``), the buffer is the same every step, and what the host
    read is the device record. Unclipped, the same call finishes the stats (``stats_step``): their
    concatenation is a copy inside it (it was a ``cat``), so that step is no op either."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = DistributedFusedAdam(model.parameters(), lr=1e-3)
    seen, hosts = [], []
    observe = opt._health.observe
    opt._health.observe = lambda step, values, scaled: (seen.append(list(values)), observe(step, values, scaled))[1]
    for step in range(4):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(4, 8, generator=g)).square().sum()
        if step == 2:
            loss = loss * float("inf")  # skipped: the record's reason says it
        loss.backward()
        if clip:
            opt.clip_grad_norm(1.0)
        mode = Ops()
        with mode:
            opt.step()
        hosts.append(opt._deferred.slots[opt._deferred.turn][0])
        torch.testing.assert_close(torch.tensor(seen[-1]), opt._health.record, rtol=0, atol=0, equal_nan=True)
    # the scalar launch and the step kernel are one native call; the record's push is no op
    assert not {"clone", "copy_", "cat", "_to_copy"} & set(mode.ops), mode.ops
    assert len(mode.ops) <= 0, mode.ops
    assert [v[0] for v in seen] == [0.0, 0.0, 1.0, 0.0]
    assert len({h.data_ptr() for h in hosts}) <= 2  # the deferred checks' two slots, reused
    assert opt.step_stats()["skipped_nonfinite"] == 1


@pytest.mark.parametrize("shared", [True, False])
def test_a_schedulers_lr_change_writes_the_lrs_alone(shared: bool) -> None:
    """An LR scheduler changes every group's float lr each step: the step checks the lrs alone and
    writes them as launch arguments, one fill where the groups share the value (a zero and an add
    where they differ), with no host tensor, pinned buffer or copy; the table holds the new lrs
    and the run trains as torch's AdamW under the same schedule. Any other change (betas here)
    goes through the full check and upload."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    groups = lambda m: [{"params": m[0].parameters()}, {"params": m[2].parameters(), "weight_decay": 0.0}]
    opt = DistributedFusedAdam(groups(model), lr=1e-3, weight_decay=0.1)
    ropt = torch.optim.AdamW(groups(ref), lr=1e-3, weight_decay=0.1)
    lambdas = [lambda s: 1.0 / (1 + s), lambda s: (1.0 if shared else 0.5) / (1 + s)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambdas) for o in (opt, ropt)]
    for step in range(5):
        if step == 3:  # not the scheduler's change: the full path, then its fast path again
            for o in (opt, ropt):
                o.param_groups[1]["betas"] = (0.8, 0.99)
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            g = torch.Generator().manual_seed(step)
            m(torch.randn(4, 8, generator=g)).square().sum().backward()
        mode = Ops()
        with mode:
            opt.step()
        ropt.step()
        assert opt._hparam_table.table[:, 0].tolist() == [g["lr"] for g in opt.param_groups]
        if step in (1, 2, 4):
            writes = ["fill_"] if shared else ["_foreach_zero_", "_foreach_add_"]
            assert [op for op in mode.ops if op in ("fill_", "_foreach_zero_", "_foreach_add_")] == writes, mode.ops
            assert not {"copy_", "_to_copy", "lift_fresh", "_pin_memory", "clone"} & set(mode.ops), mode.ops
        elif step == 3:
            assert "copy_" in mode.ops and "fill_" not in mode.ops, mode.ops
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for s in scheds:
            s.step()
