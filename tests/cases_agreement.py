"""Ranks that disagree, run inside one spawned gloo group per world size (test_agreement.py).

Every case makes rank 1 (only) differ and returns, per rank, what it raised; the test checks that
EVERY rank raised, naming what differs, and that nothing trained. The process group has a short
timeout (test_agreement.py), so a regression that hangs fails instead.
"""
from __future__ import annotations

import os
import time

import torch

from shardamp.optim import config
import torch.distributed as dist
import torch.nn as nn

from parity import MLP, batches
from shardamp.optim import DistributedFusedAdam, load_sharded, save_sharded

from cases_order import *  # noqa: F401,F403  (the order cases run in the same spawned groups)
from cases_order import (ORDER_BOUND, TINY, _backward, _bounded_group, _order_case, _params, _raised,  # noqa: F401
                         _unchanged)
from cases_two_optimizers import *  # noqa: F401,F403  (and the two-optimizer cases)


# ---------------------------------------------------------------- construction
def case_same_numel_other_shapes(rank, world, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)) if rank != 1 else nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2))
    before = _params(model)
    return {"error": _raised(lambda: DistributedFusedAdam(model.parameters(), bucket_cap_mb=TINY)),
            "untouched": _unchanged(model, before)}


def case_param_count_differs(rank, world, **kw):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 6), nn.Linear(6, 2)] + ([nn.Linear(2, 2)] if rank == 1 else [])
    return {"error": _raised(lambda: DistributedFusedAdam(nn.Sequential(*layers).parameters()))}


def case_bucket_cap_differs(rank, world, **kw):
    torch.manual_seed(0)
    return {"error": _raised(lambda: DistributedFusedAdam(MLP().parameters(), bucket_cap_mb=TINY if rank == 1 else 100.0))}


def case_dtype_differs(rank, world, **kw):
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16 if rank == 1 else torch.float32)
    return {"error": _raised(lambda: DistributedFusedAdam(model.parameters()))}


def case_moment_format_differs(rank, world, **kw):
    torch.manual_seed(0)
    fmt = torch.bfloat16 if rank == 1 else None
    return {"error": _raised(lambda: DistributedFusedAdam(MLP().parameters(), exp_avg_sq_dtype=fmt))}


def case_low_bit_format_differs(rank, world, **kw):
    # a blockwise format on one rank only: its shards are whole blocks, the others' are not
    torch.manual_seed(0)
    fmt = "4bit" if rank == 1 else torch.bfloat16
    return {"error": _raised(lambda: DistributedFusedAdam(MLP().parameters(), exp_avg_dtype=fmt, bucket_cap_mb=TINY))}


def case_quant_block_size_differs(rank, world, **kw):
    torch.manual_seed(0)
    block = 64 if rank == 1 else None
    return {"error": _raised(lambda: DistributedFusedAdam(MLP().parameters(), exp_avg_dtype="8bit",
                                                          exp_avg_sq_dtype="8bit", quant_block_size=block))}


def case_lr_differs_at_construction(rank, world, **kw):
    torch.manual_seed(0)
    return {"error": _raised(lambda: DistributedFusedAdam(MLP().parameters(), lr=2e-3 if rank == 1 else 1e-3))}


def case_offload_differs(rank, world, **kw):
    torch.manual_seed(0)
    offload = dict(offload="cpu", offload_fraction=0.5) if rank == 1 else {}
    return {"error": _raised(lambda: DistributedFusedAdam(MLP().parameters(), **offload))}


def case_offload_fraction_differs(rank, world, **kw):
    torch.manual_seed(0)
    return {"error": _raised(lambda: DistributedFusedAdam(MLP().parameters(), offload="cpu",
                                                          offload_fraction=0.5 if rank == 1 else 1.0))}


