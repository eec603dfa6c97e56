"""The CUDA arch list of a kernel build: parsed exactly as torch parses TORCH_CUDA_ARCH_LIST
(checked against torch's own parser), chosen from SHARDAMP_CUDA_ARCH > TORCH_CUDA_ARCH_LIST > the
visible GPUs > the ahead-of-time default limited to what nvcc compiles; older than 8.0 refused or
left out; what runs on which GPU. No GPU or nvcc needed: devices and nvcc are faked."""
from __future__ import annotations

import os
import stat

import pytest
import torch
from conftest import set_env
from torch.utils import cpp_extension

from shardamp.optim.kernels import archs, build

# Lists torch accepts, as users write them (named archs, spaces, "a" archs, +PTX, duplicates).
VALID = ["8.0;8.6;9.0+PTX", "9.0a", "8.0 8.6 9.0", "Ampere", "Ampere;Hopper", "Blackwell",
         "Ampere+Tegra", "10.0a+PTX;12.0", "7.5;8.0", "9.0;9.0+PTX;8.0", "Turing Ampere Ada Hopper Blackwell",
         "12.1a", "8.9+PTX", "Ada", "Volta;Pascal"]
# ... and lists it rejects: an unknown arch, the dotless spelling, an empty entry, sm_ names, a
# doubled +PTX from a name, a trailing separator.
INVALID = ["8.5", "80", "9.0;", "sm_90", "90a+PTX", "Ada Hopper+PTX", "8.0;;9.0", "hopper", "9.0+ptx", "Hopper+Tegra"]


def _torch_flags(monkeypatch, value):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
    try:
        return cpp_extension._get_cuda_arch_flags()
    except ValueError:
        return ValueError


def _our_flags(value):
    try:
        return archs.gencode_flags(archs.parse_arch_list(value))
    except ValueError:
        return ValueError


@pytest.mark.parametrize("value", VALID + INVALID)
def test_arch_lists_parse_as_torch_parses_them(monkeypatch, value):
    theirs = _torch_flags(monkeypatch, value)
    assert _our_flags(value) == theirs
    assert (theirs is ValueError) == (value in INVALID)


def test_every_arch_and_name_in_torchs_table_agrees(monkeypatch):
    """A torch that adds an arch or a name fails here (update NAMED_ARCHES / SUPPORTED_ARCHES)."""
    for arch in archs.SUPPORTED_ARCHES:
        for value in (arch, arch + "+PTX"):
            assert _our_flags(value) == _torch_flags(monkeypatch, value), value
    for name in archs.NAMED_ARCHES:
        assert _our_flags(name) == _torch_flags(monkeypatch, name), name
    for extra in ("8.8", "11.0f", "13.0", "Rubin"):  # not in torch 2.13's table: both refuse
        assert _our_flags(extra) is ValueError and _torch_flags(monkeypatch, extra) is ValueError


def test_malformed_lists_name_the_variable_and_the_dotted_spelling():
    with pytest.raises(ValueError, match=r"SHARDAMP_CUDA_ARCH='80;90'.*'80'.*write 80 as 8\.0"):
        archs.parse_arch_list("80;90", "SHARDAMP_CUDA_ARCH")
    with pytest.raises(ValueError, match=r"TORCH_CUDA_ARCH_LIST='8\.0 sm_90'.*'sm_90'.*8\.0;8\.6;9\.0\+PTX"):
        archs.parse_arch_list("8.0 sm_90")


def _fake_gpus(*caps):
    return lambda: [(f"GPU{c[0]}{c[1]}", c) for c in caps]


def _choose(cuda_arch="", torch_list=None, gpus=(), nvcc=None):
    env = {} if torch_list is None else {"TORCH_CUDA_ARCH_LIST": torch_list}
    return archs.select(cuda_arch, environ=env, capabilities=_fake_gpus(*gpus), nvcc_supported=lambda: nvcc)


