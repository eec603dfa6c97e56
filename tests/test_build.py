"""Builds that never hang or mix: sources hashed into the module name, stale torch locks
recovered, a live build's lock reported, chunk tables built on the host at construction, and the
CPU kernels built for the ISA torch runs at."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import warnings

import pytest
import torch

from conftest import set_env

from shardamp.optim import DistributedFusedAdam
from shardamp.optim.kernels import build as _build, dispatch as kernels
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


def test_waiting_for_a_live_build_is_reported_with_the_lock_path(tmp_path, monkeypatch):
    build_dir = str(tmp_path / "build")
    holder = _hold_build_lock(build_dir, seconds=3)
    monkeypatch.setattr(_build, "WAIT_REPORT_S", 0.5)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="shardamp-build.lock"):
        with _build.build_lock(build_dir):
            waited = time.monotonic() - start
    holder.wait(timeout=30)
    assert 1.0 < waited < 30  # it waited for the holder, and no longer


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
    ours = kernels.chunk_table(table, 100, 4, 2, chunk)
    assert torch.equal(ours, ext.build_chunks(table.table, 100, 4, 2, chunk))
    with pytest.raises(ValueError, match="outside the shard"):
        kernels.chunk_table(table, 90, 4, 2, chunk)
    with pytest.raises(ValueError, match="param_index 3 out of range"):
        kernels.chunk_table(table, 100, 3, 2, chunk)


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
