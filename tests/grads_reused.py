"""What a step applies is what ``param.grad`` shows, against unsharded torch (torch.optim.AdamW +
torch.amp.GradScaler + torch's clip, one process fed every rank's batch), in the cases where the
grads a DistributedFusedAdam keeps are scaled by a pending coefficient:

* ``idiom_*``: torch's clip BEFORE ``unscale_`` with torch's scaled threshold
  (``clip(params, max_norm * scaler.get_scale())``): torch's ``clip_grad_norm_`` (``torch``),
  ``get_total_norm`` + ``clip_grads_with_norm_`` (``halves``), ``shardamp.optim.clip_grad_norm_``
  (``shardamp``); ``plain``: a plain threshold there, which clips by the scaled norm as torch does;
* ``second_step``: unscale_, torch's clip, step, then a second step without a backward
  (``scaler.step`` again after ``update``: torch unscales the grads it left a second time);
* ``no_zero_grad``: zero_grad only every third step, so backward adds to the grads the last
  step left (unscaled, clipped);
* ``backward_after_unscale``: unscale_, torch's clip, then a second backward before the step: it
  adds to the unscaled, clipped grads, and the scaler does not unscale again (as torch's).

``case_read_on_one_rank``: ``p.grad.norm()`` and ``opt.full_grad(p)`` on rank 0 alone raise there
in bounded time, issuing no collective; the ranks then train and read on, like torch.

``run(rank, world, case, scaler)``: ``scaler`` "torch", "sharded" (ShardedGradScaler against
torch's) or "none" (fp32); with a scaler, an inf in ONE rank's batch at ``INF_STEP``. Returns per
step both sides' params, the grads ``full_grad`` shows and the reference's ``p.grad`` (before
zero_grad), and the norms the clip returned.
"""
from __future__ import annotations

import copy
import time
import warnings
from typing import Any, Dict, List

import torch
import torch.nn as nn

import shardamp.optim as so
from parity import MLP, batches, two_groups
from shardamp.optim import DistributedFusedAdam
from shardamp.scaler import ShardedGradScaler

STEPS = 5
INF_STEP = 2
MAX_NORM = 0.2
SCALER_KW = dict(init_scale=2.0**10, growth_interval=2)
CASES = ["idiom_torch", "idiom_halves", "idiom_shardamp", "plain", "second_step", "no_zero_grad",
         "backward_after_unscale"]


def _poison(x: torch.Tensor, step: int, rank: int, world: int, scaled: bool) -> torch.Tensor:
    if scaled and step == INF_STEP and rank == world - 1:
        x = x.clone()
        x[0, 0] = float("inf")
    return x


