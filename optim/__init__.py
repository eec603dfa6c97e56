"""shardamp.optim: ZeRO-2 sharded fused Adam/AdamW and a sharding-aware clip_grad_norm_."""
from .clip import clip_grad_norm_
from .distributed_fused_adam import DistributedFusedAdam

__all__ = ["DistributedFusedAdam", "clip_grad_norm_"]
