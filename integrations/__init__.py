"""shardamp.integrations: DistributedFusedAdam and ShardedGradScaler inside the frameworks users
train with, each a one-line change:

* ``shardamp.integrations.lightning.ShardampStrategy`` for PyTorch Lightning;
* ``shardamp.integrations.accelerate.ShardampAccelerator`` for Hugging Face accelerate;
* ``shardamp.integrations.transformers.ShardampTrainer`` for the transformers Trainer.

Each module imports its framework; importing this package imports none of them.
"""
