"""The standalone ``pytorch_lightning`` package: ``pytorch_lightning.Trainer(strategy="shardamp")``.

Importing this module registers ``ShardampStrategy`` in ``pytorch_lightning``'s
``StrategyRegistry`` (names: ``shardamp``, ``shardamp_spawn``, ``shardamp_fork``,
``shardamp_notebook``, ``shardamp_sharded_checkpoint``), and, through
``shardamp.integrations.lightning_fabric``, ``ShardampFabricStrategy`` in ``lightning_fabric``'s
(``pytorch_lightning`` depends on ``lightning_fabric``)::

    import pytorch_lightning as pl
    import shardamp.integrations.pytorch_lightning  # noqa: F401  (registers "shardamp")

    trainer = pl.Trainer(strategy="shardamp", devices=8, gradient_clip_val=1.0)

Behaviour, options and checkpoints are exactly those of
``shardamp.integrations.lightning.ShardampStrategy`` (the same code, ``_lightning_trainer.py``);
only the base classes are ``pytorch_lightning``'s, as its Trainer requires.
"""
from __future__ import annotations

try:
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.plugins.precision import HalfPrecision, MixedPrecision, Precision
    from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "shardamp.integrations.pytorch_lightning needs the standalone `pytorch_lightning` package "
        "(pip install 'pytorch-lightning>=2.6.6,<2.7'); with the unified `lightning` package use "
        "shardamp.integrations.lightning."
    ) from exc

from ._lightning_trainer import ClipThroughOptimizer, MonitorLogic, TrainerStrategyMixin
from .lightning_fabric import ShardampFabricStrategy

__all__ = ["ShardampStrategy", "ShardampFabricStrategy", "ShardampMonitor"]


class ShardampPrecision(ClipThroughOptimizer, Precision):
    """``precision="32-true"`` under ShardampStrategy."""


class ShardampHalfPrecision(ClipThroughOptimizer, HalfPrecision):
    """``precision="bf16-true"`` / ``"16-true"`` under ShardampStrategy."""


class ShardampMixedPrecision(ClipThroughOptimizer, MixedPrecision):
    """``precision="bf16-mixed"`` / ``"16-mixed"`` (with a ShardedGradScaler) under ShardampStrategy."""


class ShardampMonitor(MonitorLogic, Callback):
    """A ``pytorch_lightning`` callback logging ``grad_norm``, ``loss_scale`` and ``skipped_steps`` of every
    DistributedFusedAdam each logged step (``trainer.log_every_n_steps``) into the Trainer's
    loggers; ShardampStrategy adds one itself (``log_step_stats=True``, the default)."""


class ShardampStrategy(TrainerStrategyMixin, DDPStrategy):
    """``pytorch_lightning.Trainer(strategy=ShardampStrategy(...))``, or ``strategy="shardamp"``: DDP's
    launch and process group without DDP, for ``DistributedFusedAdam`` (see
    ``shardamp.integrations.lightning``; arguments: ``__init__``)."""

    _precision_table = {
        Precision: ("plain", ShardampPrecision),
        HalfPrecision: ("half", ShardampHalfPrecision),
        MixedPrecision: ("mixed", ShardampMixedPrecision),
    }
    _plain_precision = ShardampPrecision
    _monitor_class = ShardampMonitor


ShardampStrategy.register_strategies(StrategyRegistry)
