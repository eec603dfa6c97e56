"""Installs ``optim/`` as ``shardamp.optim``, ``scaler/`` as ``shardamp.scaler``,
``integrations/`` as ``shardamp.integrations`` and the kernel sources in ``csrc/`` as
``shardamp.csrc`` (package data, compiled just-in-time on first use).
``shardamp`` itself is a namespace package; metadata and dependencies live in setup.cfg."""
from setuptools import setup

setup(
    packages=["shardamp.optim", "shardamp.scaler", "shardamp.integrations", "shardamp.csrc"],
    package_dir={
        "shardamp.optim": "optim",
        "shardamp.scaler": "scaler",
        "shardamp.integrations": "integrations",
        "shardamp.csrc": "csrc",
    },
    package_data={"shardamp.csrc": ["*.cpp", "*.h", "cpu/*.cpp", "cpu/*.h", "cuda/*.cu", "cuda/*.cuh", "cuda/*.h"]},
    include_package_data=True,
)
