"""ShardampTrainer / ShardampTrainerMixin cases, run on 2 gloo ranks in one spawned group (see
test_transformers.py).

The ranks come from tests/dist_helper.py with the process group initialised and torchrun's
environment variables set; the Trainer's accelerator state picks up the existing group. The TRL
case builds its tiny GPT-2 and word-level tokenizer in memory: nothing is downloaded.
"""
from __future__ import annotations

import os
import random
import warnings
from typing import Any, Dict, List, Optional

import torch

import framework_ref as ref

# set before transformers / huggingface_hub are imported, here and in the spawned ranks
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

N_STEPS, BATCH = 4, 4


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x, self.y = ref.dataset(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def _env(rank: int, world: int) -> None:
    from accelerate.state import AcceleratorState, GradientState

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state(True)  # one Trainer configuration per run in this process
    GradientState._reset_state()


def _train(rank: int, world: int, out: str, bf16: bool = False, accumulate: int = 1, max_steps: int = N_STEPS,
           save_steps: Optional[int] = None, resume: Optional[str] = None, max_grad_norm: float = ref.MAX_NORM,
           schedule: str = "constant", fp16: bool = False, poison_step: Optional[int] = None) -> Dict[str, Any]:
    from transformers import TrainerCallback, TrainingArguments

    from shardamp.integrations.transformers import ShardampTrainer

    _env(rank, world)

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
        "ddp_handler": type(trainer.accelerator.ddp_handler).__name__,  # the Trainer's own, accepted
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


def _targs(out: str, **kw: Any):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, report_to=[], use_cpu=True, ddp_backend="gloo", disable_tqdm=True,
                             weight_decay=ref.WD, **kw)


def case_param_names_when_the_optimizer_accepts_them(rank, world, tmp: str = "", **kw):
    """The groups create_optimizer builds: with names for DistributedFusedAdam (it declares
    ``accepts_param_names``), without for a subclass that declares it does not."""
    from shardamp.integrations.transformers import ShardampTrainer
    from shardamp.optim import DistributedFusedAdam

    class Unnamed(DistributedFusedAdam):
        accepts_param_names = False

    class UnnamedTrainer(ShardampTrainer):
        shardamp_optimizer_class = Unnamed
        shardamp_optimizer_kwargs = {"bucket_cap_mb": 0.0004}

    out = {}
    for label, cls in (("named", ShardampTrainer), ("plain", UnnamedTrainer)):
        _env(rank, world)
        trainer = cls(model=ref.make_model(), args=_targs(os.path.join(tmp, f"hf_names_{label}")))
        opt = trainer.create_optimizer()
        out[label] = {"type": type(opt).__name__, "buckets": len(opt._buckets),
                      "groups": [(g.get("param_names"), g["weight_decay"], len(g["params"])) for g in opt.param_groups],
                      "state_names": [g.get("param_names") for g in opt.state_dict()["param_groups"]]}
    return out


def case_low_bit_optim_names(rank, world, tmp: str = "", **kw):
    """TrainingArguments.optim names of low-bit AdamWs build DistributedFusedAdam with the moment
    formats (shardamp_optimizer_kwargs over them); another low-bit optimizer raises naming the
    kwargs. Returns, per optim, the moments' formats of the optimizer built (or the error), and
    one step's state-dict codes of the 4-bit one."""
    from shardamp.integrations.transformers import ShardampTrainer

    class Bf16Sq(ShardampTrainer):
        shardamp_optimizer_kwargs = {"exp_avg_sq_dtype": torch.bfloat16}

    out: Dict[str, Any] = {}
    for label, cls, optim in (("adamw_torch_8bit", ShardampTrainer, "adamw_torch_8bit"),
                              ("adamw_torch_4bit", ShardampTrainer, "adamw_torch_4bit"),
                              ("adamw_8bit", ShardampTrainer, "adamw_8bit"),
                              ("adamw_bnb_8bit", ShardampTrainer, "adamw_bnb_8bit"),
                              ("adamw_torch", ShardampTrainer, "adamw_torch"),
                              ("8bit_kwargs_win", Bf16Sq, "adamw_torch_8bit"),
                              ("paged_adamw_8bit", ShardampTrainer, "paged_adamw_8bit"),
                              ("lion_32bit", ShardampTrainer, "lion_32bit"),
                              ("with_optim_args", ShardampTrainer, "adamw_torch_4bit")):
        _env(rank, world)
        extra = {"optim_args": "block_size=64"} if label == "with_optim_args" else {}
        trainer = cls(model=ref.make_model(), args=_targs(os.path.join(tmp, f"hf_optim_{label}"), optim=optim, **extra))
        try:
            opt = trainer.create_optimizer()
        except ValueError as exc:
            out[label] = str(exc)
            continue
        out[label] = (opt.exp_avg_dtype, opt.exp_avg_sq_dtype)
        if label == "adamw_torch_4bit":
            model = trainer.model
            model(torch.randn(BATCH, ref.DIM)).sum().backward()
            opt.step()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the low-bit state dict's note for torch
                sd = opt.state_dict()
            out["4bit_codes"] = {i: (e["exp_avg"].dtype, e["exp_avg_scales"].dtype) for i, e in sd["state"].items()}
        del opt, trainer  # one live optimizer over the group at a time
    return out


