"""Checkpoint cases: each ``case_*(rank, world, tmp)`` runs on every rank of one spawned group
(gloo on CPU: test_checkpoint.py; NCCL on GPUs: test_cuda_checkpoint.py); groups hand
checkpoints to each other through files in ``tmp``.

Every step uses one fixed batch of ``PER_STEP`` samples split evenly over the ranks, so a run at
any world size (1, 2, 3, or unsharded torch fed the whole batch) sees the same average gradient:
training can stop at one world size and resume at another. ``run(..., device=, per_step=)`` sets
the device the cases build on and the batch size (a multiple of every world size in use) for the
whole spawned process; the defaults are the CPU tests'.
"""
from __future__ import annotations

import os
import traceback
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed
import torch.nn as nn
import torch.nn.functional as F

from parity import named_two_groups, ConvNet, MLP, backward_and_step, two_groups
from shardamp.optim import DistributedFusedAdam
from shardamp.optim.checkpoint import load_sharded, save_sharded
from shardamp.scaler import ShardedGradScaler

TINY = 0.0004  # MB: about 100 fp32 elements per bucket, so params straddle buckets and shards
PER_STEP = 6  # samples per step: divisible by worlds 1, 2 and 3 (the GPU test sets 12)
SAVE_AT = 3
TOTAL = 6
DEVICE = "cpu"  # where build() puts models (set by run() in a spawned group)


