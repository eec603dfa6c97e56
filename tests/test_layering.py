"""The package's structure: the import-linter contracts in setup.cfg (layers, no cycles, the core
never importing the integrations) hold, and the import paths users have keep working."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import importlinter  # noqa: F401  (a test dependency: the contracts must be checked, not skipped)

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout and "kept" in run.stdout.lower()


def test_public_and_compatibility_import_paths() -> None:
    import shardamp.optim as optim
    from shardamp.optim import DistributedFusedAdam, clip_grad_norm_, kernels, load_sharded, save_sharded
    from shardamp.optim.checkpoint import load_sharded as load2, save_sharded as save2
    from shardamp.optim.kernels import reference as new_reference
    from shardamp.optim.layout import ALIGN, Segment, SegmentTable, build_layout  # noqa: F401
    from shardamp.optim.reference import split_remainders
    from shardamp.scaler import ShardedGradScaler

    assert set(optim.__all__) >= {"DistributedFusedAdam", "clip_grad_norm_", "save_sharded", "load_sharded"}
    assert (load2, save2) == (load_sharded, save_sharded)
    assert split_remainders is new_reference.split_remainders
    import torch

    assert kernels.backend(torch.device("cpu")) in ("native", "reference")
    assert issubclass(ShardedGradScaler, torch.amp.GradScaler)
    assert DistributedFusedAdam._step_supports_amp_scaling is True and callable(clip_grad_norm_)
