"""shardamp.integrations: DistributedFusedAdam and ShardedGradScaler inside the frameworks users
train with, each a one-line change:

* ``shardamp.integrations.lightning``: ``ShardampStrategy`` (``Trainer``) and
  ``ShardampFabricStrategy`` (``Fabric``) for the ``lightning`` package, registered as
  ``strategy="shardamp"`` on import; ``shardamp.integrations.pytorch_lightning`` and
  ``shardamp.integrations.lightning_fabric`` for the standalone packages;
* ``shardamp.integrations.accelerate.ShardampAccelerator`` for Hugging Face accelerate;
* ``shardamp.integrations.transformers.ShardampTrainer`` for the transformers Trainer.

Each module imports its framework; importing this package imports none of them.
"""
