"""Scaler/clipping cases, run inside one spawned gloo group per world size (test_scaler_loops.py)."""
from __future__ import annotations

import contextlib

import torch

from amp_loops import run_loop
from grad_reads import run_reads
from parity import MLP, backward_and_step, batches
from shardamp.optim import DistributedFusedAdam, _compat
from shardamp.scaler import ShardedGradScaler


def case_loop_A(rank, world, **kw):
    return run_loop(rank, world, "A", **kw)


def case_loop_B(rank, world, **kw):
    return run_loop(rank, world, "B", **kw)


def case_loop_C(rank, world, **kw):
    return run_loop(rank, world, "C", **kw)


def case_loop_D(rank, world, **kw):
    return run_loop(rank, world, "D", **kw)


def case_loop_D_no_scaler(rank, world, **kw):
    return run_loop(rank, world, "D0", **kw)


def case_loop_E(rank, world, **kw):
    return run_loop(rank, world, "E", **kw)


def case_loop_F(rank, world, **kw):
    return run_loop(rank, world, "F", **kw)


def case_loop_G(rank, world, **kw):
    return run_loop(rank, world, "G", **kw)


def case_loop_Gf(rank, world, **kw):
    return run_loop(rank, world, "Gf", **kw)


def case_loop_H(rank, world, **kw):
    return run_loop(rank, world, "H", **kw)


def case_loop_H0(rank, world, **kw):
    return run_loop(rank, world, "H0", **kw)


def case_loop_I(rank, world, **kw):
    return run_loop(rank, world, "I", **kw)


def _spike_case(loop: str):
    def case(rank, world, **kw):
        return run_loop(rank, world, loop, spike=True, **kw)

    return case


# case_loop_<name>_spike: each loop with norm spikes skipped by skip_grad_norm_above
for _name, _loop in (("A", "A"), ("B", "B"), ("C", "C"), ("D", "D"), ("D_no_scaler", "D0"), ("E", "E"),
                     ("F", "F"), ("G", "G"), ("Gf", "Gf")):
    globals()[f"case_loop_{_name}_spike"] = _spike_case(_loop)

# case_loop_<name>_lowbit: each loop with blockwise moments (the formats and a block size taken in
# turn), against the same quantized math unsharded
LOW_BIT_FORMATS = (dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"),
                   dict(exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit"),
                   dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit"),
                   dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype="8bit", quant_block_size=64))


def _low_bit_case(loop: str, formats):
    def case(rank, world, **kw):
        return run_loop(rank, world, loop, **formats, **kw)

    return case


for _i, (_name, _loop) in enumerate((("A", "A"), ("B", "B"), ("C", "C"), ("D", "D"), ("D_no_scaler", "D0"),
                                     ("E", "E"), ("F", "F"), ("G", "G"), ("Gf", "Gf"), ("H", "H"), ("H0", "H0"),
                                     ("I", "I"))):
    globals()[f"case_loop_{_name}_lowbit"] = _low_bit_case(_loop, LOW_BIT_FORMATS[_i % len(LOW_BIT_FORMATS)])


def _low_bit_spike_case(loop: str, formats):
    def case(rank, world, **kw):
        return run_loop(rank, world, loop, spike=True, **formats, **kw)

    return case


# case_loop_<name>_lowbit_spike: skip_grad_norm_above over blockwise moments
for _name, _loop, _formats in (("B", "B", LOW_BIT_FORMATS[1]), ("D", "D", LOW_BIT_FORMATS[0])):
    globals()[f"case_loop_{_name}_lowbit_spike"] = _low_bit_spike_case(_loop, _formats)


@contextlib.contextmanager
def _counted_all_reduces():
    """Yields the list of every all-reduce shardamp issues meanwhile (its tensor's numel; the
    caller clears it between steps)."""
    calls = []
    original = _compat.all_reduce

    def counting(tensor, op, group, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, op, group, **kwargs)

    _compat.all_reduce = counting
    try:
        yield calls
    finally:
        _compat.all_reduce = original


