"""GPU variants of the framework tests: each examples/*_train.py script with --device cuda in
bf16 and fp16 (every visible GPU, NCCL; world 1 on one GPU) must print PASS for its parity check
against unsharded torch.optim.AdamW (and, for the Trainer, for resuming from save_steps) and a
step-time line against the framework's default. Skipped without a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("script, framework", [
    ("lightning_train.py", "lightning"), ("accelerate_train.py", "accelerate"),
    ("transformers_train.py", "transformers"),
])
def test_example_on_cuda(script, framework, precision, tmp_path) -> None:
    pytest.importorskip(framework)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--device", "cuda", "--precision", precision, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    parity = [line for line in out.splitlines() if line.startswith("parity vs torch.optim.AdamW")]
    assert parity and all(line.endswith("PASS") for line in parity), out[-5000:]
    assert "step time" in out and "DDP + AdamW(fused)" in out, out[-5000:]
    if framework == "transformers":
        assert "+ resume_from_checkpoint ends on the same params: PASS" in out, out[-5000:]
