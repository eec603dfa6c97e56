"""Builds that never hang or mix: sources hashed into the module name, stale torch locks
recovered, a live build's lock reported, chunk tables built on the host at construction, and the
CPU kernels built for the ISA torch runs at."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import types
import warnings

import pytest
import torch

from conftest import set_env

from shardamp import report
from shardamp.optim import DistributedFusedAdam
from shardamp.optim.kernels import build as _build, dispatch as kernels, launch_config
from shardamp.optim.layout import Segment, SegmentTable


def test_different_sources_get_different_build_names(tmp_path):
    src = _build.source_dir()
    copy = tmp_path / "csrc"
    shutil.copytree(src, copy)
    flags = [["-O3"], {}]
    same = _build.source_hash(copy, flags)
    assert same == _build.source_hash(src, flags)
    (copy / "cpu" / "fused_adam_cpu.cpp").write_text((copy / "cpu" / "fused_adam_cpu.cpp").read_text() + "\n// edit\n")
    assert _build.source_hash(copy, flags) != same
    assert _build.source_hash(src, [["-O2"], {}]) != same  # flags count too


def test_stale_torch_lock_is_removed_with_a_warning(tmp_path):
    build_dir = str(tmp_path / "build")
    os.makedirs(build_dir)
    stale = os.path.join(build_dir, "lock")
    open(stale, "w").close()  # what a build killed inside torch's FileBaton leaves
    with pytest.warns(RuntimeWarning, match="stale build lock .*lock"):
        with _build.build_lock(build_dir):
            assert not os.path.exists(stale)


def _hold_build_lock(build_dir: str, seconds: float, torch_lock: bool = False) -> subprocess.Popen:
    """Another process holding ``build_dir``'s build lock for ``seconds`` (and, with
    ``torch_lock``, having left torch's own ``lock`` file as a build killed midway does)."""
    os.makedirs(build_dir)
    leave = f"open({os.path.join(build_dir, 'lock')!r}, 'w').close()\n" if torch_lock else ""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, time\n"
        f"f = open({os.path.join(build_dir, 'shardamp-build.lock')!r}, 'a')\n"
        "fcntl.flock(f.fileno(), fcntl.LOCK_EX)\n"
        f"{leave}"
        "print('held', flush=True)\n"
        f"time.sleep({seconds})\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_waiting_for_a_live_build_is_said_once_with_the_lock_path(tmp_path, monkeypatch, capsys):
    build_dir = str(tmp_path / "build")
    holder = _hold_build_lock(build_dir, seconds=3)
    monkeypatch.setattr(_build, "WAIT_REPORT_S", 0.5)
    start = time.monotonic()
    with _build.build_lock(build_dir, "CPU (AVX2)"):
        waited = time.monotonic() - start
    holder.wait(timeout=30)
    assert 1.0 < waited < 30  # it waited for the holder, and no longer
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("shardamp: waiting for another process to build the CPU (AVX2) kernels")
    assert os.path.join(build_dir, "shardamp-build.lock") in lines[0]


def test_killed_holder_releases_the_lock(tmp_path):
    build_dir = str(tmp_path / "build")
    holder = _hold_build_lock(build_dir, seconds=600, torch_lock=True)  # to be killed inside torch's build
    holder.kill()
    holder.wait(timeout=30)
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _build.build_lock(build_dir):
            pass
    assert time.monotonic() - start < 10
    assert any("stale build lock" in str(w.message) for w in caught)


def _native_or_skip():
    ext = kernels._native(torch.device("cpu"))
    if ext is None:
        pytest.skip("native kernels not built")
    return ext


@pytest.mark.parametrize("chunk", [1, 7, 16, 16384])
def test_host_chunk_table_equals_the_kernels(chunk):
    ext = _native_or_skip()
    segs = [Segment(0, 5, 0, 0, 0), Segment(16, 0, 1, 1, 0), Segment(16, 40, 2, 1, 3), Segment(64, 33, 3, 0, 0)]
    table = SegmentTable.build(segs, torch.device("cpu"))
    ours = launch_config.chunk_table(table, 100, 4, 2, chunk)
    assert torch.equal(ours, ext.build_chunks(table.table, 100, 4, 2, chunk))
    with pytest.raises(ValueError, match="outside the shard"):
        launch_config.chunk_table(table, 90, 4, 2, chunk)
    with pytest.raises(ValueError, match="param_index 3 out of range"):
        launch_config.chunk_table(table, 100, 3, 2, chunk)


