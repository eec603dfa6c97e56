"""The standalone ``lightning_fabric`` package: ``lightning_fabric.Fabric(strategy="shardamp")``.

Importing this module registers ``ShardampFabricStrategy`` in ``lightning_fabric``'s
``STRATEGY_REGISTRY`` (names: ``shardamp``, ``shardamp_spawn``, ``shardamp_fork``,
``shardamp_notebook``, ``shardamp_sharded_checkpoint``)::

    from lightning_fabric import Fabric
    import shardamp.integrations.lightning_fabric  # noqa: F401  (registers "shardamp")

    fabric = Fabric(strategy="shardamp", devices=8, precision="bf16-mixed")
    fabric.launch()
    model = fabric.setup_module(Net())                 # on its device before the optimizer
    opt = fabric.setup_optimizers(DistributedFusedAdam(model.parameters(), lr=1e-3))
    ...
    fabric.backward(loss)
    norm = fabric.clip_gradients(model, opt, max_norm=1.0)   # inside the step kernel
    opt.step()

Behaviour and options are exactly those of
``shardamp.integrations.lightning.ShardampFabricStrategy`` (the same code,
``_lightning_fabric.py``); only the base classes are ``lightning_fabric``'s.
"""
from __future__ import annotations

try:
    from lightning_fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
    from lightning_fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "shardamp.integrations.lightning_fabric needs the standalone `lightning_fabric` package (installed "
        "with pytorch-lightning, or pip install 'lightning-fabric>=2.6.6,<2.7'); with the unified `lightning` "
        "package use shardamp.integrations.lightning."
    ) from exc

from ._lightning_fabric import FabricStrategyMixin

__all__ = ["ShardampFabricStrategy"]


class ShardampFabricStrategy(FabricStrategyMixin, DDPStrategy, precisions=(Precision, HalfPrecision, MixedPrecision)):
    """``lightning_fabric.Fabric(strategy=ShardampFabricStrategy(...))``, or ``strategy="shardamp"``:
    Fabric's DDP launch and process group without DDP, for ``DistributedFusedAdam`` (arguments:
    ``__init__``)."""


ShardampFabricStrategy.register_strategies(STRATEGY_REGISTRY)
