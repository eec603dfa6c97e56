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

from ._lightning_trainer import TrainerStrategyMixin, trainer_plugins
from .lightning_fabric import ShardampFabricStrategy

__all__ = ["ShardampStrategy", "ShardampFabricStrategy", "ShardampMonitor"]

# the Trainer's precision plugins (clipping through the optimizer) and monitor callback, built on
# this package's classes (_lightning_trainer.py holds their logic)
_plugins = trainer_plugins(__name__, "pytorch_lightning", Precision, HalfPrecision, MixedPrecision, Callback)
ShardampPrecision, ShardampHalfPrecision = _plugins.precision, _plugins.half_precision
ShardampMixedPrecision, ShardampMonitor = _plugins.mixed_precision, _plugins.monitor


class ShardampStrategy(TrainerStrategyMixin, DDPStrategy, plugins=_plugins):
    """``pytorch_lightning.Trainer(strategy=ShardampStrategy(...))``, or ``strategy="shardamp"``: DDP's
    launch and process group without DDP, for ``DistributedFusedAdam`` (see
    ``shardamp.integrations.lightning``; arguments: ``__init__``)."""


ShardampStrategy.register_strategies(StrategyRegistry)
