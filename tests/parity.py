"""Train the same model sharded (DistributedFusedAdam, one batch per rank) and unsharded
(torch.optim.AdamW/Adam on one process, fed the union of all ranks' batches) and return both
sets of params, for the tests to compare with ``assert_close``.

Every rank builds the reference too (it is tiny), so results from any rank can be checked.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

import low_bit_reference
from shardamp.optim import DistributedFusedAdam

RTOL, ATOL = 1e-5, 1e-6
LARGEST_LR = 2e-2  # two_groups' first group


def close_up_to_code_flips(ours: torch.Tensor, ref: torch.Tensor, what: str, steps: int) -> None:
    """Blockwise moments against the same quantized math unsharded, or on CUDA against the CPU
    reference: grads summed in another order (fp32 round-off), or the CUDA kernel's contracted
    multiply-adds, can move a moment across a code boundary now and then; that element's updates
    then differ by up to a few lr-sized steps. So: at most 1% of a param's elements (at least one)
    outside torch's tolerance, each within ``steps`` x the largest lr; everything else at torch's
    tolerance."""
    off = ~torch.isclose(ours, ref, rtol=RTOL, atol=ATOL)
    count = int(off.sum())
    assert count <= max(1, ours.numel() // 100), f"{what}: {count} of {ours.numel()} elements off"
    if count:
        worst = float((ours - ref).abs().max())
        assert worst <= steps * LARGEST_LR, f"{what}: an element {worst} away, more than a code flip explains"


class MLP(nn.Module):
    """Four linear layers; ``skip`` names layers to leave out of this forward (unused params)."""

    def __init__(self, dim: int = 12, hidden: int = 20, out: int = 5) -> None:
        super().__init__()
        self.a = nn.Linear(dim, hidden)
        self.b = nn.Linear(hidden, hidden)
        self.c = nn.Linear(hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor, skip: Sequence[str] = ()) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if "b" not in skip:
            h = torch.tanh(self.b(h))
        if "c" not in skip:
            h = h + torch.tanh(self.c(h))
        return self.head(h)


class ConvNet(nn.Module):
    """A small conv net; ``channels_last`` puts its 4-D weights in NHWC memory order."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 5, 3, padding=1)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, skip: Sequence[str] = ()) -> torch.Tensor:
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        return self.head(h.mean(dim=(2, 3)))


class Conv3dNet(nn.Module):
    """A small 3-D conv net for channels_last_3d (NDHWC) weights."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(2, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, skip: Sequence[str] = ()) -> torch.Tensor:
        return self.head(F.relu(self.conv1(x)).mean(dim=(2, 3, 4)))


class TiedNet(nn.Module):
    """A weight tied into a second module (as GPT ties its embedding and output head)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 12, bias=False)
        self.b = nn.Linear(12, 12)
        self.dec = nn.Linear(12, 12, bias=False)
        self.dec.weight = self.a.weight
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor, skip: Sequence[str] = ()) -> torch.Tensor:
        h = torch.tanh(self.dec(x))  # the tied weight is first read by the module that borrowed it
        h = torch.tanh(self.b(h))
        return self.head(torch.tanh(self.a(h)))


class RootReads(nn.Module):
    """The root's own forward reads a child's weight before (instead of) calling the child:
    no module pre-hook covers that read."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 20)
        self.b = nn.Linear(20, 20)
        self.head = nn.Linear(20, 5)

    def forward(self, x: torch.Tensor, skip: Sequence[str] = ()) -> torch.Tensor:
        h = torch.tanh(F.linear(x, self.a.weight, self.a.bias))
        h = torch.tanh(self.b(h))
        return self.head(h)


def batches(
    step: int, world: int, kind: str = "mlp", per_rank: int = 3, device: str = "cpu"
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's batch for ``step`` (identical on every process)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(world):
        if kind == "conv":
            x = torch.randn(per_rank, 3, 6, 6, generator=g)
            y = torch.randn(per_rank, 3, generator=g)
        elif kind == "conv3d":
            x = torch.randn(per_rank, 2, 4, 4, 4, generator=g)
            y = torch.randn(per_rank, 3, generator=g)
        else:
            x = torch.randn(per_rank, 12, generator=g)
            y = torch.randn(per_rank, 5, generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def backward_and_step(loss: torch.Tensor, opt: Any, scaler: Optional[Any] = None) -> None:
    """``loss.backward()`` and ``opt.step()``; through ``scaler`` if given (scaled backward, its
    ``step`` and ``update``)."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()