def _clip(kind: str, params: List[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip by one of its routes (the reference always takes torch's own function)."""
    if kind == "halves":
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm
    if kind == "shardamp":
        return so.clip_grad_norm_(params, max_norm)
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def run(rank: int, world: int, case: str, scaler_kind: str) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=0.0004)  # uneven shards, several buckets
    ropt = torch.optim.AdamW(two_groups(ref))
    scaled = scaler_kind != "none"
    scaler = rscaler = None
    if scaled:
        scaler = (torch.amp.GradScaler if scaler_kind == "torch" else ShardedGradScaler)("cpu", **SCALER_KW)
        rscaler = torch.amp.GradScaler("cpu", **SCALER_KW)
    route = case.split("_", 1)[1] if case.startswith("idiom_") else "torch"
    loss_fn = nn.MSELoss()
    out: Dict[str, List[Any]] = {k: [] for k in ("ours", "ref", "grads", "ref_grads", "norm", "ref_norm", "scale",
                                                 "ref_scale", "threshold")}
    caught: List[str] = []
    for step in range(STEPS):
        data = batches(step, world)
        def ref_loss() -> torch.Tensor:
            return sum(loss_fn(ref(_poison(x, step, r, world, scaled)), y) for r, (x, y) in enumerate(data)) / world

        def our_loss() -> torch.Tensor:
            x, y = data[rank]
            return loss_fn(model(_poison(x, step, rank, world, scaled)), y)

        norms, thresholds = [], []
        sides = ((ref, ropt, rscaler, "torch", ref_loss), (model, opt, scaler, route, our_loss))
        for m, o, s, kind, make_loss in sides:
            loss = make_loss()
            params = list(m.parameters())
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                (s.scale(loss) if s else loss).backward()
                if case.startswith("idiom_") or case == "plain":
                    # before unscale_: the scaled grads, clipped by the scaled norm, as torch does
                    threshold = MAX_NORM * (s.get_scale() if s and case != "plain" else 1.0)
                else:
                    if s:
                        s.unscale_(o)
                    threshold = MAX_NORM
                norms.append(float(_clip(kind, params, threshold)))
                thresholds.append(threshold)
                if case == "backward_after_unscale":  # adds to the unscaled, clipped grads; not unscaled again
                    loss = make_loss()
                    (s.scale(loss) if s else loss).backward()
                if s:
                    s.step(o)
                    s.update()
                else:
                    o.step()
                if case == "second_step":  # no backward: the grads the first step left, as p.grad shows them
                    if s:
                        s.step(o)
                        s.update()
                    else:
                        o.step()
            caught += [f"{x.category.__name__}: {x.message}" for x in w if x.category is not FutureWarning]
        out["grads"].append([None if g is None else g.clone() for g in (opt.full_grad(p) for p in model.parameters())])
        out["ref_grads"].append([None if p.grad is None else p.grad.clone() for p in ref.parameters()])
        if case != "no_zero_grad" or step % 3 == 2:
            opt.zero_grad()
            ropt.zero_grad()
        out["ours"].append([p.detach().clone() for p in model.parameters()])
        out["ref"].append([p.detach().clone() for p in ref.parameters()])
        out["ref_norm"].append(norms[0])
        out["norm"].append(norms[1])
        out["threshold"].append(thresholds[0])
        out["scale"].append(scaler.get_scale() if scaler else None)
        out["ref_scale"].append(rscaler.get_scale() if rscaler else None)
    out["warnings"] = caught
    return out


def _case(case: str, scaler_kind: str):
    def fn(rank: int, world: int) -> Dict[str, Any]:
        return run(rank, world, case, scaler_kind)

    fn.__name__ = f"case_{case}_{scaler_kind}"
    return fn


ALL = []
for _scaler in ("torch", "sharded", "none"):
    for _c in CASES:
        if _scaler == "none" and (_c.startswith("idiom_") and _c != "idiom_torch" or _c == "plain"):
            continue  # without a scaler the idiom is the plain clip: once
        globals()[f"case_{_c}_{_scaler}"] = _case(_c, _scaler)
        ALL.append(f"case_{_c}_{_scaler}")


READ_TIMEOUT = 6.0  # SHARDAMP_COLLECTIVE_TIMEOUT: a grad read waits half of it


def case_read_on_one_rank(rank: int, world: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=0.0004)
    ropt = torch.optim.AdamW(two_groups(ref))
    loss_fn = nn.MSELoss()
    out: Dict[str, List[Any]] = {k: [] for k in ("errors", "norms", "ref_norms", "ours", "ref")}
    so.config.configure(collective_timeout=READ_TIMEOUT)
    try:
        for step in range(3):
            data = batches(step, world)
            (sum(loss_fn(ref(x), y) for x, y in data) / world).backward()
            x, y = data[rank]
            loss_fn(model(x), y).backward()
            if rank == 0 and step < 2:  # a rank-0 logging line: a collective read on one rank
                began = time.monotonic()
                try:
                    if step == 0:
                        model.a.weight.grad.norm()
                    else:
                        opt.full_grad(model.a.weight)
                except RuntimeError as exc:
                    out["errors"].append((str(exc), time.monotonic() - began))
            # the other ranks wait for rank 0 in the step's collectives, then every rank reads
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            opt.step()
            ropt.step()
            out["norms"].append([float(p.grad.norm()) for p in model.parameters()])
            out["ref_norms"].append([float(p.grad.norm()) for p in ref.parameters()])
            opt.zero_grad()
            ropt.zero_grad()
            out["ours"].append([p.detach().clone() for p in model.parameters()])
            out["ref"].append([p.detach().clone() for p in ref.parameters()])
    finally:
        so.config.configure(collective_timeout=None)
    return out


ALL.append("case_read_on_one_rank")