def case_one_all_reduce(rank, world, **kw):
    """unscale_ + clip_grad_norm + step issue exactly one all-reduce (norm + found-inf + touched)."""
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.0004)
    scaler = ShardedGradScaler("cpu")
    counts = []
    with _counted_all_reduces() as calls:
        for step in range(3):
            x, y = batches(step, world)[rank]
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            calls.clear()
            scaler.unscale_(opt)
            opt.clip_grad_norm(1.0)
            scaler.step(opt)
            scaler.update()
            counts.append(list(calls))
            opt.zero_grad()
    from shardamp.optim.checks import agreement

    # the per-step agreement entries ride in the same all-reduce (no tensor lr here)
    entries = opt._step_view.fingerprint.length(len(agreement.host_categories(opt._step_view, 2.0)), 0)
    return {"counts": counts, "n_params": len(list(model.parameters())), "agreement_entries": entries}


def case_one_all_reduce_torch_clip(rank, world, **kw):
    """Loops F and I: torch.amp.GradScaler's unscale_ and torch's clip functions over the p.grad
    views, then step, issue exactly the one stats all-reduce (the clip reuses its norm)."""
    import warnings

    out = {}
    for loop in ("F", "I"):
        torch.manual_seed(0)
        model = MLP()
        opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.0004)
        scaler = torch.amp.GradScaler("cpu")
        counts = []
        with _counted_all_reduces() as calls, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's hand-over to step(grad_scaler=)
            for step in range(3):
                x, y = batches(step, world)[rank]
                scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
                calls.clear()
                scaler.unscale_(opt)
                if loop == "F":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                else:
                    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
                    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)
                scaler.step(opt)
                scaler.update()
                counts.append(list(calls))
                opt.zero_grad()
        out[loop] = counts
    return out


def case_grad_reads_fp32(rank, world, **kw):
    return run_reads(rank, world, "none")


def case_grad_reads_sharded_scaler(rank, world, **kw):
    return run_reads(rank, world, "sharded")


def case_grad_reads_torch_scaler(rank, world, **kw):
    return run_reads(rank, world, "torch")


def case_found_inf_is_exactly_one(rank, world, device="cpu", **kw):
    """Two ranks overflow at once: the found-inf handed to the scaler is 1.0, not a sum (2.0),
    since torch's fused kernels skip only on == 1."""
    torch.manual_seed(0)
    model = MLP().to(device)
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.0004)
    scaler = ShardedGradScaler(device)
    x, y = batches(0, world, device=device)[rank]
    if rank > 0:
        x = x.clone()
        x[0, 0] = float("nan") if rank == 1 else float("inf")
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    found = list(_compat.scaler_optimizer_state(scaler, opt)["found_inf_per_device"].values())
    return [(f.dtype, f.dim(), float(f)) for f in found]


def case_foreign_optimizer_agrees(rank, world, device="cpu", **kw):
    """ShardedGradScaler with an ordinary optimizer (torch AdamW on a replica): the found-inf of
    one rank is agreed over the scaler's process group, so every rank skips and backs off."""
    torch.manual_seed(0)
    model = MLP().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ShardedGradScaler(device, init_scale=2.0**10)
    scales = []
    for step in range(3):
        x, y = batches(step, world, device=device)[rank]
        if step == 1 and rank == world - 1:
            x = x.clone()
            x[0, 0] = float("inf")
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def case_norm_types(rank, world, device="cpu", opt_kwargs=None, **kw):
    """grad_norm for p = 1, 3 and inf (MAX all-reduce) against torch's clip_grad_norm_ on the
    unsharded grads, and clipping by the inf-norm matches torch's."""
    import copy

    import torch.nn as nn

    from parity import two_groups

    torch.manual_seed(0)
    model = MLP().to(device)
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=0.0004, **(opt_kwargs or {}))
    ropt = torch.optim.AdamW(two_groups(ref))
    out = {"ours": [], "ref": []}
    for step in range(3):
        data = batches(step, world, device=device)
        total = sum(nn.functional.mse_loss(ref(x), y) for x, y in data) / world
        total.backward()
        ref_norms = [float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], p)) for p in (1.0, 3.0)]
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type="inf")))
        ropt.step()
        ropt.zero_grad()
        x, y = data[rank]
        nn.functional.mse_loss(model(x), y).backward()
        ours = [float(opt.grad_norm(1.0)), float(opt.grad_norm(3.0)), float(opt.clip_grad_norm(0.05, norm_type=float("inf")))]
        opt.step()
        opt.zero_grad()
        out["ours"].append(ours)
        out["ref"].append(ref_norms)
    out["params"] = [p.detach().cpu() for p in model.parameters()]
    out["ref_params"] = [p.detach().cpu() for p in ref.parameters()]
    return out


