"""Hugging Face transformers: ``ShardampTrainerMixin`` makes any ``transformers.Trainer`` subclass
train a ``DistributedFusedAdam`` (``class MySFT(ShardampTrainerMixin, trl.SFTTrainer)``);
``ShardampTrainer`` is ``ShardampTrainerMixin`` over ``Trainer`` itself, a drop-in for it.

What changes (everything else is the Trainer's own code path, or the subclass's):

* the optimizer is a ``DistributedFusedAdam`` built from ``TrainingArguments`` (``learning_rate``,
  ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay`` with the trainer's own
  ``get_decay_parameter_names`` split, as ``Trainer.create_optimizer`` builds it), after the
  Trainer has put the model on its device; the params' names go with them where the optimizer
  class accepts names (see ``ShardampTrainerMixin``);
* the Trainer's accelerator is a ``ShardampAccelerator``: no DDP around the model, ``max_grad_norm``
  clipped inside the optimizer's step kernel, ``no_sync`` for gradient accumulation, fp16 through
  ``ShardedGradScaler`` (see ``shardamp.integrations.accelerate``); the logged ``grad_norm`` is the
  true global (unscaled, pre-clip) norm. The DDP kwargs handler the Trainer builds from
  ``TrainingArguments.ddp_*`` is accepted and has no effect (there is no DDP wrapper);
* the optimizer's grads are zeroed after every optimizer step (the Trainer itself only calls
  ``model.zero_grad()``, which cannot reach the optimizer's shards);
* checkpoints: every rank takes part in the optimizer's collective ``state_dict`` and rank 0
  writes it (the Trainer calls it on rank 0 only), so ``save_steps`` + ``resume_from_checkpoint``
  continue exactly. The model's weights go through safetensors / ``save_pretrained`` unchanged.

Pass ``optimizers=(opt, scheduler)`` with a ``DistributedFusedAdam`` built over the model on its
final device to configure it yourself; any other optimizer trains as with ``Trainer``.

TRL's ``SFTTrainer`` (and the other TRL trainers: none overrides ``create_optimizer``) composes as
``class ShardampSFTTrainer(ShardampTrainerMixin, SFTTrainer)`` and trains as the plain
``SFTTrainer`` does, within the tolerance ``ShardampTrainer`` keeps to ``Trainer``. SFTTrainer
changes nothing the optimizer sees: it keeps Trainer's ``create_optimizer``,
``get_decay_parameter_names`` and ``_clip_grad_norm``, and its loss (summed over tokens, divided
by the global ``num_items_in_batch``, times the world size) is what DDP's grad average and
DistributedFusedAdam's both expect. What it changes is a default: ``SFTConfig`` sets
``bf16=True``, on the CPU too. Under bf16 autocast, two runs whose fp32 params differ by one ulp
(any two AdamW implementations do after one step: torch's fused and foreach AdamW too) drift apart
as soon as one such weight rounds to the other bf16 neighbour in a forward: one bf16 ulp on a
single weight moves that step's grads by up to ~0.7% (the same in SFTTrainer's fused-LM-head loss as in
the Trainer's), and Adam carries it on. Whether that happens within a few steps is chance, not
weight decay or clipping: on a tiny GPT-2 at lr 1e-3 (2 ranks, 6 steps, weight decay 0 / 0.1 x
clipping off / on), torch's own fused and foreach AdamW SFTTrainer runs ended 4e-5 to 2.5e-3 apart
in three of the four settings, and the sharded run as far from the fused one in all four; in fp32
every pair stayed within torch's own spread. Compare in fp32 (``bf16=False``) to check parity.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, ClassVar, Dict, List, Optional

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME  # the file names the Trainer resumes from

from shardamp.optim import DistributedFusedAdam

from . import _step_logging as step_logging
from .accelerate import ShardampAccelerator, _unwrap

__all__ = ["ShardampTrainerMixin", "ShardampTrainer"]

_ADAMW = ("adamw_torch", "adamw_torch_fused")
# TrainingArguments.optim names of an AdamW with low-bit moments (torchao's AdamW8bit / AdamW4bit,
# bitsandbytes' blockwise 8-bit AdamW): the same AdamW with both moments in shardamp's format
_LOW_BIT = {"adamw_torch_8bit": "8bit", "adamw_8bit": "8bit", "adamw_bnb_8bit": "8bit", "adamw_torch_4bit": "4bit"}


def _moment_kwargs(optim: str, optim_args: Optional[str], owner: str) -> Dict[str, Any]:
    """The optimizer kwargs ``TrainingArguments.optim`` selects: ``{}`` for a plain AdamW, both
    moments' format for a low-bit AdamW (``_LOW_BIT``).

    Raises:
        ValueError: any other ``optim``, naming the accepted values and, for a low-bit optimizer
            it does not map (paged, GaLore, Lion, ...), the kwargs that select the formats; a
            low-bit ``optim`` with ``optim_args`` (their options, e.g. a block size, are not
            shardamp's: they would be ignored).
    """
    if optim in _ADAMW:
        return {}
    if optim in _LOW_BIT:
        if optim_args:
            raise ValueError(
                f"{owner}: TrainingArguments.optim={optim!r} with optim_args={optim_args!r}: those options are "
                "the peer optimizer's and DistributedFusedAdam does not read them. Drop optim_args and set "
                "shardamp_optimizer_kwargs on your trainer subclass instead, e.g. {'exp_avg_dtype': "
                f"'{_LOW_BIT[optim]}', 'exp_avg_sq_dtype': '{_LOW_BIT[optim]}', 'quant_block_size': 128}}.")
        return {"exp_avg_dtype": _LOW_BIT[optim], "exp_avg_sq_dtype": _LOW_BIT[optim]}
    hint = ""
    for bits in ("8bit", "4bit"):
        if bits in optim:
            hint = (f" For {bits} Adam moments use optim='adamw_torch' with shardamp_optimizer_kwargs="
                    f"{{'exp_avg_dtype': '{bits}', 'exp_avg_sq_dtype': '{bits}'}} (a class attribute of your "
                    "trainer subclass).")
    raise ValueError(
        f"{owner}: TrainingArguments.optim={optim!r}; ShardampTrainerMixin trains DistributedFusedAdam (AdamW), "
        f"so optim must be one of {_ADAMW + tuple(_LOW_BIT)} (the low-bit ones select the moment formats "
        f"{sorted(set(_LOW_BIT.values()))}).{hint} Pass optimizers=(opt, scheduler) to use another optimizer."
    )


def _accepts_param_names(optimizer_class: type) -> bool:
    """Whether ``optimizer_class`` declares that it takes named params: param groups with a
    ``"param_names"`` list beside ``"params"``, as torch 2.5+ optimizers take them.

    Args:
        optimizer_class: the optimizer class ``ShardampTrainerMixin`` builds.

    Returns:
        ``True`` iff the class attribute ``accepts_param_names`` is ``True``. An explicit flag,
        not a trial construction: construction is collective, and torch's ``Optimizer`` base
        class already stores ``param_names`` for any subclass, so a construction that does not
        raise says nothing about whether the class's own state-dict and checkpoint code keep them.
    """
    return getattr(optimizer_class, "accepts_param_names", False) is True


class _ZeroShardedGrads(TrainerCallback):
    """After each optimizer step: ``opt.zero_grad()`` (the Trainer's ``model.zero_grad()`` would
    leave the grads in the optimizer's shards, to be added to the next step's)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = _unwrap(self.trainer.optimizer)
        if isinstance(opt, DistributedFusedAdam):
            opt.zero_grad()


class ShardampTrainerMixin:
    """Makes a ``transformers.Trainer`` subclass train a ``DistributedFusedAdam`` (see the module
    docstring). List it BEFORE the trainer class, so that its methods come first::

        class ShardampSFTTrainer(ShardampTrainerMixin, trl.SFTTrainer):
            pass

    It overrides ``create_accelerator_and_postprocess``, ``create_optimizer`` and
    ``_save_optimizer_and_scheduler``, each calling the trainer's own for anything but a
    ``DistributedFusedAdam``; its ``__init__`` adds one callback and takes exactly the trainer's
    arguments.

    The optimizer gets the params' names (groups with ``"param_names"``, as torch 2.5+ optimizers
    take them) iff ``shardamp_optimizer_class.accepts_param_names is True``, as
    ``DistributedFusedAdam`` declares (a subclass whose state code drops names sets it False).

    Attributes:
        shardamp_optimizer_class: the optimizer class ``create_optimizer`` builds (a
            ``DistributedFusedAdam`` subclass; default ``DistributedFusedAdam``).
        shardamp_optimizer_kwargs: extra keyword arguments for it (e.g. ``bucket_cap_mb``),
            merged over those taken from ``TrainingArguments``.

    Raises:
        TypeError: at class definition, when a ``transformers.Trainer`` comes before the mixin in
            the class's MRO (``class X(SFTTrainer, ShardampTrainerMixin)``): the trainer's methods
            would silently win; or ``shardamp_optimizer_class`` is no ``DistributedFusedAdam``.
            At construction, when the trainer's accelerator is an ``Accelerator`` subclass other
            than ``ShardampAccelerator``.
    """

    shardamp_optimizer_class: ClassVar[type] = DistributedFusedAdam
    shardamp_optimizer_kwargs: ClassVar[Dict[str, Any]] = {}  # never mutated: replace it in a subclass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if Trainer in mro and mro.index(Trainer) < mro.index(ShardampTrainerMixin):
            bases = ", ".join(b.__name__ for b in cls.__bases__)
            raise TypeError(
                f"class {cls.__name__}({bases}): ShardampTrainerMixin comes after transformers.Trainer in the MRO, "
                "so the Trainer's create_optimizer and accelerator would silently win. List the mixin first: "
                f"class {cls.__name__}(ShardampTrainerMixin, <your Trainer subclass>)."
            )
        if not (isinstance(cls.shardamp_optimizer_class, type)
                and issubclass(cls.shardamp_optimizer_class, DistributedFusedAdam)):
            raise TypeError(
                f"{cls.__name__}.shardamp_optimizer_class={cls.shardamp_optimizer_class!r}: it must be "
                "DistributedFusedAdam or a subclass; pass any other optimizer as optimizers=(opt, scheduler)."
            )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_callback(_ZeroShardedGrads(self))

    def create_accelerator_and_postprocess(self) -> None:
        """The trainer's own, then its ``Accelerator`` becomes a ``ShardampAccelerator``.

        ShardampAccelerator adds behaviour only, no state: the Trainer's configured instance keeps
        everything it was built with. The DDP kwargs handler the Trainer always passes (from
        ``TrainingArguments.ddp_*``) is declared internal: a ``DistributedFusedAdam``'s model is
        never DDP-wrapped, and the user did not pass it.
        """
        super().create_accelerator_and_postprocess()
        ShardampAccelerator.adopt(self.accelerator, owner=f"{type(self).__name__} (ShardampTrainerMixin)")

    def shardamp_param_groups(self, model: torch.nn.Module) -> List[Dict[str, Any]]:
        """The param groups ``create_optimizer`` builds: ``Trainer.create_optimizer``'s split
        (the trainable params named by ``self.get_decay_parameter_names(model)`` with
        ``args.weight_decay``, the others with 0.0; empty groups left out), each with a
        ``"param_names"`` list of the ``model.named_parameters()`` names beside ``"params"``.

        Args:
            model: the model being trained.

        Returns:
            The groups, in ``named_parameters`` order within each.
        """
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = []
        for in_decay, weight_decay in ((True, self.args.weight_decay), (False, 0.0)):
            members = [(n, p) for n, p in named if (n in decay) == in_decay]
            if members:
                groups.append({"params": [p for _, p in members], "param_names": [n for n, _ in members],
                               "weight_decay": weight_decay})
        return groups

    def log(self, logs: Dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``; a training log (one holding ``loss``) also gets the
        DistributedFusedAdam's ``grad_norm`` (where the Trainer did not log its clip's),
        ``loss_scale`` and ``skipped_steps`` into the log history and the reporting callbacks
        (one host read per logged step).

        Args:
            logs: as ``transformers.Trainer.log``.
            *args: as ``transformers.Trainer.log``.
            **kwargs: as ``transformers.Trainer.log``.
        """
        if "loss" in logs and getattr(self, "optimizer", None) is not None:
            extra = step_logging.step_values([self.optimizer])
            logs = {**logs, **{k: v for k, v in extra.items() if k not in logs}}
        return super().log(logs, *args, **kwargs)

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        """Builds ``shardamp_optimizer_class`` from ``TrainingArguments`` (see
        ``shardamp_param_groups``), passing the params' names iff the class declares
        ``accepts_param_names = True``.

        Args:
            model: the model to optimize; ``self.model`` by default.

        Returns:
            The optimizer (also ``self.optimizer``). An optimizer passed as
            ``optimizers=(opt, ...)`` or an ``optimizer_cls_and_kwargs`` goes to the trainer's own
            ``create_optimizer`` instead.

        ``TrainingArguments.optim`` ``"adamw_torch"`` / ``"adamw_torch_fused"`` build it with the
        default moments; ``"adamw_torch_8bit"``, ``"adamw_8bit"``, ``"adamw_bnb_8bit"`` with
        ``exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"`` and ``"adamw_torch_4bit"`` with both
        ``"4bit"`` (torchao's and bitsandbytes' low-bit AdamW; the formats are shardamp's own,
        docs/low-bit-states.md). ``shardamp_optimizer_kwargs`` is merged over these.

        Raises:
            ValueError: ``TrainingArguments.optim`` is none of those (for another low-bit
                optimizer, the message names the kwargs that select the formats), or a low-bit
                one comes with ``optim_args`` (not read: the message names the kwargs to use).
        """
        if self.optimizer is not None or getattr(self, "optimizer_cls_and_kwargs", None) is not None:
            return super().create_optimizer(*([model] if model is not None else []))
        args = self.args
        moments = _moment_kwargs(str(getattr(args.optim, "value", args.optim)), getattr(args, "optim_args", None),
                                 type(self).__name__)
        groups = self.shardamp_param_groups(self.model if model is None else model)
        cls = self.shardamp_optimizer_class
        if not _accepts_param_names(cls):
            groups = [{k: v for k, v in g.items() if k != "param_names"} for g in groups]
        kwargs = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                      **moments)
        self.optimizer = cls(groups, **{**kwargs, **self.shardamp_optimizer_kwargs})
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


class ShardampTrainer(ShardampTrainerMixin, Trainer):
    """``transformers.Trainer`` training a ``DistributedFusedAdam`` (see the module docstring and
    ``ShardampTrainerMixin``); takes exactly Trainer's arguments."""
