"""TRL + shardamp: ``class ShardampSFTTrainer(ShardampTrainerMixin, SFTTrainer)`` is the one change;
the optimizer (DistributedFusedAdam) is built from the SFTConfig.

    python examples/trl_sft.py                       # 2 CPU ranks, launched through torchrun
    torchrun --nproc-per-node 2 examples/trl_sft.py

Fine-tunes a tiny GPT-2 (built here, with a word-level tokenizer: nothing is downloaded) with the
plain SFTTrainer (DDP + torch AdamW) and with the sharded one on the same data, and checks they
end on the same params (rtol 1e-5, atol 1e-6). In fp32: SFTConfig defaults to bf16, under which
even torch's fused and foreach AdamW drift apart (see shardamp.integrations.transformers).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

import framework_common as common  # noqa: E402
from shardamp.integrations.transformers import ShardampTrainerMixin  # noqa: E402

WORDS = "the a cat dog sat on mat ran far and then slept ate fish bird flew high low red blue green".split()


class ShardampSFTTrainer(ShardampTrainerMixin, SFTTrainer):
    """SFTTrainer whose optimizer state is sharded over the ranks (ZeRO-2)."""


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def train(cls, out: str):
    import datasets
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # a second trainer configuration in this process
    GradientState._reset_state()
    tok = tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    r = random.Random(0)
    data = datasets.Dataset.from_dict({"text": [" ".join(r.choice(WORDS) for _ in range(r.randint(3, 12)))
                                                for _ in range(256)]})
    args = SFTConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=8,
                     learning_rate=2e-4, weight_decay=0.1, max_grad_norm=0.5, logging_steps=4, save_strategy="no",
                     report_to=[], use_cpu=True, bf16=False, ddp_backend="gloo", seed=0, disable_tqdm=True,
                     max_length=32)
    trainer = cls(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return type(opt).__name__, [p.detach().clone() for p in model.parameters()]


def main() -> None:
    if "LOCAL_RANK" not in os.environ:  # start 2 CPU ranks
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *sys.argv]
        sys.exit(subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))))
    out = tempfile.mkdtemp()
    plain_opt, plain = train(SFTTrainer, os.path.join(out, "plain"))
    ours_opt, ours = train(ShardampSFTTrainer, os.path.join(out, "shardamp"))
    worst = max(((a - b).abs() / (1e-6 + 1e-5 * b.abs())).max().item() for a, b in zip(ours, plain))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{ours_opt} vs {plain_opt} (world {os.environ.get('WORLD_SIZE')}): worst param "
              f"{worst:.3f} of the tolerance (rtol 1e-5, atol 1e-6): {'PASS' if worst <= 1 else 'FAIL'}", flush=True)
    common.shut_down()
    sys.exit(0 if worst <= 1 else 1)


if __name__ == "__main__":
    main()