def test_chunk_tables_exist_after_construction_and_the_step_reads_no_device_table(monkeypatch):
    ext = _native_or_skip()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.0002)
    for b in opt._buckets:
        assert any(k.startswith("native_chunks_") for k in b.segments.extra)

    def reads_device_table(*args, **kwargs):
        raise AssertionError("the step built a chunk table from the device segment table")

    monkeypatch.setattr(ext, "build_chunks", reads_device_table)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_cpu_build_follows_torch_and_env(monkeypatch):
    """The CPU kernels are built for the ISA torch runs at; the env var can only lower it."""
    monkeypatch.delenv("SHARDAMP_CPU_CAPABILITY", raising=False)
    native = _build.cpu_capability()
    assert native in ("generic", "avx2", "avx512")
    torch_cap = torch.backends.cpu.get_cpu_capability()
    if _build._x86_64():
        assert native == {"AVX512": "avx512", "AVX2": "avx2"}.get(torch_cap, "generic")
    set_env(monkeypatch, "SHARDAMP_CPU_CAPABILITY", "generic")
    assert _build.cpu_capability() == "generic"
    set_env(monkeypatch, "SHARDAMP_CPU_CAPABILITY", "avx512")
    assert _build.cpu_capability() == native  # never above what torch reports
    with pytest.raises(ValueError, match="SHARDAMP_CPU_CAPABILITY"):
        set_env(monkeypatch, "SHARDAMP_CPU_CAPABILITY", "sse9")


def _fake_load(calls, seconds=0.0):
    """torch's ``load`` standing in for a real build: writes the module file, returns a stub."""
    def load(name, sources, build_directory, **kwargs):
        calls.append((name, kwargs))
        time.sleep(seconds)
        open(os.path.join(build_directory, name + ".so"), "w").close()
        return types.SimpleNamespace(__file__=os.path.join(build_directory, name + ".so"))
    return load


