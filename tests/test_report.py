"""python -m shardamp.report: every section printed, nothing built without --build, exit 0; a
build asked for that fails exits 1 with its cause."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from conftest import set_env

from shardamp import report
from shardamp.optim.kernels import build


def test_report_prints_every_section_and_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    set_env(monkeypatch, "SHARDAMP_CUDA_ARCH", "8.0;9.0+PTX")
    monkeypatch.setenv("SHARDAMP_NO_SUCH_SETTING", "1")
    monkeypatch.setattr(build, "_loaded", {})
    out = io.StringIO()
    assert report.main([], out=out) == 0
    text = out.getvalue()
    for key in ("shardamp", "python", "torch", "NCCL", "C++ compiler", "ninja", "nvcc", "GPUs",
                "CUDA archs of a build", "prebuilt kernels", "build directory", "kernels", "  cpu", "  cuda",
                "settings (SHARDAMP_*)"):
        assert f"\n{key}" in "\n" + text, key
    assert "8.0;9.0+PTX  (SHARDAMP_CUDA_ARCH='8.0;9.0+PTX')" in text
    assert "SHARDAMP_CUDA_ARCH            '8.0;9.0+PTX'  (environment: SHARDAMP_CUDA_ARCH='8.0;9.0+PTX')" in text
    assert "SHARDAMP_NO_SUCH_SETTING (ignored: misspelt?)" in text
    assert ": missing:" in text and "runs: native after a build at first use" in text
    assert os.listdir(tmp_path) == []  # nothing built, not even a directory made


def test_report_build_failure_exits_1_with_its_cause(monkeypatch):
    def broken(cuda, device=None):
        raise build.BuildError("no C++ compiler: 'c++' is not on PATH", "the log")

    monkeypatch.setattr(build, "load_extension", broken)
    out = io.StringIO()
    assert report.main(["--build", "cpu"], out=out) == 1
    assert "build cpu               FAILED: shardamp: the cpu kernels could not be built: no C++ compiler" in out.getvalue()


def test_python_dash_m_runs_from_the_checkout(tmp_path):
    """`python -m shardamp.report` as a person runs it (the checkout's root on sys.path)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "SHARDAMP_KERNELS": "reference"}
    run = subprocess.run([sys.executable, "-m", "shardamp.report"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "runs: reference (SHARDAMP_KERNELS=reference)" in run.stdout
    with pytest.raises(SystemExit):
        report.main(["--build", "tpu"], out=io.StringIO())
