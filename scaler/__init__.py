"""shardamp.scaler: a torch.amp.GradScaler that works with sharded optimizers."""
from .sharded_grad_scaler import ShardedGradScaler

__all__ = ["ShardedGradScaler"]