def _offload_with(rank_patch, patches):
    """Build an offloaded optimizer with ``patches`` ((module, name, value)) applied on the ranks
    ``rank_patch`` says; the error and whether the model was left untouched."""
    from shardamp.optim import offload
    from shardamp.optim.shards import host_state

    modules = {"offload": offload, "host_state": host_state}
    saved = [(modules[m], n, getattr(modules[m], n)) for m, n, _ in patches]
    model = MLP()
    before = _params(model)
    try:
        if rank_patch:
            for m, n, v in patches:
                setattr(modules[m], n, v)
        error = _raised(lambda: DistributedFusedAdam(model.parameters(), offload="cpu"))
    finally:
        for module, n, v in saved:
            setattr(module, n, v)
    return {"error": error, "untouched": _unchanged(model, before)}


def case_offload_host_short_on_one_rank(rank, world, **kw):
    """One rank's host has too little memory: the agreement's error on every rank, naming that
    rank's shortfall, before any state moves (no weights taken from rank 0)."""
    torch.manual_seed(rank)
    return _offload_with(rank == 1, [("offload", "host_memory_available", lambda: (1000, "MemAvailable"))])


def case_offload_host_short_on_every_rank(rank, world, **kw):
    """Every rank's host is short: each raises the too-little-memory error itself, before any
    state moves."""
    torch.manual_seed(rank)
    return _offload_with(True, [("offload", "host_memory_available", lambda: (1000, "MemAvailable"))])


def _pin_fails(numel, dtype, pin):
    raise RuntimeError("cudaHostAlloc failed")


def case_offload_pin_fails_on_one_rank(rank, world, **kw):
    """One rank cannot pin its host state: every rank raises (the allocation's outcome is agreed),
    before any device state exists or any weight moves."""
    torch.manual_seed(rank)
    return _offload_with(rank == world - 1, [("host_state", "host_empty", _pin_fails)])


def case_two_optimizers_one_group(rank, world, **kw):
    torch.manual_seed(0)
    a, b = MLP(), MLP()
    opt_a = DistributedFusedAdam(a.parameters())
    _backward(a, rank, world)
    opt_a.step()
    opt_a.zero_grad()
    # one after the other, both alive (train one, then the other; save, rebuild, resume): fine
    opt_b = DistributedFusedAdam(b.parameters())
    sequential = []
    for step in range(2):
        for model, opt in ((b, opt_b), (a, opt_a)):
            _backward(model, rank, world, step=step)
            sequential.append(_raised(opt.step))
            opt.zero_grad()
    # rebuilding over the SAME model takes its params over: allowed
    rebuilt = _raised(lambda: DistributedFusedAdam(a.parameters()))
    del opt_a, opt_b
    # one loss through both models: trains too (their reduce-scatters wait for the end of the
    # backward and go in build order, sync/backward_order.py; exactness against torch in the
    # case_two_opt_* cases of cases_two_optimizers.py)
    c, d = MLP(out=12), MLP()
    opt_c, opt_d = DistributedFusedAdam(c.parameters()), DistributedFusedAdam(d.parameters())
    x, y = batches(0, world)[rank]
    ((d(c(x)) - y) ** 2).mean().backward()
    before = _params(c) + _params(d)
    at_step = [_raised(opt_c.step), _raised(opt_d.step)]
    trained = [not _unchanged(c, before[:len(_params(c))]), not _unchanged(d, before[len(_params(c)):])]
    opt_c.zero_grad()
    opt_d.zero_grad()
    ((c(x) - x) ** 2).mean().backward()  # c alone
    after = _raised(opt_c.step)
    return {"sequential": sequential, "rebuilt": rebuilt, "at_step": at_step, "trained": trained,
            "after": after, "model": _params(c) + _params(d)}


# ---------------------------------------------------------------- per step
def _per_step_case(rank, world, edit, norm_types=(2.0, 2.0), lr=1e-2):
    """Build identically, then let ``edit(opt, rank)`` make rank 1 differ before the step;
    rank 1 clips with ``norm_types[1]``, the others with ``norm_types[0]``."""
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(model.parameters(), lr=lr, bucket_cap_mb=TINY)
    _backward(model, rank, world)
    opt.step()  # one good step first: the mismatch is caught on a later one
    opt.zero_grad()
    _backward(model, rank, world, step=1)
    before = _params(model)
    edit(opt, rank)

    def step():
        opt.clip_grad_norm(1.0, norm_type=norm_types[1] if rank == 1 else norm_types[0])
        opt.step()

    return {"error": _raised(step), "untouched": _unchanged(model, before)}