def test_a_build_says_what_where_and_how_long_once(tmp_path, monkeypatch, capsys):
    """The builder prints one line before (what, for which device, where, typical time) and one
    after (the time it took); a process finding the module built says nothing."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(cpp_extension, "load", _fake_load(calls, 0.2))
    var = _build.current_variant(False)
    _build._jit(var, _build.source_dir(), None)
    before, after = capsys.readouterr().err.splitlines()
    assert before.startswith(f"shardamp: building the {var.label} kernels for this CPU and torch {torch.__version__} "
                             f"into {tmp_path}")
    assert _build.CPU_BUILD_TIME in before
    assert after.startswith(f"shardamp: built the {var.label} kernels in ") and after.endswith(" s")
    _build._jit(var, _build.source_dir(), None)  # built before: loaded, silently
    assert capsys.readouterr().err == "" and len(calls) == 2


@pytest.mark.parametrize("text, cause", [
    ("ninja: build stopped\n[Errno 28] No space left on device: '/tmp/x.o'", "no disk space"),
    ("Error building extension 'x'\nnvcc fatal   : Unsupported gpu architecture 'compute_100'", "an unsupported arch: nvcc cannot compile compute_100"),
    ("Error building extension 'x'\n/bin/sh: 1: c++: not found", "no C++ compiler: c++ was not found"),
    ("[Errno 2] No such file or directory: '/usr/local/cuda/bin/nvcc'", "no nvcc"),
    ("Ninja is required to load C++ extensions", "no ninja"),
    ("Error building extension 'x': [1/2] c++ ... \nFAILED: a.o\n/src/a.cpp:3:1: error: 'foo' does not name a type\nninja: build stopped: subcommand failed.",
     "a compile error: /src/a.cpp:3:1: error: 'foo' does not name a type"),
    ("Error building extension 'x': [1/2] /bin/false ...\nFAILED: a.o\nninja: build stopped: subcommand failed.",
     "the compiler failed without a message"),
])
def test_a_failed_build_is_named_by_its_cause(text, cause):
    assert _build.diagnose(RuntimeError(text)).startswith(cause)


def test_preflight_names_a_missing_compiler_or_disk(tmp_path, monkeypatch):
    var = _build.current_variant(False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(_build.BuildError, match="^no C\\+\\+ compiler: .*no-such-compiler.* is not on PATH"):
        _build.preflight(var, str(tmp_path), None)
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(_build.BuildError, match="^no working C\\+\\+ compiler: '/bin/false --version' failed"):
        _build.preflight(var, str(tmp_path), None)
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(_build.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=10 * 2**20))
    with pytest.raises(_build.BuildError, match="^no disk space: 10 MiB free in"):
        _build.preflight(var, str(tmp_path), None)


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs c++")
def test_the_environments_ninja_is_used_where_path_has_none(tmp_path, monkeypatch):
    """A venv run by path (not activated) or ``pip install --user`` without ~/.local/bin on PATH:
    the ninja installed with shardamp is in the environment's scripts folder, not on PATH. The
    build puts that folder first on PATH; with no ninja anywhere it says where it looked."""
    var = _build.current_variant(False)
    scripts, empty = tmp_path / "bin", tmp_path / "empty"
    scripts.mkdir()
    empty.mkdir()
    monkeypatch.setenv("CXX", shutil.which("c++"))  # found without PATH
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(_build, "_scripts_folders", lambda: [str(tmp_path / "other"), str(scripts)])
    where = re.escape(f"none on PATH nor in this environment's scripts folders {tmp_path}/other, {scripts}")
    with pytest.raises(_build.BuildError, match=f"^no ninja: .*{where}\\); pip install ninja"):
        _build.preflight(var, str(tmp_path), None)
    assert os.environ["PATH"] == str(empty) and _build.environment_ninja() is None
    assert report._ninja().startswith("none (pip install ninja")

    (scripts / "ninja").write_text("#!/bin/sh\necho 1.13.0\n")  # what torch asks of it: `ninja --version`
    (scripts / "ninja").chmod(0o755)
    assert _build.environment_ninja() == str(scripts / "ninja")
    assert report._ninja() == f"1.13.0 ({scripts}/ninja; not on PATH: the build puts its folder there)"
    _build.preflight(var, str(tmp_path), None)
    assert os.environ["PATH"] == os.pathsep.join([str(scripts), str(empty)])
    _build.preflight(var, str(tmp_path), None)  # found on PATH now: not added twice
    assert os.environ["PATH"] == os.pathsep.join([str(scripts), str(empty)])


def test_a_failed_build_warns_its_cause_first_and_what_happens_next(tmp_path, monkeypatch):
    """The first sentence names the kernels and the cause; then the fallback and its cost, or,
    with SHARDAMP_KERNELS=native, the error."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setattr(_build, "_loaded", {})
    monkeypatch.setattr(kernels, "_native_cache", {})
    monkeypatch.setattr(kernels, "_warned", set())
    set_env(monkeypatch, "SHARDAMP_PREBUILT", "0")
    with pytest.warns(RuntimeWarning) as caught:
        assert kernels.backend(torch.device("cpu")) == "reference"
    message = str(caught[0].message)
    first = message.split(". ")[0]
    assert first.startswith("shardamp: the cpu kernels could not be built: no working C++ compiler"), message
    assert "reference kernels instead" in message and kernels.REFERENCE_COST["cpu"] in message
    assert len(message) < 600
    monkeypatch.setattr(kernels, "_native_cache", {})
    set_env(monkeypatch, "SHARDAMP_KERNELS", "native")
    with pytest.raises(RuntimeError, match="^shardamp: the cpu kernels could not be built: no working C\\+\\+ "
                                           "compiler.*SHARDAMP_KERNELS=native demands"):
        kernels.backend(torch.device("cpu"))