def test_precedence_shardamp_then_torch_list_then_gpus_then_default():
    both = _choose("8.0;9.0", "8.6+PTX", gpus=[(8, 9)])
    assert (both.source, both.arch_list) == ("SHARDAMP_CUDA_ARCH", "8.0;9.0")
    torch_list = _choose("", "8.6+PTX", gpus=[(8, 9)])
    assert (torch_list.source, torch_list.arch_list) == ("TORCH_CUDA_ARCH_LIST", "8.6+PTX")
    gpus = _choose("", None, gpus=[(9, 0), (8, 6), (9, 0)])
    assert (gpus.source, gpus.arch_list) == ("visible GPUs", "8.6;9.0+PTX")
    assert "GPU 0: GPU90 (9.0)" in gpus.reason
    native = _choose("", "native", gpus=[(8, 0)])
    assert native.source.startswith("visible GPUs") and native.arch_list == "8.0+PTX"
    default = _choose("", None)
    assert (default.source, default.arch_list) == ("default", archs.AOT_DEFAULT)
    assert default.gencode_flags() == [
        "-gencode=arch=compute_100,code=sm_100", "-gencode=arch=compute_120,code=compute_120",
        "-gencode=arch=compute_120,code=sm_120", "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_86,code=sm_86", "-gencode=arch=compute_89,code=sm_89",
        "-gencode=arch=compute_90,code=sm_90"]


@pytest.mark.parametrize("caps", [[(8, 0)], [(9, 0)], [(8, 0), (8, 6)], [(8, 6), (9, 0)], [(8, 9), (8, 9)]])
def test_visible_gpus_give_torchs_own_flags(monkeypatch, caps):
    """Unset TORCH_CUDA_ARCH_LIST: torch's parser uses the visible GPUs (faked here) with PTX of
    the highest; so do we. (Lists mixing 9.x and 10.x+ are left out: torch sorts the arch strings
    as text, so "10.0" < "9.0" and its +PTX lands on 9.0; ours goes to the highest capability.)"""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[i])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_86", "sm_90", "sm_100", "sm_120"])
    ours = _choose("", None, gpus=caps)
    assert ours.gencode_flags() == cpp_extension._get_cuda_arch_flags()


def test_gpus_newer_than_nvcc_are_built_as_ptx_of_its_newest():
    choice = _choose("", None, gpus=[(12, 0)], nvcc=[(8, 0), (8, 6), (8, 9), (9, 0)])  # CUDA 12.4
    assert choice.arch_list == "9.0+PTX"
    assert any("12.0 built as 9.0+PTX" in d for d in choice.dropped)
    assert choice.runs_on((12, 0))


def test_default_is_limited_to_what_nvcc_compiles_and_keeps_ptx():
    cuda124 = [(5, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0)]
    choice = _choose("", None, nvcc=cuda124)
    assert choice.arch_list == "8.0;8.6;8.9;9.0+PTX"
    assert len(choice.dropped) == 2 and all("does not compile" in d for d in choice.dropped)
    cuda130 = [(7, 5), (8, 0), (8, 6), (8, 7), (8, 8), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]
    assert _choose("", None, nvcc=cuda130).arch_list == archs.AOT_DEFAULT
    with pytest.raises(ValueError, match="compiles none of the default archs"):
        _choose("", None, nvcc=[(6, 0), (7, 0)])


def test_archs_below_8_0_refused_or_left_out():
    with pytest.raises(ValueError, match=r"SHARDAMP_CUDA_ARCH='7\.5;8\.0': 7\.5 is below compute capability 8\.0"):
        _choose("7.5;8.0")
    image_wide = _choose("", "7.0 7.5 8.0 8.6 9.0+PTX")  # as NGC-style images set it for every extension
    assert image_wide.arch_list == "8.0;8.6;9.0+PTX"
    assert image_wide.dropped == ("7.0 (below 8.0)", "7.5 (below 8.0)")
    with pytest.raises(ValueError, match=r"TORCH_CUDA_ARCH_LIST='Turing'.*SHARDAMP_CUDA_ARCH"):
        _choose("", "Turing")
    with pytest.raises(ValueError, match=r"no visible GPU has compute capability 8\.0.*GPU 0: GPU75 \(7\.5"):
        _choose("", None, gpus=[(7, 5)])
    mixed = _choose("", None, gpus=[(7, 5), (8, 6)])
    assert mixed.arch_list == "8.6+PTX" and "below 8.0" in mixed.dropped[0]