def two_groups(model: nn.Module) -> List[Dict[str, Any]]:
    first = [p for n, p in model.named_parameters() if n.startswith(("a.", "conv1."))]
    rest = [p for n, p in model.named_parameters() if not n.startswith(("a.", "conv1."))]
    return [
        {"params": first, "lr": 2e-2, "weight_decay": 0.1},
        {"params": rest, "lr": 5e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)},
    ]


def named_two_groups(model: nn.Module) -> List[Dict[str, Any]]:
    """``two_groups`` with ``(name, param)`` pairs, as ``named_parameters()`` gives them."""
    groups = two_groups(model)
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [dict(g, params=[(name_of[id(p)], p) for p in g["params"]]) for g in groups]


def train(
    rank: int,
    world: int,
    *,
    steps: int = 6,
    kind: str = "mlp",
    opt_kwargs: Optional[Dict[str, Any]] = None,
    groups: bool = True,
    skip: Callable[[int, int], Sequence[str]] = lambda step, r: (),
    micro_batches: int = 1,
    lr_schedule: Optional[Callable[[int], Union[float, Sequence[float]]]] = None,
    param_dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
    sum_grads: bool = False,
    device: str = "cpu",
    subgroups: int = 1,
    shadow_ref: bool = False,
    attach: bool = False,
    reduce_each_micro: bool = False,
) -> Dict[str, Any]:
    """Run both trainings; return {"ours": [...], "ref": [...]} (fp32 CPU tensors, by param).

    ``reduce_each_micro``: every micro-batch's backward reduces (no ``no_sync``), so the
    reduced shards accumulate. ``subgroups=k`` splits the ranks into k contiguous process groups, each sharding its own
    optimizer (its reference sees only its group's batches). ``shadow_ref`` feeds the reference
    the grads the sharded model itself produced (for low-precision params or param all-gathers)
    and compares the fp32 masters.
    """
    opt_kwargs = dict(opt_kwargs or {})
    ranks = list(range(world))
    if subgroups > 1:
        import torch.distributed as dist

        size = world // subgroups
        for g in range(subgroups):  # every rank creates every group, in the same order
            members = list(range(g * size, (g + 1) * size))
            group = dist.new_group(members)
            if rank in members:
                opt_kwargs["process_group"], ranks = group, members
    adam_w = opt_kwargs.get("adam_w_mode", True)
    torch.manual_seed(0)
    model = {"conv": ConvNet, "conv3d": Conv3dNet, "tied": TiedNet, "rootreads": RootReads}.get(kind, MLP)()
    fmt = torch.channels_last_3d if kind == "conv3d" else torch.channels_last
    if channels_last:
        model = _to_format(model, fmt)
    model = model.to(device)
    ref = copy.deepcopy(model)  # fp32 reference, before the optimizer rebinds params
    with torch.no_grad():  # a low-precision model's fp32 master starts from its rounded weights
        for p in ref.parameters():
            p.copy_(p.to(param_dtype).float())
    init = [p.detach().float().cpu().clone() for p in ref.parameters()]
    model = model.to(param_dtype)
    params = two_groups(model) if groups else model.parameters()
    ref_params = two_groups(ref) if groups else ref.parameters()
    defaults = {k: v for k, v in opt_kwargs.items() if k in ("lr", "betas", "eps", "weight_decay")}
    opt = DistributedFusedAdam(params, **opt_kwargs)
    if attach:
        opt.attach(model)
    ref_cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    ref_defaults = dict(defaults)
    ref_defaults.setdefault("weight_decay", 0.0)  # torch.optim.AdamW's default is 0.01, ours 0.0
    if low_bit_reference.blockwise(opt_kwargs):  # the same quantized math, unsharded
        assert adam_w and opt_kwargs.get("bias_correction", True)
        ropt = low_bit_reference.reference_for(ref_params, opt, opt_kwargs, param_dtype, **ref_defaults)
    else:
        ropt = ref_cls(ref_params, **ref_defaults)
    if channels_last:
        for p in model.parameters():
            if p.dim() in (4, 5):
                assert p.is_contiguous(memory_format=fmt) and not p.is_contiguous(), "layout lost"
    loss_fn = nn.MSELoss()
    denom = 1.0 if sum_grads else float(len(ranks))
    shadow = shadow_ref or param_dtype != torch.float32
    for step in range(steps):
        if lr_schedule is not None:  # a number: group i takes (1 + i) times it; a list: each group's
            value = lr_schedule(step)
            for o in (opt, ropt):
                for i, g in enumerate(o.param_groups):
                    g["lr"] = value[i] if isinstance(value, (list, tuple)) else value * (1 + i)
        data = [batches(step * micro_batches + m, world, kind, device=device) for m in range(micro_batches)]
        # reference first (the bf16 reference reads the sharded model's weights before its step):
        # one process, the union of all ranks' batches, grads averaged like ours
        for m in range(micro_batches):
            total = 0.0
            for r in ranks:
                x, y = data[m][r]
                if shadow:
                    # fed the same low-precision grads: run a low-precision copy, take its grads
                    total = None
                    break
                total = total + loss_fn(ref(x, skip=skip(step, r)), y)
            if total is None:
                _bf16_reference_grads(ref, model, data[m], skip, step, ranks, loss_fn, param_dtype, denom)
            else:
                (total / denom).backward()
        for m in range(micro_batches):
            x, y = data[m][rank]
            last = m == micro_batches - 1
            ctx = opt.no_sync() if not (last or reduce_each_micro) else _nullcontext()
            with ctx:
                out = model(x.to(param_dtype), skip=skip(step, rank))
                loss_fn(out.float(), y).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    opt.param_sync()  # params are read outside any forward: wait for a pending all-gather
    ours = [p.detach().float().cpu().clone() for p in model.parameters()]
    if shadow:
        ours = [t.cpu() for t in _masters(opt)]
    return {
        "group_ranks": ranks,
        "ours": ours,
        "ref": [p.detach().float().cpu().clone() for p in ref.parameters()],
        "init": init,
        "model_dtype": [p.dtype for p in model.parameters()],
        "model": [p.detach().cpu().clone() for p in model.parameters()],
        "channels_last": [
            p.is_contiguous(memory_format=torch.channels_last if p.dim() == 4 else torch.channels_last_3d)
            for p in model.parameters() if p.dim() in (4, 5)
        ],
    }