def test_the_optimizer_builds_its_kernels_before_its_first_collective(monkeypatch):
    from shardamp.optim import distributed_fused_adam as dfa

    order = []
    real_native, real_make_comm = kernels._native, dfa.make_comm
    monkeypatch.setattr(kernels, "_native", lambda device: order.append("kernels") or real_native(device))
    monkeypatch.setattr(dfa, "make_comm", lambda *a: order.append("comm") or real_make_comm(*a))
    DistributedFusedAdam(torch.nn.Linear(4, 4).parameters())
    assert order.index("kernels") < order.index("comm")


def _fake_prebuilt(monkeypatch, info):
    from shardamp.optim.kernels import prebuilt

    monkeypatch.setattr(prebuilt, "build_info", lambda: info)
    monkeypatch.setattr(prebuilt, "_module_path", lambda base: f"/site/shardamp/_kernels/{base}.so")
    return prebuilt


def test_prebuilt_kernels_for_another_torch_or_gpu_name_both_and_the_fixes(monkeypatch):
    src = _build.source_dir()
    cpu, cuda = _build.current_variant(False), _build.current_variant(True)
    info = {"torch": "2.12.0+cu128", "sources": _build.source_hash(src, []),
            "modules": {cpu.base: {"cuda": False, "cpu_capability": cpu.cpu_capability},
                        cuda.base: {"cuda": True, "archs": "8.0;8.6"}}}
    prebuilt = _fake_prebuilt(monkeypatch, info)
    with pytest.raises(prebuilt.PrebuiltMismatch) as err:
        prebuilt.load(cpu, src)
    text = str(err.value)
    assert text.startswith(f"the prebuilt {cpu.label} kernels in /site/shardamp/_kernels were built for torch "
                           f"2.12.0+cu128, and this process runs torch {torch.__version__}")
    assert "SHARDAMP_BUILD_KERNELS=1 pip install --no-build-isolation" in text and "SHARDAMP_PREBUILT=0" in text
    info["torch"] = torch.__version__
    h200 = (0, "NVIDIA H200", (9, 0))
    with pytest.raises(prebuilt.PrebuiltMismatch, match=r"built for archs 8\.0;8\.6, which GPU 0 \(NVIDIA H200, "
                                                        r"compute capability 9\.0\) cannot run.*8\.0;8\.6;9\.0.*SHARDAMP_PREBUILT=0"):
        prebuilt.load(cuda, src, h200)
    assert prebuilt.check(cuda, src, (0, "NVIDIA A10", (8, 6)))[0] == "prebuilt"
    info["modules"][cuda.base]["archs"] = "8.0+PTX"
    assert prebuilt.check(cuda, src, h200)[0] == "prebuilt"  # the PTX runs on it
    info["sources"] = "another-tree"
    assert prebuilt.check(cpu, src) is None  # built from other sources: the JIT build runs instead


def test_a_prebuilt_mismatch_warns_first_and_prebuilt_0_ignores_them(monkeypatch):
    src = _build.source_dir()
    cpu = _build.current_variant(False)
    _fake_prebuilt(monkeypatch, {"torch": "2.12.0", "modules": {cpu.base: {"cuda": False}}})
    monkeypatch.setattr(_build, "_loaded", {})
    monkeypatch.setattr(kernels, "_native_cache", {})
    monkeypatch.setattr(kernels, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"^shardamp: the cpu kernels could not be loaded: the prebuilt CPU .* "
                                            r"built for torch 2\.12\.0, and this process runs"):
        assert kernels.backend(torch.device("cpu")) == "reference"
    monkeypatch.setattr(_build, "_loaded", {})
    monkeypatch.setattr(kernels, "_native_cache", {})
    set_env(monkeypatch, "SHARDAMP_PREBUILT", "0")
    calls = []
    monkeypatch.setattr(_build, "_jit", lambda var, src, gpu: calls.append(var.base) or "jit module")
    assert _build.load_extension(cuda=False) == "jit module" and calls == [cpu.base]
    assert src.is_dir()