# ---------------------------------------------------------------- TRL's SFTTrainer
SFT_STEPS, SFT_LR, SFT_MAX_NORM = 6, 2e-4, 0.5  # the grads' norm is about 1-2: clipped every step
# lr 2e-4 keeps torch's own fused-vs-foreach spread far inside rtol 1e-5 / atol 1e-6: the attention key bias
# has an exactly-zero true grad (softmax ignores it), so its Adam update is rounding noise scaled to ~lr
_WORDS = "the a cat dog sat on mat ran far and then slept ate fish bird flew high low red blue green".split()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>"] + _WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _gpt2(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no RNG in the comparison
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return GPT2LMHeadModel(config)  # tied input / output embeddings, as GPT-2's


def _sentences(n: int):
    import datasets

    r = random.Random(0)
    return datasets.Dataset.from_dict(
        {"text": [" ".join(r.choice(_WORDS) for _ in range(r.randint(3, 12))) for _ in range(n)]})


def _sft(rank: int, world: int, out: str, sharded: bool) -> Dict[str, Any]:
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from shardamp.integrations.transformers import ShardampTrainerMixin

    _env(rank, world)
    logged: List[Dict[str, float]] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                logged.append(dict(logs))

    class ShardampSFTTrainer(ShardampTrainerMixin, SFTTrainer):
        pass

    tok = _tokenizer()
    model = _gpt2(tok)
    initial = [p.detach().clone() for p in model.parameters()]
    args = SFTConfig(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=SFT_STEPS,
        learning_rate=SFT_LR,
        weight_decay=0.1, max_grad_norm=SFT_MAX_NORM, lr_scheduler_type="linear", logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, seed=0,
        disable_tqdm=True, max_length=32,
        bf16=False,  # SFTConfig's default is True, under which torch's own AdamWs drift apart (see the mixin)
        # gradient_checkpointing: SFTConfig's default, True
    )
    cls = ShardampSFTTrainer if sharded else SFTTrainer
    trainer = cls(model=model, args=args, train_dataset=_sentences(16 * world * SFT_STEPS),
                  processing_class=tok, callbacks=[Logs()])
    trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return {
        "params": [p.detach().clone() for p in model.parameters()], "initial": initial,
        "losses": [entry["loss"] for entry in logged], "grad_norms": [entry["grad_norm"] for entry in logged],
        "opt": type(opt).__name__, "wrapped": type(trainer.model_wrapped).__name__,
        "checkpointing": model.is_gradient_checkpointing,
        "groups": [(g["weight_decay"], len(g["params"])) for g in opt.param_groups],
    }


def case_trl_sft_trainer_with_the_mixin(rank, world, tmp: str = "", **kw):
    try:
        import trl  # noqa: F401
    except ImportError:
        return None
    return {"plain": _sft(rank, world, os.path.join(tmp, "sft_plain"), sharded=False),
            "shardamp": _sft(rank, world, os.path.join(tmp, "sft_shardamp"), sharded=True)}


CASES = [name for name in dir() if name.startswith("case_")]
