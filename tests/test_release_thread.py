"""The release thread of the grad landing (csrc/grad_release.h): landed grads staged by the C++
hook are freed off the autograd thread, one batch at a time, Python-seen grads inline, drained
by zero_grad; on CUDA by default, on the CPU when a test asks (``_release_cpu_too``), so the CPU
suite runs its logic: a unit test with the thread held, the core parity cases at world 1 and 2
against torch.optim.AdamW with it, and a forked child."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from dist_helper import run_cases, run_distributed
from shardamp.optim import kernels
from test_core import PARITY_CASES, check_parity_case, check_staging_case

NATIVE = kernels.native_module(torch.device("cpu"))
needs_native = pytest.mark.skipif(NATIVE is None or not hasattr(NATIVE, "_release_cpu_too"),
                                  reason="the CPU kernels did not build")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("async_release", [True, False])
def test_native_land_frees_landed_grads_on_the_release_thread(async_release: bool, device: str) -> None:
    """Grads staged by the hook (a real backward) are, once landed, handed to the release thread:
    held there, their memory stays allocated and one batch is pending until the thread runs;
    ``drain()`` returns once they are freed. ``set_async_release(False)``: ``land`` frees them
    itself. A grad staged from Python (``stage``) is freed by ``land`` either way, and while one
    batch is pending the next landing frees inline (one batch at a time). The buffer always
    equals the reference, and no drain waits unboundedly. On the CPU (where only tests send
    grads to the thread: ``_release_cpu_too``) the same, without the memory counts."""
    import threading

    from shardamp.optim.kernels import reference

    native = kernels.native_module(torch.device(device))
    if native is None or not hasattr(native, "_hold_release"):
        pytest.skip("the kernels did not build")
    cuda = device == "cuda"

    def allocated() -> int:
        return torch.cuda.memory_allocated() if cuda else 0

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    sizes = [1 << 20, 3, 4097, 1 << 18] * 40  # 160 grads, as many as ResNet-50's
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    params = [torch.zeros(n, device=device, requires_grad=True) for n in sizes]
    weights = [torch.randn(n, device=device) for n in sizes]
    grad_bytes = sum(sizes) * 4 if cuda else 0  # (no count on the CPU: every ">=" holds)
    stager = native.GradStager(params, [0] * len(sizes), offsets, [n * 4 for n in sizes], [len(sizes)], [1 << 40],
                               lambda e, a: None)
    stager.attach()
    full = torch.zeros(sum(sizes), device=device)
    expect = torch.zeros_like(full)
    reference.land_grads(expect, weights, params, offsets, accumulate=False)

    def drain() -> None:
        t = threading.Thread(target=stager.drain, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "drain() did not return"

    def backward() -> None:
        stager.set_armed(True)  # every grad through the C++ hook: staged without Python
        sum((p * w).sum() for p, w in zip(params, weights)).backward()
        stager.set_armed(False)
        sync()

    native.set_async_release(async_release)
    native._release_cpu_too(not cuda)
    try:
        drain()
        for rep in range(2):
            backward()
            assert stager.staged_count(0) == len(sizes) and all(p.grad is None for p in params)
            before = allocated()
            native._hold_release(True)
            try:
                full.zero_()
                assert sorted(stager.land(0, full)) == list(range(len(sizes)))  # in staging order
                sync()
                after = allocated()
                if async_release:
                    assert native.released_pending() == 1 and (not cuda or before - after < grad_bytes), rep
                else:
                    assert native.released_pending() == 0 and before - after >= grad_bytes, rep
            finally:
                native._hold_release(False)
            drain()
            assert native.released_pending() == 0
            assert before - allocated() >= grad_bytes, rep  # every staged grad freed
            assert torch.equal(full, expect), rep
        if async_release:  # one batch at a time: a landing while one is held frees inline
            native._hold_release(True)
            try:
                backward()
                stager.land(0, full)
                backward()
                before = allocated()
                stager.land(0, full)
                assert native.released_pending() == 1
                assert before - allocated() >= grad_bytes  # the second batch: inline
            finally:
                native._hold_release(False)
            drain()
        # a grad Python staged (stage(): the first grad of every backward) is freed by land itself
        native._hold_release(True)
        try:
            for i, p in enumerate(params):
                p.grad = weights[i].clone()
                stager.stage(i)
            before = allocated()
            stager.land(0, full)
            assert native.released_pending() == 0 and before - allocated() >= grad_bytes
        finally:
            native._hold_release(False)
        assert torch.equal(full, expect)
    finally:
        native.set_async_release(True)
        native._release_cpu_too(False)
        stager.remove(True)


def _run_with_release_thread(rank: int, world: int, names):
    native = kernels.native_module(torch.device("cpu"))
    native._release_cpu_too(True)  # landed CPU grads take the release thread, as CUDA ones do
    out = run_cases(rank, world, "cases_core", names)
    native.drain_released()
    out["released"] = ("ok", (native.released_total(), native.released_pending()))
    return out


@functools.lru_cache(maxsize=None)
def _release_thread_results(world: int):
    return run_distributed(_run_with_release_thread, world, PARITY_CASES + ["case_grad_staging_and_release"])


@needs_native
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", PARITY_CASES)
def test_release_thread_parity_with_torch_adamw(world: int, case: str) -> None:
    """The core parity cases (uneven shards, param groups, an inf on one rank, accumulation,
    clipping) with every landed grad freed on the release thread: the same as torch.optim.AdamW."""
    check_parity_case(_release_thread_results(world), case)


@needs_native
@pytest.mark.parametrize("world", [1, 2])
def test_release_thread_staging_bounded(world: int) -> None:
    results = _release_thread_results(world)
    check_staging_case(results, world)
    for r in results:  # the thread freed batches of every rank, and drains to nothing
        total, pending = r["released"][1]
        assert total > 10 and pending == 0, r["released"]


_FORK_SCRIPT = r"""
import os, sys, torch
from shardamp.optim import kernels
native = kernels.native_module(torch.device("cpu"))
native._release_cpu_too(True)
params = [torch.zeros(1000, requires_grad=True) for _ in range(4)]
stager = native.GradStager(params, [0] * 4, [0, 1000, 2000, 3000], [4000] * 4, [4], [1 << 40], lambda e, a: None)
stager.attach()

def land():
    stager.set_armed(True)
    sum(p.sum() for p in params).backward()
    stager.set_armed(False)
    stager.land(0, torch.zeros(4000))

land()
native.drain_released()
assert native.released_total() == 1, native.released_total()
native._hold_release(True)  # the parent's thread holds a batch (and may hold its lock) at the fork
land()
pid = os.fork()
if pid == 0:  # the child: no thread of its own, never the parent's lock; frees inline
    land()
    native.drain_released()
    os._exit(0 if native.released_pending() == 0 and native.released_total() == 0 else 3)
_, status = os.waitpid(pid, 0)
native._hold_release(False)
native.drain_released()
assert native.released_pending() == 0
print("child", os.waitstatus_to_exitcode(status))
"""


@needs_native
def test_release_thread_in_a_forked_child_frees_inline() -> None:
    """A process forked while the parent's release thread holds a batch never waits on the
    parent's thread or lock: its landings free inline and its drain returns at once."""
    import subprocess
    import sys

    # no GPU visible to the script (it uses none): with one visible, the parent's first backward
    # (even a CPU one) starts autograd's device threads, and torch then refuses any backward in a
    # forked child (its fork poisoning)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "child 0" in out.stdout, (out.stdout, out.stderr[-2000:])