def case_lr_differs_per_step(rank, world, **kw):
    def edit(opt, r):
        if r == 1:
            opt.param_groups[0]["lr"] = 5e-2
    return _per_step_case(rank, world, edit)


def case_norm_type_differs(rank, world, **kw):
    return _per_step_case(rank, world, lambda opt, r: None, norm_types=(2.0, 1.0))


def case_eps_differs_under_inf_norm(rank, world, **kw):
    # the inf norm MAX-reduces the stats: the (c, -c) entries must catch it there too
    def edit(opt, r):
        if r == 1:
            opt.param_groups[0]["eps"] = 1e-6
    return _per_step_case(rank, world, edit, norm_types=(float("inf"), float("inf")))


def case_tensor_lr_differs(rank, world, **kw):
    def edit(opt, r):
        if r == 1:
            opt.param_groups[0]["lr"].fill_(3e-2)
    return _per_step_case(rank, world, edit, lr=torch.tensor(1e-2))


def case_nan_tensor_lr_on_one_rank(rank, world, **kw):
    def edit(opt, r):
        if r == 1:
            opt.param_groups[0]["lr"].fill_(float("nan"))
    return _per_step_case(rank, world, edit, lr=torch.tensor(1e-2))


def case_bad_betas_on_one_rank(rank, world, **kw):
    def edit(opt, r):
        if r == 1:
            opt.param_groups[0]["betas"] = (0.9, 1.5)
    return _per_step_case(rank, world, edit)


def case_max_grad_norm_differs(rank, world, **kw):
    def edit(opt, r):
        if r == 1:
            opt.max_grad_norm = 0.5
    return _per_step_case(rank, world, edit)


def case_agreeing_ranks_still_train(rank, world, **kw):
    """Control: the same edits on every rank train normally."""
    def edit(opt, r):
        opt.param_groups[0]["lr"] = 5e-2
    return _per_step_case(rank, world, edit)


# ---------------------------------------------------------------- collectives called on some ranks
def _trained(rank, world):
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    _backward(model, rank, world)
    opt.step()
    opt.zero_grad()
    return model, opt


def _moments(opt):
    return [b.exp_avg.clone() for b in opt._buffers]


def _only_rank0(rank, world, opt, call, seconds=4.0):
    """Rank 0 calls ``call`` alone (SHARDAMP_COLLECTIVE_TIMEOUT=``seconds``); the others join the
    orphaned agreement all-reduce (over the optimizer's group for small all-reduces) only after
    rank 0 gave up, so the group stays usable."""
    os.environ["SHARDAMP_COLLECTIVE_TIMEOUT"] = str(seconds)
    config.reload()  # settings are read once per process
    try:
        if rank == 0:
            t0 = time.monotonic()
            error = _raised(call)
            return {"error": error, "seconds": time.monotonic() - t0}
        time.sleep(seconds + 4.0)
        # complete rank 0's abandoned call (its agreement flags travel over a group of their own)
        dist.all_reduce(torch.zeros(7), op=dist.ReduceOp.MAX, group=opt._comm.call_group)
        return {"error": None, "seconds": 0.0}
    finally:
        del os.environ["SHARDAMP_COLLECTIVE_TIMEOUT"]
        config.reload()  # settings are read once per process
        dist.barrier()


def case_load_state_dict_on_one_rank(rank, world, **kw):
    model, opt = _trained(rank, world)
    sd = opt.state_dict()
    for entry in sd["state"].values():
        entry["exp_avg"].add_(1.0)
    before = _moments(opt)
    out = _only_rank0(rank, world, opt, lambda: opt.load_state_dict(sd))
    out["untouched"] = all(torch.equal(a, b.exp_avg) for a, b in zip(before, opt._buffers))
    return out


