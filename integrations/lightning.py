"""Lightning (the ``lightning`` package): the Trainer's and Fabric's ``strategy="shardamp"`` for a
``DistributedFusedAdam``.

Importing this module registers the strategies in ``lightning.pytorch``'s ``StrategyRegistry``
and ``lightning.fabric``'s ``STRATEGY_REGISTRY``::

    import lightning as L
    import shardamp.integrations.lightning  # noqa: F401  (registers "shardamp")

    trainer = L.Trainer(strategy="shardamp", devices=8, precision="bf16-mixed", gradient_clip_val=1.0)
    trainer = L.Trainer(strategy=ShardampStrategy(sharded_checkpoint=True), ...)  # options: the class
    fabric = L.Fabric(strategy="shardamp", devices=8)

Registered names, for the Trainer and Fabric alike (as ``"ddp"``, ``"ddp_spawn"``, ...):
``shardamp`` (``start_method="popen"``), ``shardamp_spawn``, ``shardamp_fork``,
``shardamp_notebook`` and ``shardamp_sharded_checkpoint``. In a LightningCLI config,
``trainer: {strategy: shardamp}`` once the script imports this module, or
``strategy: {class_path: shardamp.integrations.lightning.ShardampStrategy, init_args: {...}}``.

``ShardampStrategy`` is Lightning's ``DDPStrategy`` (same launchers, process-group setup and
distributed sampler) with these changes:

* the model is never wrapped in DDP: the optimizer reduce-scatters the grads itself;
* ``gradient_clip_val`` (norm) clips through ``shardamp.optim.clip_grad_norm_``, i.e. inside the
  optimizer's step kernel with the true global norm, in every precision (Lightning's own AMP
  plugin refuses to clip optimizers that unscale inside ``step``);
* ``precision="16-mixed"`` uses ``ShardedGradScaler`` (every rank skips the same steps), which
  unscales before ``on_before_optimizer_step`` as Lightning does for torch optimizers;
* ``accumulate_grad_batches`` runs all but the last micro-batch under ``opt.no_sync()``;
* checkpoints: every rank takes part in the optimizer's (collective) ``state_dict``; rank 0
  writes it. ``sharded_checkpoint=True`` has each rank write its shard through
  ``torch.distributed.checkpoint`` beside the checkpoint file instead (referenced by a name
  relative to it; paths may be fsspec URLs: see ``shardamp.integrations._sharded_checkpoint``).

``ShardampFabricStrategy`` is the same for Fabric: no DDP wrapper; ``fabric.clip_gradients(model,
optimizer, max_norm=...)`` through ``clip_grad_norm_``; ``16-mixed`` with a ShardedGradScaler;
``fabric.no_backward_sync(model)`` through ``opt.no_sync()``; ``fabric.save``/``fabric.load`` with
the collective ``state_dict`` on every rank (or ``sharded_checkpoint=True``). Build the
DistributedFusedAdam after the model is on its device (``fabric.init_module()``, or
``fabric.setup_module(model)`` first), inside the launched processes.

Every optimizer must be a ``DistributedFusedAdam``: nothing else would reduce the grads.

The standalone packages have their own modules: ``shardamp.integrations.pytorch_lightning``
(``pytorch_lightning.Trainer``) and ``shardamp.integrations.lightning_fabric``
(``lightning_fabric.Fabric``); the logic is shared (``_lightning_trainer.py``,
``_lightning_fabric.py``).
"""
from __future__ import annotations

try:
    from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "shardamp.integrations.lightning needs the `lightning` package (pip install 'lightning>=2.6.6,<2.7'). "
        "With the standalone packages use shardamp.integrations.pytorch_lightning (pytorch_lightning.Trainer) "
        "or shardamp.integrations.lightning_fabric (lightning_fabric.Fabric)."
    ) from exc

from ._lightning_fabric import FabricStrategyMixin
from ._lightning_trainer import TrainerStrategyMixin, trainer_plugins

__all__ = ["ShardampStrategy", "ShardampFabricStrategy", "ShardampMonitor"]

# the Trainer's precision plugins (clipping through the optimizer) and monitor callback, built on
# this package's classes (_lightning_trainer.py holds their logic)
_plugins = trainer_plugins(__name__, "lightning.pytorch", Precision, HalfPrecision, MixedPrecision, Callback)
ShardampPrecision, ShardampHalfPrecision = _plugins.precision, _plugins.half_precision
ShardampMixedPrecision, ShardampMonitor = _plugins.mixed_precision, _plugins.monitor


class ShardampStrategy(TrainerStrategyMixin, DDPStrategy, plugins=_plugins):
    """``lightning.pytorch.Trainer(strategy=ShardampStrategy(...))``, or ``strategy="shardamp"``:
    DDP's launch and process group without DDP, for ``DistributedFusedAdam`` (module docstring;
    arguments: ``__init__``)."""


class ShardampFabricStrategy(FabricStrategyMixin, FabricDDPStrategy,
                             precisions=(FabricPrecision, FabricHalfPrecision, FabricMixedPrecision)):
    """``lightning.fabric.Fabric(strategy=ShardampFabricStrategy(...))``, or ``strategy="shardamp"``:
    Fabric's DDP launch and process group without DDP, for ``DistributedFusedAdam`` (module
    docstring; arguments: ``__init__``)."""


ShardampStrategy.register_strategies(StrategyRegistry)
ShardampFabricStrategy.register_strategies(STRATEGY_REGISTRY)
