"""The models and data of benchmarks/bench_frameworks.py: each a :class:`Workload` (a seeded
model built on the device it trains on, and one epoch of its data as dict rows, the calling
convention the three frameworks share here: keyword tensors in, a dict with ``loss`` out).

* ``mlp``: the framework examples' MLP (examples/framework_common.py), 33.6M params, batch 64;
  ``mlp-wide``: the same at width 8192, 537M params, an iteration that is mostly its optimizer
  step;
* ``gpt2``: transformers' ``GPT2LMHeadModel`` from ``GPT2Config()`` (124M, random init, nothing
  downloaded), batch 8 x 512 tokens; ``gpt2-large``: GPT-2 large (774M: 36 layers of width 1280);
  ``-b2``: either at micro-batch 2.

``small=True``: tiny versions of each for CPU smoke runs.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # framework_common.py
import framework_common as common  # noqa: E402  (the examples' MLP and its loss)

# gpt2-b2: GPT-2 124M at micro-batch 2 (the step a larger share of a host-bound iteration);
# gpt2-large: GPT-2 large, 774M, at batch 8 (a GPU-bound iteration whose step moves 6x the bytes);
# gpt2-large-b2: the same at micro-batch 2 (the step about a fifth of the iteration, not a twentieth)
# mlp-wide: the MLP at width 8192 (537M params), an iteration that is mostly its optimizer step
MODELS = ("mlp", "mlp-wide", "gpt2", "gpt2-b2", "gpt2-large", "gpt2-large-b2")
DEFAULT_MODELS = ("mlp", "gpt2")


class MLP(common.Net):
    """The examples' MLP with the calling convention the three frameworks share here (the
    Trainer's): keyword tensors in, a dict with ``loss`` out."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:  # type: ignore[override]
        out = super().forward(x)
        return {"loss": common.loss_fn(out, labels), "logits": out}


class Samples(Dataset):
    """Rows of a few equally long tensors, as dicts (the default collate stacks them)."""

    def __init__(self, tensors: Dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}


@dataclass
class Workload:
    """A model (built seeded, on the device, before any optimizer) and one epoch of its data."""

    name: str
    batch: int
    make: Callable[[], torch.nn.Module]
    data: Callable[[int, torch.Generator], Dict[str, torch.Tensor]]

    def model(self, device: torch.device) -> torch.nn.Module:
        torch.manual_seed(0)
        with device:  # initialised where it trains: GPT-2's init on the CPU would take seconds per run
            return self.make()

    def params(self) -> int:
        return sum(p.numel() for p in self.model(torch.device("meta")).parameters())  # tied weights once

    def dataset(self, batches: int) -> Samples:
        return Samples(self.data(batches * self.batch, torch.Generator().manual_seed(1)))


def workload(name: str, small: bool) -> Workload:
    if name.startswith("mlp"):
        # mlp: the examples' CUDA default, 33.6M params; mlp-wide: the same at width 8192, 537M
        # params, whose optimizer step (about 20 GB of traffic) is most of a batch-64 iteration
        dim, depth, batch = (32, 2, 8) if small else (8192 if name == "mlp-wide" else 2048, 8, 64)

        def mlp_data(n: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
            x = torch.randn(n, 16, generator=g)
            return {"x": x, "labels": torch.tanh(x[:, :4] * 2) + 0.1 * torch.randn(n, 4, generator=g)}
        return Workload(name, batch, lambda: MLP(dim, depth), mlp_data)
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT-2 124M (or large, 774M) from its config (random init, nothing downloaded); no KV cache in training
    large = dict(n_embd=1280, n_layer=36, n_head=20) if name.startswith("gpt2-large") else {}
    cfg = (GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                      use_cache=False) if small else GPT2Config(use_cache=False, **large))
    seq, batch = (32, 4) if small else (512, 8)
    if name.endswith("-b2"):  # a fine-tuning micro-batch: the same step over a quarter of the tokens
        batch = 2

    def gpt2_data(n: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
        ids = torch.randint(cfg.vocab_size, (n, seq), generator=g)
        return {"input_ids": ids, "labels": ids}  # the model shifts the labels itself
    return Workload(name, batch, lambda: GPT2LMHeadModel(cfg), gpt2_data)
