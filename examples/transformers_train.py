"""Hugging Face transformers + shardamp: ``ShardampTrainer`` instead of ``Trainer`` is the one
changed line; the optimizer (DistributedFusedAdam) is built from the TrainingArguments.

    python examples/transformers_train.py                    # 2 CPU ranks, launched through torchrun
    torchrun --nproc-per-node 2 examples/transformers_train.py
    python examples/transformers_train.py --device cuda --precision fp16   # GPUs (NCCL)

Trains with max_grad_norm and gradient_accumulation_steps, saves one checkpoint (the Trainer's
_save_checkpoint, as save_steps does) and resumes from it, checking the resumed run ends on the
same params, checks the result and the logged
grad_norm against unsharded torch.optim.AdamW, and times the same run with ``Trainer`` (DDP +
optim="adamw_torch_fused" on CUDA). See framework_common.py. A Trainer subclass (TRL's SFTTrainer, ...)
takes ``ShardampTrainerMixin`` instead: see trl_sft.py.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import framework_common as common
from shardamp.integrations.transformers import ShardampTrainer


class Indexed(torch.utils.data.Dataset):
    def __init__(self, args) -> None:
        self.x, self.y = common.data(args)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i), "x": self.x[i], "labels": self.y[i]}


class Model(common.Net):
    """The MLP with the Trainer's calling convention; records which samples it trained on."""

    def __init__(self, args) -> None:
        torch.manual_seed(0)
        super().__init__(args.dim, args.depth)
        self.seen: List[torch.Tensor] = []

    def forward(self, x, labels=None, idx=None):
        if self.training and idx is not None:
            self.seen.append(idx)
        out = super().forward(x)
        return {"loss": common.loss_fn(out, labels), "logits": out}


class Record(TrainerCallback):
    """Times the steps, keeps the early snapshots and the logged grad_norm, and asks for one
    checkpoint (at ``save_step``, before the timed steps: the Trainer saves after on_step_end)."""

    def __init__(self, args, model) -> None:
        self.args, self.model, self.timer, self.norms = args, model, common.StepTimer(args), []
        self.snapshots = common.Snapshots()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.timer.step_done(state.global_step)
        self.snapshots.step_done(state.global_step, self.model.parameters())
        if state.global_step == save_step(self.args):
            control.should_save = True

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "grad_norm" in logs:
            self.norms.append(float(logs["grad_norm"]))


def save_step(args) -> int:
    return max(1, args.warmup - 1)


def train(args, shardamp: bool, resume: Optional[str] = None) -> Dict[str, Any]:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # a second Trainer configuration in this process
    GradientState._reset_state()
    out = os.path.join(args.out, "shardamp" if shardamp else "default") + ("-resumed" if resume else "")
    cuda = args.device == "cuda"
    targs = TrainingArguments(
        output_dir=out, per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulate,
        max_steps=args.steps, learning_rate=common.LR, adam_beta1=common.BETAS[0], adam_beta2=common.BETAS[1],
        adam_epsilon=common.EPS, weight_decay=common.WD, lr_scheduler_type="constant",
        max_grad_norm=args.max_grad_norm, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=not cuda, bf16=args.precision == "bf16",
        fp16=args.precision == "fp16", optim="adamw_torch_fused" if cuda else "adamw_torch",
        dataloader_num_workers=0, seed=0, disable_tqdm=True, ddp_backend=None if cuda else "gloo",
    )
    model = Model(args)
    record = Record(args, model)
    cls = ShardampTrainer if shardamp else Trainer
    trainer = cls(model=model, args=targs, train_dataset=Indexed(args), callbacks=[record])
    trainer.train(resume_from_checkpoint=resume)
    return {"params": list(model.parameters()), "seen": model.seen, "norms": record.norms, "ms": record.timer.ms,
            "snapshots": record.snapshots.params,
            "ckpt": os.path.join(out, f"checkpoint-{save_step(args)}")}


def main() -> None:
    args = common.start(__doc__.splitlines()[0], torchrun=True)
    ours = train(args, shardamp=True)
    ok = common.report_parity(args, "transformers ShardampTrainer", ours["params"], ours["seen"], ours["norms"],
                              ours["snapshots"])
    resumed = train(args, shardamp=True, resume=ours["ckpt"])
    same = all(torch.equal(a, b) for a, b in zip(ours["params"], resumed["params"]))
    if common.rank() == 0:
        print(f"checkpoint at step {save_step(args)} + resume_from_checkpoint ends on the same params: "
              f"{'PASS' if same else 'FAIL'}", flush=True)
    common.finish(args, "transformers", ours["ms"], lambda: train(args, shardamp=False)["ms"], ok and same)


if __name__ == "__main__":
    main()
