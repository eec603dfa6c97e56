"""The training recipe shared by the sharded run and its unsharded torch.optim.AdamW reference,
so the two cannot drift apart: hyperparameters, the learning-rate schedule, autocast, loss scaling.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import ContextManager, Tuple

import torch

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Recipe:
    steps: int
    batch_size: int  # per rank
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float
    precision: str  # fp32 | bf16 | fp16
    init_scale: float
    growth_interval: int
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    def autocast(self, device: torch.device) -> ContextManager:
        """bf16/fp16 autocast for the forward; fp32 runs without autocast."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=_AMP_DTYPES[self.precision])

    @property
    def scaler_enabled(self) -> bool:
        """Loss scaling matters for fp16. bf16 has fp32's range and needs none. fp32 does not
        need it either, but the example keeps it on to exercise ShardedGradScaler: the scale is a
        power of two, so applying and removing it is exact and the reference still matches."""
        return self.precision in ("fp16", "fp32")

    def scaler_kwargs(self) -> dict:
        return dict(init_scale=self.init_scale, growth_interval=self.growth_interval, enabled=self.scaler_enabled)
