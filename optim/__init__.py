"""shardamp.optim: ZeRO-2 sharded fused Adam/AdamW, a sharding-aware clip_grad_norm_, and
sharded checkpoints through torch.distributed.checkpoint."""
from . import config
from .checkpoint import load_sharded, save_sharded, to_torch_state_dict
from .clip import clip_grad_norm_
from .distributed_fused_adam import DistributedFusedAdam

__all__ = ["DistributedFusedAdam", "clip_grad_norm_", "save_sharded", "load_sharded", "to_torch_state_dict", "config"]
