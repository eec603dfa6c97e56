"""Kernel sources (C++ for CPUs, CUDA for GPUs), shipped as package data and compiled
just-in-time by :mod:`shardamp.optim.kernels`."""
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