# ====================================================================== shared by cases and tests
def batch(step: int, kind: str = "mlp", per_step: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch, on the CPU (same values whatever the device trained on)."""
    n = per_step or PER_STEP
    g = torch.Generator().manual_seed(500 + step)
    if kind == "conv":
        return torch.randn(n, 3, 6, 6, generator=g), torch.randn(n, 3, generator=g)
    return torch.randn(n, 12, generator=g), torch.randn(n, 5, generator=g)


def new_model(kind: str = "mlp", dtype: torch.dtype = torch.float32, channels_last: bool = False,
              device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)  # initialised on the CPU: the same weights on every device
    model = (ConvNet() if kind == "conv" else MLP()).to(dtype)
    model = model.to(memory_format=torch.channels_last) if channels_last else model
    return model.to(device)  # .to(device) keeps the channels_last strides


def train(model: nn.Module, opt: Any, steps: Sequence[int], rank: int = 0, world: int = 1,
          kind: str = "mlp", scaler: Optional[Any] = None, per_step: Optional[int] = None) -> None:
    """``steps`` of training on this rank's slice of each step's batch (all of it at world 1),
    on the model's device."""
    per_step = per_step or PER_STEP
    # an uneven split would silently drop samples and break the equal-average-gradient premise
    assert per_step % world == 0, f"{per_step} samples per step cannot be split over {world} ranks"
    n = per_step // world
    p = next(model.parameters())
    for step in steps:
        x, y = batch(step, kind, per_step)
        x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        backward_and_step(F.mse_loss(model(x.to(p.device, p.dtype)).float(), y.to(p.device)), opt, scaler)
        opt.zero_grad()
    if hasattr(opt, "param_sync"):
        opt.param_sync()


def torch_run(kind: str = "mlp", steps: Sequence[int] = range(TOTAL), cls: type = torch.optim.AdamW,
              channels_last: bool = False, per_step: Optional[int] = None, named: bool = False,
              **kw: Any) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """The unsharded reference, on the CPU: torch.optim over the same model and groups, whole
    batches of ``per_step`` samples (default ``PER_STEP``); ``named``: groups of ``(name, param)``."""
    model = new_model(kind, channels_last=channels_last)
    opt = cls((named_two_groups if named else two_groups)(model), **kw)
    train(model, opt, steps, kind=kind, per_step=per_step)
    return model, opt


def params_of(model: nn.Module) -> List[torch.Tensor]:
    """The params as CPU tensors (what a spawned rank hands back to the test)."""
    return [p.detach().cpu().clone() for p in model.parameters()]


def assert_sd_equal(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    """Bitwise: same entries, values, dtypes and memory layouts; same param_groups."""
    assert a["param_groups"] == b["param_groups"], (a["param_groups"], b["param_groups"])
    assert a.get("shardamp") == b.get("shardamp")
    assert sorted(a["state"]) == sorted(b["state"])
    for i, entry in a["state"].items():
        other = b["state"][i]
        assert sorted(entry) == sorted(other), (i, sorted(entry), sorted(other))
        for k, t in entry.items():
            u = other[k]
            if not isinstance(t, torch.Tensor):  # a blockwise moment's block offsets and param layout
                assert t == u, (i, k, t, u)
                continue
            assert t.dtype == u.dtype and t.shape == u.shape and t.stride() == u.stride(), (i, k)
            assert torch.equal(t, u), f"state[{i}][{k!r}] differs"


def build(kind: str = "mlp", dtype: torch.dtype = torch.float32, channels_last: bool = False,
          device: Optional[str] = None, named: bool = False, **kw: Any) -> Tuple[nn.Module, DistributedFusedAdam]:
    """A model on ``device`` (default ``DEVICE``) and DistributedFusedAdam over its two groups
    (``named``: of ``(name, param)`` pairs, as ``named_parameters()`` gives them)."""
    model = new_model(kind, dtype, channels_last, device or DEVICE)
    return model, DistributedFusedAdam((named_two_groups if named else two_groups)(model), **kw)


def _load(tmp: str, name: str) -> Any:
    # CPU first: a rank must not materialise tensors on the GPU of the rank that saved them
    return torch.load(os.path.join(tmp, name), weights_only=True, map_location="cpu")


def _save(obj: Any, tmp: str, name: str, rank: int) -> None:
    """Rank 0 writes; every rank waits until the file is complete (later cases read it)."""
    if rank == 0:
        torch.save(obj, os.path.join(tmp, name))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


# ====================================================================== world 3: train and save
def case_save(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    model, opt = build(bucket_cap_mb=TINY)
    scaler = ShardedGradScaler(DEVICE, init_scale=2.0**8, growth_interval=2)
    train(model, opt, range(SAVE_AT), rank, world, scaler=scaler)
    sd = opt.state_dict()
    sd0 = opt.state_dict(rank0_only=True)
    if rank == 0:
        assert_sd_equal(sd, sd0)
    else:
        assert sd0 is None
    save_sharded(opt, os.path.join(tmp, "dcp"), scaler=scaler)
    _save({"model": model.state_dict(), "opt": sd}, tmp, "w3.pt", rank)
    return {"sd": sd, "scaler": scaler.state_dict(), "params": params_of(model)}


def case_roundtrip(rank: int, world: int, tmp: str) -> bool:
    """save, load (one big bucket: a different layout), save: bitwise identical."""
    saved = _load(tmp, "w3.pt")
    model, opt = build(bucket_cap_mb=1000.0)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert_sd_equal(opt.state_dict(), saved["opt"])
    return True


def case_bf16(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    model, opt = build(dtype=torch.bfloat16, bucket_cap_mb=TINY, grad_sync_dtype=torch.float32)
    train(model, opt, range(SAVE_AT), rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sd = opt.state_dict()
    _save({"model": model.state_dict(), "opt": sd}, tmp, "bf16.pt", rank)
    return {"sd": sd, "warnings": [str(w.message) for w in caught], "model": params_of(model)}


def case_channels_last(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    model, opt = build("conv", channels_last=True, bucket_cap_mb=TINY)
    train(model, opt, range(SAVE_AT), rank, world, kind="conv")
    sd = opt.state_dict()
    _save({"model": model.state_dict(), "opt": sd}, tmp, "cl.pt", rank)
    return {"sd": sd}


def _mutations(sd: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    import copy

    def edit(fn):
        d = copy.deepcopy(sd)
        fn(d)
        return d

    def move_param(d):
        d["param_groups"][0]["params"].append(d["param_groups"][1]["params"].pop(0))

    def set_state(i, k, v):
        return lambda d: d["state"][i].__setitem__(k, v)

    last = max(sd["state"])
    return [
        ("has 1 param groups, the optimizer has 2", edit(lambda d: d["param_groups"].pop())),
        ("param_groups\\[0\\] has 3 params, the optimizer's group 0 has 2", edit(move_param)),
        ("covers 6 params, the optimizer has 7", edit(lambda d: d["param_groups"][1]["params"].pop())),
        ("'exp_avg' has shape \\(3, 3\\)", edit(set_state(0, "exp_avg", torch.zeros(3, 3)))),
        # the LAST entry is bad: nothing before it may have been written
        ("'exp_avg_sq' has shape \\(2,\\)", edit(set_state(last, "exp_avg_sq", torch.zeros(2)))),
        ("missing 'exp_avg_sq'", edit(lambda d: d["state"][last].pop("exp_avg_sq"))),
        ("betas", edit(lambda d: d["param_groups"][1].__setitem__("betas", (1.5, 0.9)))),
        ("amsgrad=True", edit(lambda d: d["param_groups"][0].__setitem__("amsgrad", True))),
        ("state entry 99 belongs to no param", edit(lambda d: d["state"].__setitem__(99, d["state"][0]))),
        ("step=-1", edit(set_state(0, "step", torch.tensor(-1.0)))),
    ]


def case_errors(rank: int, world: int, tmp: str) -> List[str]:
    """Mismatched state dicts raise ValueError naming the mismatch; nothing changes."""
    import re

    saved = _load(tmp, "w3.pt")
    model, opt = build(bucket_cap_mb=TINY)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    for g in opt.param_groups:
        g["lr"] = 0.123  # differs from the dicts below: a half-applied load would show
    before, weights = opt.state_dict(), params_of(model)
    messages = []
    for pattern, bad in _mutations(saved["opt"]):
        try:
            opt.load_state_dict(bad)
        except ValueError as e:
            assert re.search(pattern, str(e)), f"expected /{pattern}/, got: {e}"
            messages.append(str(e))
        else:
            raise AssertionError(f"no error for /{pattern}/")
        assert_sd_equal(opt.state_dict(), before)
    # a sharded checkpoint of a different model
    small = MLP(hidden=16).to(DEVICE)
    other = DistributedFusedAdam(two_groups(small))
    try:
        load_sharded(other, os.path.join(tmp, "dcp"))
    except ValueError as e:
        assert "shape" in str(e), str(e)
        messages.append(str(e))
    else:
        raise AssertionError("load_sharded accepted a checkpoint of another model")
    assert all(torch.equal(a, b) for a, b in zip(weights, params_of(model)))
    return messages


def case_save_named(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """Named params (groups of ``(name, param)``): the state dict carries ``param_groups[g]
    ["param_names"]`` as torch's does; saved for world 2, torch and world 1 to resume."""
    model, opt = build(bucket_cap_mb=TINY, named=True)
    train(model, opt, range(SAVE_AT), rank, world)
    sd = opt.state_dict()
    save_sharded(opt, os.path.join(tmp, "dcp_named"))
    _save({"model": model.state_dict(), "opt": sd}, tmp, "named.pt", rank)
    return {"sd": sd}


# ====================================================================== world 2 (and 1): resume
def case_resume(rank: int, world: int, tmp: str) -> List[torch.Tensor]:
    saved = _load(tmp, "w3.pt")
    model, opt = build(bucket_cap_mb=2 * TINY)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, range(SAVE_AT, TOTAL), rank, world)
    return params_of(model)


def case_dcp(rank: int, world: int, tmp: str, bucket_cap_mb: float = TINY) -> Dict[str, Any]:
    saved = _load(tmp, "w3.pt")
    model, opt = build(bucket_cap_mb=bucket_cap_mb)
    model.load_state_dict(saved["model"])
    scaler = ShardedGradScaler(DEVICE)
    load_sharded(opt, os.path.join(tmp, "dcp"), scaler=scaler)
    sd, scaler_sd = opt.state_dict(), scaler.state_dict()
    train(model, opt, range(SAVE_AT, TOTAL), rank, world, scaler=scaler)
    return {"sd": sd, "scaler": scaler_sd, "params": params_of(model)}


def case_dcp_one_bucket(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """case_dcp into one big bucket: another layout even at the world size that saved."""
    return case_dcp(rank, world, tmp, bucket_cap_mb=1000.0)


def case_bf16_resume(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    saved = _load(tmp, "bf16.pt")
    model, opt = build(dtype=torch.bfloat16, bucket_cap_mb=1000.0, grad_sync_dtype=torch.float32)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    return {"sd": opt.state_dict()}


def case_channels_last_resume(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    saved = _load(tmp, "cl.pt")
    model, opt = build("conv", channels_last=True, bucket_cap_mb=3 * TINY)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sd = opt.state_dict()
    train(model, opt, range(SAVE_AT, TOTAL), rank, world, kind="conv")
    layouts = [p.is_contiguous(memory_format=torch.channels_last) for p in model.parameters() if p.dim() == 4]
    return {"sd": sd, "params": params_of(model), "channels_last": layouts}


def case_from_torch(rank: int, world: int, tmp: str) -> List[torch.Tensor]:
    """torch.optim.Adam (L2 decay) state dict -> shardamp (built as AdamW) -> continue."""
    saved = _load(tmp, "torch.pt")
    model, opt = build(bucket_cap_mb=TINY)
    model.load_state_dict(saved["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # switching to adam_w_mode=False warns, by design
        opt.load_state_dict(saved["opt"])
    assert opt.adam_w_mode is False
    train(model, opt, range(SAVE_AT, TOTAL), rank, world)
    return params_of(model)


def case_resume_named(rank: int, world: int, tmp: str) -> Dict[str, Any]:
    """The named world-3 state dict into a named optimizer (another layout), and the same into
    an unnamed one, which takes the dict's names (torch's rule); DCP too; then training on."""
    saved = _load(tmp, "named.pt")
    unnamed_model, unnamed = build(bucket_cap_mb=1000.0)
    unnamed.load_state_dict(saved["opt"])
    names = [g.get("param_names") for g in unnamed.param_groups]
    del unnamed  # one live optimizer per process group
    dcp_model, dcp = build(bucket_cap_mb=3 * TINY, named=True)
    load_sharded(dcp, os.path.join(tmp, "dcp_named"))
    dcp_sd = dcp.state_dict()
    del dcp
    model, opt = build(bucket_cap_mb=2 * TINY, named=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, range(SAVE_AT, TOTAL), rank, world)
    return {"names_taken": names, "dcp_sd": dcp_sd, "params": params_of(model), "sd": opt.state_dict()}


# ====================================================================== runner
W3_CASES = ["case_save", "case_roundtrip", "case_bf16", "case_channels_last", "case_errors", "case_save_named"]
W2_CASES = ["case_resume", "case_dcp", "case_bf16_resume", "case_channels_last_resume", "case_from_torch",
            "case_resume_named"]


def run(rank: int, world: int, tmp: str, names: List[str], device: str = "cpu",
        per_step: int = PER_STEP) -> Dict[str, Any]:
    """As dist_helper.run_cases, with the shared temp dir: a failure is recorded, and stops the
    group (a half-run case may leave the ranks' collectives out of step). ``device`` and
    ``per_step`` hold for every case of this spawned process (module globals: each rank is a
    fresh process, so nothing leaks into the test's own process)."""
    global DEVICE, PER_STEP
    DEVICE, PER_STEP = device, per_step
    out: Dict[str, Any] = {}
    for name in names:
        try:
            out[name] = ("ok", globals()[name](rank, world, tmp))
        except BaseException:  # noqa: BLE001
            out[name] = ("error", traceback.format_exc())
            break
    return out
