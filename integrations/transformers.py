"""Hugging Face transformers: ``ShardampTrainer`` is a drop-in for ``transformers.Trainer``.

What changes (everything else is the Trainer's own code path):

* the optimizer is a ``DistributedFusedAdam`` built from ``TrainingArguments`` (``learning_rate``,
  ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay`` with the Trainer's decay/no-decay split),
  after the Trainer has put the model on its device;
* the Trainer's accelerator is a ``ShardampAccelerator``: no DDP around the model, ``max_grad_norm``
  clipped inside the optimizer's step kernel, ``no_sync`` for gradient accumulation, fp16 through
  ``ShardedGradScaler`` (see ``shardamp.integrations.accelerate``); the logged ``grad_norm`` is the
  true global (unscaled, pre-clip) norm;
* the optimizer's grads are zeroed after every optimizer step (the Trainer itself only calls
  ``model.zero_grad()``, which cannot reach the optimizer's shards);
* checkpoints: every rank takes part in the optimizer's collective ``state_dict`` and rank 0
  writes it (the Trainer calls it on rank 0 only), so ``save_steps`` + ``resume_from_checkpoint``
  continue exactly. The model's weights go through safetensors / ``save_pretrained`` unchanged.

Pass ``optimizers=(opt, scheduler)`` with a ``DistributedFusedAdam`` built over the model on its
final device to configure it yourself; any other optimizer trains as with ``Trainer``.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
from accelerate import Accelerator
from transformers import Trainer, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME  # the file names the Trainer resumes from

from shardamp.optim import DistributedFusedAdam

from .accelerate import ShardampAccelerator, _unwrap

__all__ = ["ShardampTrainer"]

_ADAMW = ("adamw_torch", "adamw_torch_fused")


class _ZeroShardedGrads(TrainerCallback):
    """After each optimizer step: ``opt.zero_grad()`` (the Trainer's ``model.zero_grad()`` would
    leave the grads in the optimizer's shards, to be added to the next step's)."""

    def __init__(self, trainer: "ShardampTrainer") -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = _unwrap(self.trainer.optimizer)
        if isinstance(opt, DistributedFusedAdam):
            opt.zero_grad()


class ShardampTrainer(Trainer):
    """``transformers.Trainer`` training a ``DistributedFusedAdam`` (see the module docstring);
    takes exactly Trainer's arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_callback(_ZeroShardedGrads(self))

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator setup, with the accelerator made a ``ShardampAccelerator``."""
        super().create_accelerator_and_postprocess()
        if type(self.accelerator) is Accelerator:
            # ShardampAccelerator adds behaviour only, no state: the Trainer's configured instance
            # keeps everything it was built with
            self.accelerator.__class__ = ShardampAccelerator

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        """A ``DistributedFusedAdam`` from ``TrainingArguments`` (``learning_rate``, ``adam_beta1/2``,
        ``adam_epsilon``, ``weight_decay`` with the Trainer's decay / no-decay split), built after the
        Trainer put the model on its device; an optimizer passed in ``optimizers=`` is kept.

        Raises:
            ValueError: ``TrainingArguments.optim`` is not ``adamw_torch`` or ``adamw_torch_fused``.
        """
        if self.optimizer is not None or getattr(self, "optimizer_cls_and_kwargs", None) is not None:
            return super().create_optimizer(*([model] if model is not None else []))
        args = self.args
        optim = str(getattr(args.optim, "value", args.optim))
        if optim not in _ADAMW:
            raise ValueError(
                f"ShardampTrainer: TrainingArguments.optim={optim!r}; ShardampTrainer trains "
                f"DistributedFusedAdam (AdamW), so optim must be one of {_ADAMW}. Pass "
                "optimizers=(opt, scheduler) to use another optimizer."
            )
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        self.optimizer = DistributedFusedAdam(
            [g for g in groups if g["params"]], lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
        )
        return self.optimizer

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = _unwrap(self.optimizer)
        if not isinstance(opt, DistributedFusedAdam):
            return super()._save_optimizer_and_scheduler(output_dir)
        state = opt.state_dict(rank0_only=True)  # a collective: every rank is here
        if self.args.should_save:
            torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's "save the optimizer too" note
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
