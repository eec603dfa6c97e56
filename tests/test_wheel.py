"""The ahead-of-time build end to end: ``SHARDAMP_BUILD_KERNELS=1 pip wheel --no-build-isolation``
from a copy of the source tree, installed (not editable) into a fresh virtual environment that
sees the running interpreter's packages wherever they live (tests/environments.py), used from a
directory where no source tree is visible: every CPU variant the run time can pick is in the
wheel with its build record, and a training step runs on the prebuilt kernels with no compiler
(CC/CXX=/bin/false), SHARDAMP_KERNELS=native and an empty extension directory; the report runs
there too.

One test, the slowest of the suite (the wheel compiles three CPU modules: minutes on 2 cores).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from environments import venv_seeing_this_environment

ROOT = Path(__file__).resolve().parents[1]

STEP = textwrap.dedent("""
    import importlib, json, os, sys
    import torch
    import shardamp
    from shardamp.optim import DistributedFusedAdam, kernels
    from shardamp.optim.kernels import build, variants
    assert shardamp.__file__.startswith(sys.prefix), (shardamp.__file__, sys.prefix)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = [p.detach().clone() for p in model.parameters()]
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(ref, model.parameters()))
    ext = kernels.native_module(torch.device("cpu"))
    loaded = {}
    for cap in ("generic", "avx2", "avx512"):  # each variant this CPU can run imports and says what it is
        if ["generic", "avx2", "avx512"].index(cap) <= ["generic", "avx2", "avx512"].index(build.cpu_capability()):
            mod = importlib.import_module("shardamp._kernels." + variants.variant(False, cap, build.source_dir()).base)
            loaded[cap] = mod.cpu_capability()
    print(json.dumps({"backend": kernels.backend(torch.device("cpu")), "module": ext.__file__,
                      "capability": build.cpu_capability(), "loaded": loaded,
                      "extensions_dir": os.listdir(os.environ["TORCH_EXTENSIONS_DIR"])}))
""")


def _copy_source(dest: Path) -> Path:
    """The tree as a clean clone has it (no build outputs that could leak into the wheel, no
    virtual environment made in the checkout, as ``python3 -m venv venv`` there makes one)."""
    patterns = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "out",
                                      "*.so", "build_info.json")

    def ignore(folder: str, names: list) -> set:
        venvs = {n for n in names if os.path.isfile(os.path.join(folder, n, "pyvenv.cfg"))}
        return set(patterns(folder, names)) | venvs

    shutil.copytree(ROOT, dest, symlinks=True, ignore=ignore)
    return dest


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    run = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert run.returncode == 0, f"{args} failed ({run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    return run


@pytest.mark.skipif(sys.platform != "linux", reason="the kernels build on Linux only")
def test_wheel_with_prebuilt_cpu_kernels_trains_without_a_compiler(tmp_path):
    import torch

    from shardamp.optim.kernels import variants

    src = _copy_source(tmp_path / "src")
    dist = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDAMP_") and k != "PYTHONPATH"}
    env.update(SHARDAMP_BUILD_KERNELS="1", MAX_JOBS=env.get("MAX_JOBS", str(os.cpu_count() or 2)))
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(dist), str(src)],
         env=env, cwd=tmp_path, timeout=1500)
    (wheel,) = dist.glob("shardamp-*.whl")
    assert "py3-none-any" not in wheel.name  # a platform wheel: it holds compiled modules
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = json.loads(z.read("shardamp/_kernels/build_info.json"))
    for cap in variants.prebuilt_cpu_capabilities():
        base = variants.variant(False, cap, src / "csrc").base
        assert any(n.startswith(f"shardamp/_kernels/{base}.") and n.endswith(".so") for n in names), (base, names)
        assert info["modules"][base] == {"cuda": False, "cpu_capability": cap}
    assert info["torch"] == torch.__version__ and info["sources"] == variants.source_hash(src / "csrc", [])
    assert not any(n.startswith(("tests/", "examples/", "optim/", "shardamp/tests")) for n in names)
    assert "shardamp/optim/kernels/build.py" in names and "shardamp/csrc/binding.cpp" in names
    assert "shardamp/py.typed" in names and "shardamp/optim/py.typed" in names

    venv = tmp_path / "venv"
    python = str(venv_seeing_this_environment(venv, exclude=ROOT, env=env))
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
         env=env, timeout=300)

    work, extensions = tmp_path / "elsewhere", tmp_path / "empty_extensions"
    work.mkdir()
    extensions.mkdir()
    run_env = {k: v for k, v in env.items() if k != "SHARDAMP_BUILD_KERNELS"}
    run_env.update(CC="/bin/false", CXX="/bin/false", TORCH_EXTENSIONS_DIR=str(extensions), SHARDAMP_KERNELS="native")
    step = _run([python, "-c", STEP], env=run_env, cwd=work, timeout=600)
    result = json.loads(step.stdout.strip().splitlines()[-1])
    assert result["backend"] == "native"
    assert result["module"].startswith(str(venv)) and "/shardamp/_kernels/" in result["module"]
    assert result["extensions_dir"] == []  # nothing was built
    expected = {"generic": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}
    assert result["loaded"] == {cap: expected[cap] for cap in result["loaded"]} and "generic" in result["loaded"]
    assert "building" not in step.stderr, step.stderr

    report = _run([python, "-m", "shardamp.report"], env=run_env, cwd=work, timeout=300)
    assert f"installed at {venv}" in report.stdout
    assert ": prebuilt:" in report.stdout and "runs: native" in report.stdout
    assert f"prebuilt kernels          {venv}" in report.stdout


def test_build_kernels_without_torch_says_how(tmp_path):
    """SHARDAMP_BUILD_KERNELS=1 where torch cannot be imported (pip's isolated build
    environment): setup.py stops at once, naming --no-build-isolation, and never asks for torch."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no torch in this environment')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SHARDAMP_BUILD_KERNELS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--name"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0
    assert "torch cannot be imported here (no torch in this environment)" in run.stderr
    assert "SHARDAMP_BUILD_KERNELS=1 pip install --no-build-isolation ." in run.stderr
    plain = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--name"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env={**env, "SHARDAMP_BUILD_KERNELS": "0"})
    assert plain.returncode == 0 and plain.stdout.strip().splitlines()[-1] == "shardamp", plain.stderr
