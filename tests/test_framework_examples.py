"""Lightning's real launch path in CI: examples/lightning_train.py with devices=2 on the CPU, where
Lightning's own launcher starts the second rank (the framework tests start ranks themselves).
The accelerate and transformers examples launch through torchrun the same way; their GPU runs
are in test_cuda_frameworks.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_lightning_example_launches_two_ranks_and_passes_parity(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "NODE_RANK")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_train.py"), "--steps", "4", "--warmup", "1", "--no-baseline",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "MEMBER: 2/2" in out, out[-5000:]  # Lightning started the second process
    assert "world 2, clipped every step: yes" in out and "PASS" in out, out[-5000:]
