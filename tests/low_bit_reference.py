"""The unsharded reference for blockwise moments ("8bit" / "4bit"): torch.optim.AdamW's place in
the comparisons of tests/test_low_bit.py, the AMP loops (tests/amp_loops.py), the parity cases
(tests/parity.py's ``train``) and the mesh checkpoints when the sharded optimizer stores its
moments as codes and block scales. Its buckets are the sharded optimizer's (the same params,
dtype, bucket cap and block grid), so the blocks hold the same elements and the quantized math
agrees with the sharded step to fp32 round-off of the grads' reduction order."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from shardamp.optim import state_formats as sf
from shardamp.optim.kernels import quant, reference
from shardamp.optim.layout import ALIGN, build_layout, grouped_params
from shardamp.optim.shards.buffers import param_view


class ReferenceLowBitAdamW(torch.optim.Optimizer):
    """The unsharded reference: the params laid out in buckets as the optimizer lays them at
    world 1, each bucket's step ``reference.adam_step`` over blockwise moments; torch's
    GradScaler and clip_grad_norm_ around it."""

    def __init__(self, groups, exp_avg_dtype: Any, exp_avg_sq_dtype: Any, bucket_cap_mb: float,
                 quant_block_size: Any = None, layout_dtype: Optional[torch.dtype] = None, **defaults: Any):
        super().__init__(groups, dict(dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), **defaults))
        formats = sf.resolve_moments(torch.float32, exp_avg_dtype, exp_avg_sq_dtype, quant_block_size)
        indexed = grouped_params(self.param_groups)
        self.params = [p for p, _ in indexed]
        # the buckets of the sharded optimizer's params: of their dtype (the bucket cap counts bytes)
        typed = [(p if layout_dtype is None else torch.empty_strided(p.shape, p.stride(), dtype=layout_dtype), g)
                 for p, g in indexed]
        self.buckets = build_layout(typed, bucket_cap_mb, 1, 0, formats.grid(ALIGN))
        self.state_of = []
        for b in self.buckets:
            master = torch.zeros(b.numel)
            for s in b.slots:
                param_view(master, s).copy_(self.params[s.index].detach())
            self.state_of.append((master, *(quant.QuantizedShard.zeros(f, m.signed, b.numel, 0, master.device)
                                            if f.blockwise else torch.zeros(b.numel, dtype=f.storage_dtype)
                                            for m, f in formats.items())))
        self.steps = torch.zeros(len(self.params))

    @torch.no_grad()
    def step(self, closure=None):
        touched = torch.tensor([float(p.grad is not None) for p in self.params])
        self.steps += touched
        hp = torch.tensor([[g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"]]
                           for g in self.param_groups], dtype=torch.float64)
        for b, (master, m, v) in zip(self.buckets, self.state_of):
            grad = torch.zeros(b.numel)
            for s in b.slots:
                if self.params[s.index].grad is not None:
                    param_view(grad, s).copy_(self.params[s.index].grad)
            reference.adam_step(grad, master, m, v, None, b.segments.table, hp, self.steps, touched,
                                torch.tensor(1.0), torch.tensor(0.0), True, True)
            for s in b.slots:
                self.params[s.index].copy_(param_view(master, s))


def blockwise(opt_kwargs: Dict[str, Any]) -> bool:
    """The optimizer options ask for a blockwise moment (the reference above applies)."""
    return any(opt_kwargs.get(k) in ("8bit", "4bit") for k in ("exp_avg_dtype", "exp_avg_sq_dtype"))


def reference_for(groups, opt: Any, opt_kwargs: Dict[str, Any], param_dtype: Optional[torch.dtype] = None,
                  **defaults: Any) -> ReferenceLowBitAdamW:
    """The unsharded reference of ``opt`` (a DistributedFusedAdam built with ``opt_kwargs`` over
    params of ``param_dtype``) over the fp32 ``groups``: its formats, block size and buckets."""
    return ReferenceLowBitAdamW(groups, opt_kwargs.get("exp_avg_dtype"), opt_kwargs.get("exp_avg_sq_dtype"),
                                opt.bucket_cap_mb, opt_kwargs.get("quant_block_size"), param_dtype, **defaults)