class _Records(__import__("logging").Handler):
    """Collects the ``shardamp`` logger's messages."""

    def __init__(self) -> None:
        super().__init__()
        self.messages = []

    def emit(self, record) -> None:
        self.messages.append((record.levelname, record.getMessage()))


# (step, rank, param name, value): the grads poisoned on that rank only, before their reduction
# both at even steps: the round's flags take turns between two buffers, so step 6 flags into the
# one step 2 flagged b.weight in (an earlier round's flag must not come back: step/health.py)
NAMED_POISON = {2: [(-1, "b.weight", float("inf"))], 6: [(0, "head.bias", float("nan")), (1, "a.weight", float("-inf"))]}
NAMED_STEPS = 8


def case_nonfinite_named(rank, world, device="cpu", **kw):
    """named_parameters() in two groups, tiny buckets (uneven shards): an inf in ONE named
    param's grad on ONE rank (step 2: the last rank's b.weight), then on two ranks at once
    (step 6: rank 0's head.bias NaN, rank 1's a.weight -inf): every rank's last_nonfinite()
    names exactly those (rank, name) pairs, the step is skipped as torch skips it (params equal
    unsharded AdamW's, with and without a scaler), step_stats() counts it, and the shardamp
    logger names them once per burst."""
    import copy
    import logging

    import torch.nn as nn

    from parity import named_two_groups

    out = {}
    for scaled in (True, False):
        torch.manual_seed(0)
        model = MLP().to(device)
        ref = copy.deepcopy(model)
        opt = DistributedFusedAdam(named_two_groups(model), bucket_cap_mb=0.0004)
        ropt = torch.optim.AdamW(named_two_groups(ref))
        scaler = ShardedGradScaler(device, init_scale=2.0**10, growth_interval=3) if scaled else None
        rscaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3) if scaled else None
        mine = dict(model.named_parameters())
        refs = dict(ref.named_parameters())
        handles = []
        step_now = [0]
        for name, p in mine.items():
            def poison(g, name=name):
                for r, n, value in NAMED_POISON.get(step_now[0], []):
                    if n == name and r % world == rank:
                        g = g.clone()
                        g.view(-1)[3 % g.numel()] = value
                return g
            handles.append(p.register_hook(poison))
        log = _Records()
        logging.getLogger("shardamp").addHandler(log)
        named, params, ref_params, scales, ref_scales = [], [], [], [], []
        try:
            for step in range(NAMED_STEPS):
                step_now[0] = step
                data = batches(step, world, device=device)
                total = sum(nn.functional.mse_loss(ref(x), y) for x, y in data) / world
                (rscaler.scale(total) if scaled else total).backward()
                for r, n, value in NAMED_POISON.get(step, []):  # the sum over ranks holds it too
                    refs[n].grad.view(-1)[3 % refs[n].numel()] = value
                if scaled:
                    rscaler.step(ropt)
                    rscaler.update()
                elif all(bool(torch.isfinite(p.grad).all()) for p in ref.parameters()):
                    ropt.step()
                ropt.zero_grad()
                x, y = data[rank]
                backward_and_step(nn.functional.mse_loss(model(x), y), opt, scaler)  # scaler None unless scaled
                opt.zero_grad()
                named.append(opt.last_nonfinite())
                params.append([p.detach().cpu().clone() for p in model.parameters()])
                ref_params.append([p.detach().cpu().clone() for p in ref.parameters()])
                scales.append(scaler.get_scale() if scaled else None)
                ref_scales.append(rscaler.get_scale() if scaled else None)
        finally:
            logging.getLogger("shardamp").removeHandler(log)
            for h in handles:
                h.remove()
        out[f"scaled={scaled}"] = dict(named=named, params=params, ref_params=ref_params, scales=scales,
                                       ref_scales=ref_scales, stats=opt.step_stats(), log=log.messages)
        del opt  # one live optimizer per process group
    return out


