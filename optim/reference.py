"""Compatibility path: the reference kernels live in ``shardamp.optim.kernels.reference``."""
from .kernels.reference import *  # noqa: F401,F403
from .kernels.reference import join_remainders, split_remainders  # noqa: F401