@pytest.mark.parametrize("arch, cap, runs", [
    ("8.0", (8, 0), True), ("8.0", (8, 6), True), ("8.0", (8, 9), True), ("8.6", (8, 0), False),
    ("8.0", (9, 0), False), ("8.0+PTX", (9, 0), True), ("9.0+PTX", (12, 0), True), ("9.0", (10, 0), False),
    ("9.0a", (9, 0), True), ("9.0a+PTX", (10, 0), False), ("12.0", (12, 1), True), ("10.0", (12, 0), False),
])
def test_what_runs_on_which_gpu(arch, cap, runs):
    assert archs.parse_arch_list(arch)[0].runs_on(cap) is runs


def _fake_nvcc(tmp_path, monkeypatch, list_output, version="13.0", v_patch="88"):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\n"
                    f"if [ \"$1\" = --version ]; then echo 'Cuda compilation tools, release {version}, "
                    f"V{version}.{v_patch}'; exit 0; fi\n"
                    + (f"printf '{list_output}'\n" if list_output is not None else "exit 1\n"))
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(archs, "nvcc_path", lambda: str(nvcc))
    archs.clear_cache()


def test_nvcc_arch_list_and_version_table(tmp_path, monkeypatch):
    try:
        _fake_nvcc(tmp_path, monkeypatch, "compute_75\\ncompute_80\\ncompute_90\\ncompute_100\\ncompute_120\\n")
        assert archs.nvcc_archs() == [(7, 5), (8, 0), (9, 0), (10, 0), (12, 0)]
        assert archs.nvcc_version() == (13, 0, 88)
        choice = _choose("", None, nvcc=archs.nvcc_archs())
        assert choice.arch_list == "8.0;9.0;10.0;12.0+PTX"
        _fake_nvcc(tmp_path, monkeypatch, None, version="12.4", v_patch="131")  # cannot list: the table
        assert max(archs.nvcc_archs()) == (9, 0)
        assert archs.unsupported_by_nvcc(archs.ArchChoice(tuple(archs.parse_arch_list("9.0;10.0")), "x", "x")) == ["10.0"]
    finally:
        archs.clear_cache()


def test_build_reads_the_override_through_the_settings(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    set_env(monkeypatch, "SHARDAMP_CUDA_ARCH", "Hopper")
    choice = build.cuda_archs()
    assert (choice.source, choice.arch_list) == ("SHARDAMP_CUDA_ARCH", "9.0+PTX")
    set_env(monkeypatch, "SHARDAMP_CUDA_ARCH", "")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    assert build.cuda_archs().arch_list == "8.0;9.0a"
    # the module name carries the archs: another list builds into another directory
    src = build.source_dir()
    var = build.current_variant(True)
    assert build.jit_name(var, ["-gencode=arch=compute_80,code=sm_80"], src) != build.jit_name(var, [], src)
    assert os.path.basename(build.jit_name(var, [], src)).startswith("shardamp_kernels_cuda_")


def test_several_archs_compile_in_parallel_without_changing_the_module_name(tmp_path):
    captured = {}

    def load(**kwargs):
        captured.update(kwargs)
        return "module"

    var, src = build.current_variant(True), build.source_dir()
    gencode = archs.gencode_flags(archs.parse_arch_list(archs.AOT_DEFAULT))
    assert build._load_jit(load, var, src, "name", str(tmp_path), gencode) == "module"
    assert captured["extra_cuda_cflags"] == [*var.cuda_cflags, *gencode, "--threads", "7"]
    build._load_jit(load, var, src, "name", str(tmp_path), gencode[:1])
    assert "--threads" not in captured["extra_cuda_cflags"]  # one target: nothing to parallelise
    assert build.jit_name(var, gencode, src) == f"{var.base}_{build.source_hash(src, [list(var.cflags), {'extra_cuda_cflags': [*var.cuda_cflags, *gencode]}])}"
