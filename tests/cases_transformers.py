"""ShardampTrainer cases, run on 2 gloo ranks in one spawned group (see test_transformers.py).

The ranks come from tests/dist_helper.py with the process group initialised and torchrun's
environment variables set; the Trainer's accelerator state picks up the existing group.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch

import framework_ref as ref

N_STEPS, BATCH = 4, 4


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x, self.y = ref.dataset(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def _train(rank: int, world: int, out: str, bf16: bool = False, accumulate: int = 1, max_steps: int = N_STEPS,
           save_steps: Optional[int] = None, resume: Optional[str] = None, max_grad_norm: float = ref.MAX_NORM,
           schedule: str = "constant", fp16: bool = False, poison_step: Optional[int] = None) -> Dict[str, Any]:
    from accelerate.state import AcceleratorState, GradientState
    from transformers import TrainerCallback, TrainingArguments

    from shardamp.integrations.transformers import ShardampTrainer

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    seen: List = []

    class Net(ref.TinyNet):
        def forward(self, x, labels=None):
            if self.training and len(seen) == poison_step and rank == 0:
                x = x.clone()
                x[0, 0] = 1e6  # inf in fp16: an overflow on this rank only
            seen.append((x.detach().clone(), labels.detach().clone()))
            out = super().forward(x)
            return {"loss": ref.loss_fn(out, labels), "logits": out}

    logged: List[Dict[str, float]] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                logged.append(dict(logs))

    torch.manual_seed(0)
    model = Net()
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=accumulate,
        max_steps=max_steps, learning_rate=ref.LR, adam_beta1=ref.BETAS[0], adam_beta2=ref.BETAS[1],
        adam_epsilon=ref.EPS, weight_decay=ref.WD, lr_scheduler_type=schedule, max_grad_norm=max_grad_norm,
        logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to=[], use_cpu=True, bf16=bf16, fp16=fp16, dataloader_num_workers=0, seed=0, data_seed=0,
        disable_tqdm=True, ddp_backend="gloo",
    )
    class Trainer(ShardampTrainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if fp16:  # accelerate applies no fp16 on the CPU: switch on its GPU path (autocast + GradScaler)
                self.accelerator.native_amp, self.accelerator.scaler = True, torch.amp.GradScaler("cpu")

    trainer = Trainer(model=model, args=args, train_dataset=_Data(2 * N_STEPS * world * BATCH * accumulate),
                      callbacks=[Logs()])
    trainer.train(resume_from_checkpoint=resume)
    opt = trainer.optimizer.optimizer
    scaler = trainer.accelerator.scaler
    return {
        "scaler": type(scaler).__name__ if scaler is not None else None,
        "params": [p.detach().clone() for p in model.parameters()],
        "seen": seen, "grad_norms": [entry["grad_norm"] for entry in logged],
        "opt": type(opt).__name__, "wrapped": type(trainer.model_wrapped).__name__,
        "world": opt.world_size, "buckets": len(opt._buckets),
        "ckpts": sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) if os.path.isdir(out) else [],
    }


def case_fp32_max_grad_norm(rank, world, tmp: str = "", **kw):
    return _train(rank, world, os.path.join(tmp, "hf_fp32"))


def case_bf16_max_grad_norm(rank, world, tmp: str = "", **kw):
    return _train(rank, world, os.path.join(tmp, "hf_bf16"), bf16=True)


def case_fp16_max_grad_norm(rank, world, tmp: str = "", **kw):
    return _train(rank, world, os.path.join(tmp, "hf_fp16"), fp16=True, poison_step=1)


def case_linear_schedule(rank, world, tmp: str = "", **kw):
    return _train(rank, world, os.path.join(tmp, "hf_linear"), schedule="linear")


def case_accumulate_no_sync(rank, world, tmp: str = "", **kw):
    return ref.count_reduce_scatters(lambda: _train(rank, world, os.path.join(tmp, "hf_accum"), accumulate=3))


def case_save_steps_resume(rank, world, tmp: str = "", **kw):
    out = os.path.join(tmp, "hf_ckpt")
    full = _train(rank, world, out, save_steps=2)
    resumed = _train(rank, world, os.path.join(tmp, "hf_ckpt_resumed"),
                     resume=os.path.join(out, "checkpoint-2"))
    return {"full": full, "resumed": resumed}


CASES = [name for name in dir() if name.startswith("case_")]