def case_nonfinite_in_reduction(rank, world, device="cpu", **kw):
    """Grads reduced in float16: every rank's grad element holds 40000 (finite in fp16), their
    sum overflows in the reduce-scatter. The step is skipped (non-finite), yet no rank's own
    grads held inf/NaN: last_nonfinite() is empty, which is how to tell."""
    import logging

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(40, device=device))
    q = torch.nn.Parameter(torch.zeros(7, device=device))
    opt = DistributedFusedAdam([p, q], grad_sync_dtype=torch.float16, bucket_cap_mb=0.0001)
    log = _Records()
    logging.getLogger("shardamp").addHandler(log)
    try:
        w = torch.ones(40, device=device)
        w[5] = 40000.0
        ((p * w).sum() + q.sum()).backward()
        opt.step()
        named = opt.last_nonfinite()
        stats = opt.step_stats()
        moved = bool(p.detach().abs().sum() > 0)
    finally:
        logging.getLogger("shardamp").removeHandler(log)
    return dict(named=named, stats=stats, moved=moved, log=log.messages)


def case_group_norms(rank, world, device="cpu", device_mesh=None, **kw):
    """grad_norms_by_group() of three param groups (tiny buckets: groups straddle buckets and
    shards) against torch.nn.utils.get_total_norm per group of the unsharded grads: unscaled
    after unscale_, in the step's norm type (2, or inf when the clip asks for it first), the same
    after step; one group: the whole norm."""
    import copy

    import torch.nn as nn

    torch.manual_seed(0)
    model = MLP().to(device)
    ref = copy.deepcopy(model)

    def three(m):
        ps = list(m.parameters())
        return [{"params": ps[:2]}, {"params": ps[2:5], "lr": 2e-3}, {"params": ps[5:], "weight_decay": 0.1}]

    opt = DistributedFusedAdam(three(model), bucket_cap_mb=0.0004, device_mesh=device_mesh)
    ropt = torch.optim.AdamW(three(ref))
    scaler = ShardedGradScaler(device, init_scale=2.0**6)
    out = []
    for step in range(4):
        norm_type = float("inf") if step == 2 else 2.0
        data = batches(step, world, device=device)
        (sum(nn.functional.mse_loss(ref(x), y) for x, y in data) / world).backward()
        want = [float(torch.nn.utils.get_total_norm([p.grad for p in g["params"]], norm_type))
                for g in ropt.param_groups]
        ropt.step()
        ropt.zero_grad()
        x, y = data[rank]
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if step == 2:  # asked first, before unscaling: the step's stats are in the inf norm
            opt.clip_grad_norm(100.0, norm_type=norm_type)
        scaler.unscale_(opt)
        before = opt.grad_norms_by_group().tolist()
        scaler.step(opt)
        scaler.update()
        after = opt.grad_norms_by_group().tolist()
        opt.zero_grad()
        out.append(dict(want=want, before=before, after=after, total=float(opt.grad_norm(norm_type))))
    del opt
    one = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.0004, device_mesh=device_mesh)
    x, y = batches(9, world, device=device)[rank]
    nn.functional.mse_loss(model(x), y).backward()
    single = (one.grad_norms_by_group().tolist(), float(one.grad_norm()))
    del one
    return dict(steps=out, single=single)


CASES = [name for name in dir() if name.startswith("case_")]
