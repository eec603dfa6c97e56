"""Checkpoints: torch-layout optimizer state dicts that reshard across world sizes
(``state_dict.py``), sharded checkpoints through ``torch.distributed.checkpoint`` (``sharded.py``:
``save_sharded`` / ``load_sharded``), blockwise moments in state dicts and their conversion to
torch's (``quantized.py``: ``to_torch_state_dict``), and crash-safe publication of a checkpoint
directory (``atomic_publish.py``)."""
from .quantized import to_torch_state_dict
from .sharded import load_sharded, save_sharded

__all__ = ["save_sharded", "load_sharded", "to_torch_state_dict"]
