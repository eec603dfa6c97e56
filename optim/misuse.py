"""Misuse that would otherwise train silently wrong, detected so it raises naming the fix: a model
wrapped in ``torch.nn.parallel.DistributedDataParallel``, and a launcher's ``WORLD_SIZE > 1``
without a process group.

DDP would all-reduce every grad a second time and write the result into ``param.grad`` (which
the optimizer never reads: it reduce-scatters the grads itself during backward). DDP leaves no
mark on the params, so the wrappers are found among the live objects; that scan runs only where
a process group exists (construction) or a misuse was already seen (a stray ``.grad`` at step).
"""
from __future__ import annotations

import gc
import os
from typing import Iterable, Optional

import torch


def find_ddp(params: Iterable[torch.nn.Parameter]) -> Optional[torch.nn.Module]:
    """The first live DistributedDataParallel whose module holds one of ``params``, else None."""
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    ids = {id(p) for p in params}
    for obj in gc.get_objects():
        # type(), not isinstance(): never runs a __class__ property of an arbitrary object
        if issubclass(type(obj), ddp_cls):
            module = getattr(obj, "module", None)
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