def _to_format(model: nn.Module, fmt: torch.memory_format) -> nn.Module:
    """``module.to(memory_format=...)`` for 4-D and 5-D weights alike (torch's only handles 4-D)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() in (4, 5):
                p.data = p.data.contiguous(memory_format=fmt)
    return model


def _masters(opt: DistributedFusedAdam) -> List[torch.Tensor]:
    """The fp32 master params, all-gathered (world-size independent), by param."""
    import torch.distributed as dist

    from shardamp.optim.shards.buffers import param_view

    out = [None] * len(opt._params)
    for bucket, buf in zip(opt._buckets, opt._buffers):
        master = buf.master_values()  # fp32, also reassembled from remainders
        full = torch.empty(bucket.numel, dtype=master.dtype, device=master.device)
        if opt._comm.shard_size > 1:  # over the shard dim: replicas hold the same masters
            dist.all_gather_into_tensor(full, master.contiguous(), group=opt._comm.shard_group)
        else:
            full.copy_(master)
        for slot in bucket.slots:
            out[slot.index] = param_view(full, slot).clone()
    return out


def _bf16_reference_grads(ref, model, data, skip, step, ranks, loss_fn, dtype, denom) -> None:
    """Give the fp32 reference the grads that a low-precision copy of the CURRENT sharded model
    produces on each rank's batch (what the sharded run reduced), summed in fp32."""
    grads = [torch.zeros_like(p) for p in ref.parameters()]
    for r in ranks:
        shadow = type(model)().to(device=model.head.weight.device, dtype=dtype)
        shadow.load_state_dict(model.state_dict())
        x, y = data[r]
        loss_fn(shadow(x.to(dtype), skip=skip(step, r)).float(), y).backward()
        for g, p in zip(grads, shadow.parameters()):
            if p.grad is not None:
                g += p.grad.float()
    for p, g in zip(ref.parameters(), grads):
        p.grad = g / denom


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
