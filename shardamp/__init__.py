"""shardamp: a ZeRO-2 sharded fused Adam (:mod:`shardamp.optim`) and AMP gradient scaling
(:mod:`shardamp.scaler`) that train like unsharded ``torch.optim.AdamW``, with adapters for
Lightning, accelerate and transformers (:mod:`shardamp.integrations`).

``python -m shardamp.report`` prints the versions, the kernels' state and the settings in force.

In the source tree the sub-packages keep their own top-level folders (``optim/``, ``scaler/``,
``integrations/``, ``csrc/``; setup.py maps them into ``shardamp``); the symbolic links beside
this file make a checkout importable, and analysable by import-linter, in the installed layout.
"""

__version__ = "0.1.0"  # the one source of the version (pyproject.toml and setup.py read it)

__all__ = ["__version__"]