def case_state_dict_on_one_rank(rank, world, **kw):
    model, opt = _trained(rank, world)
    return _only_rank0(rank, world, opt, lambda: opt.state_dict())


def case_save_sharded_on_one_rank(rank, world, tmp=None, **kw):
    model, opt = _trained(rank, world)
    path = os.path.join(tmp, "alone")
    out = _only_rank0(rank, world, opt, lambda: save_sharded(opt, path))
    out["written"] = os.path.exists(path)
    return out


def case_load_sharded_on_one_rank(rank, world, tmp=None, **kw):
    model, opt = _trained(rank, world)
    path = os.path.join(tmp, f"together-{world}")
    save_sharded(opt, path)
    for b in opt._buffers:
        b.exp_avg.add_(1.0)  # differs from the checkpoint: a load would show
    before = _moments(opt)
    out = _only_rank0(rank, world, opt, lambda: load_sharded(opt, path))
    out["untouched"] = all(torch.equal(a, b.exp_avg) for a, b in zip(before, opt._buffers))
    return out


def case_watched_state_dict_on_one_rank(rank, world, **kw):
    """With the watchdog (the CUDA path): the agreement all-reduce of a call on one rank only is
    ended by the monitor within the bound, naming the call; the optimizer's (fresh) groups are
    aborted, WORLD stays usable."""
    with _bounded_group(world, watchdog=True) as group:
        torch.manual_seed(0)
        model = MLP()
        opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY, process_group=group)
        _backward(model, rank, world)
        opt.step()
        opt.zero_grad()
        out = {"error": None, "seconds": 0.0}
        if rank == 0:
            t0 = time.monotonic()
            out = {"error": _raised(opt.state_dict), "seconds": time.monotonic() - t0,
                   "aborted": len(opt._comm.watchdog.aborted)}
        else:
            time.sleep(3 * ORDER_BOUND + 4.0)
        dist.barrier()  # WORLD is not one of the optimizer's groups: untouched
        return out


def case_different_collectives(rank, world, tmp=None, **kw):
    model, opt = _trained(rank, world)
    sd = opt.state_dict()
    call = (lambda: opt.state_dict()) if rank == 0 else (lambda: opt.load_state_dict(sd))
    return {"error": _raised(call)}


def case_different_state_dicts(rank, world, **kw):
    model, opt = _trained(rank, world)
    sd = opt.state_dict()
    if rank == 1:
        for entry in sd["state"].values():
            entry["exp_avg"].mul_(2.0)
    before = _moments(opt)
    error = _raised(lambda: opt.load_state_dict(sd))
    return {"error": error, "untouched": all(torch.equal(a, b.exp_avg) for a, b in zip(before, opt._buffers))}


def case_call_meets_stats_all_reduce(rank, world, **kw):
    """state_dict() on rank 0 while the others compute an inf norm: two small all-reduces of
    different sizes (gloo aborted the process when both shared one group); each rank raises in
    bounded time, naming its own call."""
    def misstep(opt, model, r, w):
        _backward(model, r, w, step=2)
        if r == 0:
            opt.state_dict()
        else:
            opt.grad_norm(float("inf"))
        return True
    return _order_case(rank, world, misstep)


def case_clip_in_last_step_on_one_rank(rank, world, tmp=None, **kw):
    """The last step of a run clipped on rank 1 only: no later step compares it, so state_dict
    and save_sharded do (and write nothing); after a step that clipped alike they work."""
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    _backward(model, rank, world)
    opt.clip_grad_norm(1.0)
    opt.step()
    opt.zero_grad()
    agreeing = _raised(opt.state_dict)
    _backward(model, rank, world, step=1)
    if rank == 1:
        opt.clip_grad_norm(1e-3)
    opt.step()
    opt.zero_grad()
    path = os.path.join(tmp, f"mixed-{world}")
    return {"agreeing": agreeing, "state_dict": _raised(opt.state_dict),
            "save_sharded": _raised(lambda: save_sharded(opt, path)), "written": os.path.exists(path)}


CASES = [n for n in dir() if n.startswith("case_")]
