"""Checkpoints: torch-layout optimizer state dicts that reshard across world sizes
(``state_dict.py``), sharded checkpoints through ``torch.distributed.checkpoint`` (``sharded.py``:
``save_sharded`` / ``load_sharded``), and crash-safe publication of a checkpoint directory
(``atomic_publish.py``)."""
from .sharded import load_sharded, save_sharded

__all__ = ["save_sharded", "load_sharded"]
