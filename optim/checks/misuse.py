"""Misuse that would otherwise train silently wrong, detected so it raises naming the fix: a model
wrapped in ``torch.nn.parallel.DistributedDataParallel``, a launcher's ``WORLD_SIZE > 1``
without a process group; and the texts of the step cycle's gate (step/cycle.py), which refuses a
step, an unscale, a clip or a grad read out of order: a step with no grads, a second unscale, a
read inside ``no_sync`` or of grads not reduced yet, a norm type the last step did not compute,
and the warning of ``opt.clip_grad_norm`` before unscaling (loop G: its ``max_norm`` is the plain
one). The gate formats them with ``{what}`` (the call refused) and ``{norm_type}`` /
``{computed}``.

DDP would all-reduce every grad a second time and write the result into ``param.grad`` (which
the optimizer never reads: it reduce-scatters the grads itself during backward). DDP leaves no
mark on the params, so the wrappers are found among the live objects (one C-level pass, tens of
milliseconds); that runs only where a process group exists (construction) or a misuse was
already seen (a stray ``.grad`` at step).
"""
from __future__ import annotations

import gc
import os
import warnings
from typing import Any, Dict, Iterable, Optional, Sequence

import torch
import torch.distributed as dist


def find_ddp(params: Iterable[torch.nn.Parameter]) -> Optional[torch.nn.Module]:
    """The first live DistributedDataParallel whose module holds one of ``params``, else None."""
    classes, todo = set(), [torch.nn.parallel.DistributedDataParallel]
    while todo:  # DDP and its subclasses (Lightning's, accelerate's wrappers)
        cls = todo.pop()
        if cls not in classes:
            classes.add(cls)
            todo.extend(cls.__subclasses__())
    ids = {id(p) for p in params}
    # an instance of a Python class refers to its class, so the referrers of the classes are the
    # live wrappers: one C-level pass over the tracked objects, no Python loop over all of them
    for obj in gc.get_referrers(*classes):
        if type(obj) in classes:
            module = obj.__dict__.get("_modules", {}).get("module")
            if module is not None and any(id(p) in ids for p in module.parameters()):
                return obj
    return None


def ddp_error(ddp: torch.nn.Module) -> RuntimeError:
    return RuntimeError(
        f"DistributedFusedAdam: the model ({type(ddp.module).__name__}) is wrapped in "
        "torch.nn.parallel.DistributedDataParallel. DistributedFusedAdam reduce-scatters the grads "
        "itself during backward; DDP would all-reduce them a second time into param.grad, which the "
        "optimizer never reads. Do not wrap the model in DDP (before or after building the "
        "optimizer): train the bare module. With a framework use shardamp.integrations "
        "(Lightning: strategy=ShardampStrategy(); accelerate: ShardampAccelerator; transformers: "
        "ShardampTrainer), which keep the model unwrapped."
    )


def check_setup(param_groups: Sequence[Dict[str, Any]], explicit_group: bool) -> None:
    """At construction: raise for a launcher's processes without a process group
    (:func:`check_launcher_env`, where no group or mesh was given) and for a model wrapped in DDP.

    Raises:
        RuntimeError: naming the misuse and the fix."""
    initialized = dist.is_available() and dist.is_initialized()
    if not explicit_group and not initialized:
        check_launcher_env()
    if initialized:
        ddp = find_ddp(p for group in param_groups for p in group["params"])
        if ddp is not None:
            raise ddp_error(ddp)


def check_launcher_env() -> None:
    """Raise if a launcher (torchrun, Lightning, accelerate) started several processes but
    torch.distributed is not initialised: each would silently train alone at world size 1."""
    env_world = os.environ.get("WORLD_SIZE", "1")
    if env_world.strip() not in ("", "0", "1"):
        raise RuntimeError(
            f"DistributedFusedAdam: WORLD_SIZE={env_world} in the environment but torch.distributed "
            "is not initialised, so every process would train alone at world size 1. Call "
            "torch.distributed.init_process_group() before building the optimizer (or use a "
            "distributed strategy/launcher that does), or unset WORLD_SIZE for a single-process run."
        )


UNSCALE_TWICE = "unscale_grads() has already been called since the last step()"

NO_GRAD_AT_STEP = (
    "DistributedFusedAdam.step(): no parameter of this optimizer received a gradient on this rank since the "
    "last zero_grad(). Either backward() did not run, or the model's parameters were replaced "
    "(load_state_dict(assign=True), deepcopy, re-created modules) and the optimizer no longer sees them: build "
    "the optimizer over the model's current parameters."
)

READ_INSIDE_NO_SYNC = (
    "{what}: called inside opt.no_sync(): the grads accumulated there are this rank's own, not reduced over the "
    "ranks yet (the unsharded loop's param.grad would hold every rank's). Read them after the backward that "
    "reduces (the last micro-batch's, outside no_sync), or leave no_sync and call opt.grad_sync() on every rank "
    "first (it reduces what has accumulated so far)."
)

READ_UNREDUCED = (
    "{what}: this rank holds grads that are not reduced yet (overlap_grad_sync=False reduces at step, or a "
    "backward ran inside no_sync since the last reduction). Call opt.grad_sync() on every rank first (a "
    "collective), or read them after step's reduction."
)

NORM_NOT_KEPT = (
    "grad_norm(norm_type={norm_type}) after step(): that step computed the norm only for norm_type {computed}. "
    "Another norm type needs a collective over the grads, which are consumed: ask for it before step() (every "
    "rank)."
)

CLIP_BEFORE_UNSCALE = (
    "DistributedFusedAdam: opt.clip_grad_norm ran before unscaling, while the loss was scaled. Its max_norm is "
    "compared with the TRUE (unscaled) norm once the scale is known (docs/amp-loops.md, loop G): pass the plain, "
    "unscaled max_norm. torch.nn.utils.clip_grad_norm_ and shardamp.optim.clip_grad_norm_ there clip as torch "
    "does: their max_norm is compared with the scaled norm (torch's idiom passes max_norm * scaler.get_scale())."
)


def warn_backward_without_zero_grad() -> None:
    """A backward after ``step()`` without ``opt.zero_grad()`` (warned once per optimizer)."""
    warnings.warn(
        "DistributedFusedAdam: backward after step() without opt.zero_grad(): the new "
        "grads are ADDED to the grads that step left, as param.grad showed them (unscaled "
        "and clipped as the step applied them), as torch adds to param.grad when it is not "
        "zeroed. model.zero_grad() cannot clear them (they live in the optimizer's shards; "
        "param.grad only shows them): call opt.zero_grad() every step.",
        UserWarning,
        stacklevel=3,
    )
