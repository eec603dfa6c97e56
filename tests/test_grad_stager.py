"""The backward hook's two implementations (optim/sync/grad_stager.py): the native GradStager (a C++
post hook on each grad accumulator, the default wherever the kernels build) against the
reference PyStager, and whole training loops on the Python hooks, which the default no longer
takes (the core parity cases at several world sizes, against torch.optim.AdamW)."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from shardamp.optim import config
from conftest import set_env

from dist_helper import run_cases, run_distributed
from shardamp.optim import DistributedFusedAdam, kernels
from shardamp.optim.sync import grad_stager
from test_core import PARITY_CASES, check_parity_case, check_staging_case

NATIVE = kernels.native_module(torch.device("cpu"))
needs_native = pytest.mark.skipif(NATIVE is None or not hasattr(NATIVE, "GradStager"),
                                  reason="the CPU kernels did not build")


def _stagers():
    """Three params in two buckets (2 + 1), flush after 40 bytes; the same for both kinds."""
    params = [torch.zeros(4, 3, requires_grad=True), torch.zeros(5, requires_grad=True),
              torch.zeros(2, 2).t().requires_grad_()]  # a transposed (non-contiguous) param
    args = ([p for p in params], [0, 0, 1], [0, 12, 0], [48, 20, 16], [2, 1], [60, 16])
    py = grad_stager.PyStager(*args)
    events = []
    native = NATIVE.GradStager(*args, lambda e, a: events.append((e, a)))
    return params, py, native


@needs_native
def test_native_stager_matches_reference_staging() -> None:
    params, py, native = _stagers()
    out = {}
    for name, st in (("py", py), ("native", native)):
        log = []
        for i, value in ((0, 1.0), (1, 2.0)):
            params[i].grad = torch.full_like(params[i], value)
            log.append(st.stage(i))
            assert params[i].grad is None and st.is_staged(i)
        log.append((st.fired(0), st.staged_bytes(0), st.staged_count(0)))
        params[2].grad = torch.full((2, 2), 3.0).t()
        log.append(st.stage(2))  # 16 >= 16 bytes and the bucket's only param: complete
        idx, grads = st.take(0)
        log.append((idx, [g.tolist() for g in grads], st.staged_count(0), st.is_staged(0), st.fired(0)))
        st.reset_fired()
        log.append((st.fired(0), st.fired(1)))
        st.clear()
        log.append((st.staged_count(1), st.is_staged(2)))
        out[name] = log
    assert out["py"] == out["native"]
    assert out["py"][:2] == [grad_stager.NONE, grad_stager.COMPLETE]
    assert out["py"][2] == (2, 68, 2) and out["py"][3] == grad_stager.COMPLETE


@needs_native
def test_native_land_equals_reference_land_grads() -> None:
    from shardamp.optim.kernels import reference

    params, _, native = _stagers()
    full = torch.zeros(17)
    expect = torch.zeros(17)
    grads = [torch.randn(4, 3), torch.randn(5)]
    for i, g in enumerate(grads):
        params[i].grad = g.clone()
        native.stage(i)
    landed = native.land(0, full)
    reference.land_grads(expect, grads, params[:2], [0, 12], accumulate=False)
    assert landed == [0, 1] and torch.equal(full, expect) and native.staged_count(0) == 0
    # a non-contiguous param lands with its own strides, as its view of the buffer has them
    g = torch.arange(4.0).reshape(2, 2).t()
    params[2].grad = g.clone()
    native.stage(2)
    flat = torch.zeros(4)
    native.land(1, flat)
    assert torch.equal(flat.as_strided((2, 2), params[2].stride()), g)


def _model_and_opt(**kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    return model, DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-4, **kw)


@needs_native
def test_default_hooks_are_native_and_removed_with_the_optimizer() -> None:
    model, opt = _model_and_opt()
    stager = opt._grad_sync.stager
    assert type(stager).__name__ == "GradStager" and stager.hooks() == 4
    opt._grad_sync.remove_hooks()
    assert stager.hooks() == 0
    model(torch.randn(3, 6)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())  # nobody took them


@pytest.mark.parametrize("python_hooks", ["0", "1"])
def test_newest_optimizer_owns_the_params(monkeypatch, python_hooks: str) -> None:
    """A second optimizer over the same params takes their grads; the first one's hook stands
    aside (its shards stay empty), as before, with either hook."""
    set_env(monkeypatch, "SHARDAMP_PYTHON_GRAD_HOOKS", python_hooks)
    model, first = _model_and_opt()
    second = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-4)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    ref.load_state_dict(model.state_dict())
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=second.defaults["weight_decay"])
    for _ in range(3):
        x = torch.randn(3, 6)
        for m, o in ((model, second), (ref, ropt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    assert not any(first._grad_sync.local_touched)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("python_hooks", ["0", "1"])
def test_sparse_grad_raises_at_backward(monkeypatch, python_hooks: str) -> None:
    set_env(monkeypatch, "SHARDAMP_PYTHON_GRAD_HOOKS", python_hooks)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = DistributedFusedAdam(emb.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        emb(torch.tensor([1, 2])).sum().backward()
    opt.zero_grad()  # recovers: the next sparse grad is refused alike, not met by a stale state
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        emb(torch.tensor([3])).sum().backward()


def test_user_post_accumulate_hook_sees_the_grad_with_native_hooks() -> None:
    """The native hook runs after the params' own post-accumulate-grad hooks (it is a post hook
    of the accumulator): a user's hook sees the grad whatever the registration order."""
    model, opt = _model_and_opt()
    native = type(opt._grad_sync.stager).__name__ == "GradStager"
    seen = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    model(torch.randn(3, 6)).sum().backward()
    assert len(seen) == 4 and all(seen) == native
    from shardamp.optim import _compat

    # the hooks took every grad: autograd's field is empty (p.grad shows the optimizer's: torch_tools.py)
    assert all(_compat.raw_grad(p) is None for p in model.parameters())


# ------------------------------------------------------------------ whole loops on the Python hooks
def _run_with_python_hooks(rank: int, world: int, names):
    os.environ["SHARDAMP_PYTHON_GRAD_HOOKS"] = "1"
    config.reload()  # settings are read once per process
    out = run_cases(rank, world, "cases_core", names)
    probe = DistributedFusedAdam([torch.nn.Parameter(torch.ones(3))], lr=1.0)
    out["stager"] = ("ok", type(probe._grad_sync.stager).__name__)
    return out


@functools.lru_cache(maxsize=None)
def _python_hook_results(world: int):
    names = PARITY_CASES + ["case_grad_staging_and_release"]
    return run_distributed(_run_with_python_hooks, world, names)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("case", PARITY_CASES)
def test_python_hooks_parity_with_torch_adamw(world: int, case: str) -> None:
    check_parity_case(_python_hook_results(world), case)


@pytest.mark.parametrize("world", [1, 3])
def test_python_hooks_staging_bounded(world: int) -> None:
    results = _python_hook_results(world)
    assert {r["stager"] for r in results} == {("ok", "PyStager")}
    check_staging_case(results, world)


@needs_native
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16])
def test_native_land_mixed_layouts_and_dtypes(buffer_dtype, device) -> None:
    """Grads with their param's strides and the buffer's dtype are copied as byte ranges (on
    CUDA by the batched kernel, at 16-, 4- and 2-byte alignments: the 3-element gaps), any other
    (other strides, other dtype: the bf16 buffer, a large CPU grad) through a view: all equal
    the reference."""
    from shardamp.optim.kernels import reference

    native = kernels.native_module(torch.device(device))
    torch.manual_seed(0)
    params = [torch.zeros(2, 3, 4, 5, device=device).contiguous(memory_format=torch.channels_last),
              torch.zeros(7, device=device), torch.zeros(300_000, device=device),
              torch.zeros(3, 4, device=device).t(), torch.zeros(33, 17, device=device)]
    params = [p.requires_grad_() for p in params]
    grads = [torch.randn(2, 3, 4, 5, device=device),  # contiguous grad for a channels_last param: a view
             torch.randn(7, device=device),
             torch.randn(300_000, device=device),  # over 1 MiB on the CPU: a view (copy_ uses the thread pool)
             torch.randn(3, 4, device=device).t(),  # the param's own (transposed) strides: a byte range
             torch.randn(33, 17, device=device)]
    offsets, off = [], 0
    for p in params:
        offsets.append(off)
        off += p.numel() + 3  # gaps stay zero
    n = len(params)
    stager = native.GradStager(params, [0] * n, offsets, [p.numel() * 4 for p in params], [n], [1 << 30],
                               lambda e, a: None)
    for i, (p, g) in enumerate(zip(params, grads)):
        p.grad = g.clone()
        stager.stage(i)
    full = torch.zeros(off, dtype=buffer_dtype, device=device)
    expect = torch.zeros(off, dtype=buffer_dtype, device=device)
    assert stager.land(0, full) == list(range(n))
    reference.land_grads(expect, grads, params, offsets, accumulate=False)
    assert torch.equal(full, expect)
    assert stager.touched() == b"\x01" * n
    stager.clear_touched()
    assert stager.touched() == b"\x00" * n
    # the shared kernel on its own: a second landing adds (every add goes through views), and the
    # byte-range copy and the views agree with torch's own ops for a fresh buffer too
    native.land_grads(full, grads, params, offsets, True)
    reference.land_grads(expect, grads, params, offsets, accumulate=True)
    torch.testing.assert_close(full, expect, rtol=0, atol=0)
    fresh = torch.full((off,), 7.0, dtype=buffer_dtype, device=device)
    native.land_grads(fresh, grads, params, offsets, False)
    reference.land_grads(expect.fill_(7.0), grads, params, offsets, accumulate=False)
    assert torch.equal(fresh, expect)
    # zero_rest through the stager, views included, and a param that is not dense (every other
    # element of its span written: the others are zeroed); the garbage is NaN
    sparse_param = torch.zeros(12, device=device)[::2].requires_grad_()
    params2, grads2 = params + [sparse_param], grads + [torch.randn(6, device=device)]
    offsets2, n2 = offsets + [off], n + 1
    stager = native.GradStager(params2, [0] * n2, offsets2, [p.numel() * 4 for p in params2], [n2], [1 << 30],
                               lambda e, a: None)
    for i, (p, g) in enumerate(zip(params2, grads2)):
        p.grad = g.clone()
        stager.stage(i)
    garbage = torch.full((off + 12,), float("nan"), dtype=buffer_dtype, device=device)
    assert stager.land(0, garbage, True) == list(range(n2))
    expect = torch.zeros(off + 12, dtype=buffer_dtype, device=device)
    reference.land_grads(expect, grads2, params2, offsets2, accumulate=False)
    assert torch.equal(garbage, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_native_land_byte_ranges_of_every_size(dtype, device) -> None:
    """The byte-range copy over more grads than one launch takes (112 on CUDA), of sizes around
    its 64 KiB chunk and far above it (several MiB: many chunks of one grad, spread over the
    grid), empty ones, and odd element counts (2-byte alignment in a bf16 buffer): the buffer
    equals the reference, gaps and all."""
    from shardamp.optim.kernels import reference

    native = kernels.native_module(torch.device(device))
    if native is None:
        pytest.skip("the kernels did not build")
    item = torch.empty((), dtype=dtype).element_size()
    sizes = [0, 1, 5, 4096 // item, (64 << 10) // item - 1, (64 << 10) // item, (64 << 10) // item + 3,
             (3 << 20) // item + 7, (9 << 20) // item, 123_457] * 6 + [3] * 64  # 118 to copy: 2 launches
    gen = torch.Generator().manual_seed(1)
    params = [torch.zeros(n, dtype=dtype, device=device, requires_grad=True) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(dtype=dtype, device=device) for n in sizes]
    offsets, off = [], 0
    for i, n in enumerate(sizes):
        offsets.append(off)
        off += n + i % 3  # shifts the alignment of the slots that follow
    full = torch.full((off,), 1000.0, dtype=dtype, device=device)  # randn never gives it
    expect = full.clone()
    native.land_grads(full, grads, params, offsets, False)
    reference.land_grads(expect, grads, params, offsets, accumulate=False)
    assert torch.equal(full, expect)
    gaps = int((full == 1000.0).sum())
    assert gaps == sum(i % 3 for i in range(len(sizes)))  # untouched
    # zero_rest: a buffer of garbage (allocated uninitialized) ends as zeros plus the copies, the
    # zeroing ranges joining the copies' launches (more ranges than one launch takes here)
    zeros_then_copies = torch.zeros(off, dtype=dtype, device=device)
    reference.land_grads(zeros_then_copies, grads, params, offsets, accumulate=False)
    for land in (native.land_grads, reference.land_grads):
        garbage = torch.full((off,), 1000.0, dtype=dtype, device=device)
        land(garbage, grads, params, offsets, False, True)
        assert torch.equal(garbage, zeros_then_copies), land
    nothing = torch.full((off,), 1000.0, dtype=dtype, device=device)  # no grad landed: all zeroed
    native.land_grads(nothing, [], [], [], False, True)
    assert int(torch.count_nonzero(nothing)) == 0
    some = torch.full((off,), 1000.0, dtype=dtype, device=device)  # every other grad: the rest zeroed
    native.land_grads(some, grads[::2], params[::2], offsets[::2], False, True)
    expect = torch.zeros(off, dtype=dtype, device=device)
    reference.land_grads(expect, grads[::2], params[::2], offsets[::2], accumulate=False)
    assert torch.equal(some, expect)
    with pytest.raises(RuntimeError, match="zero_rest"):
        native.land_grads(full, grads, params, offsets, True, True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_native_land_takes_grads_whose_strides_differ_only_in_size_one_dims_as_byte_ranges(device) -> None:
    """A channels_last 1x1 conv weight (strides (C, 1, C, C)) gets a contiguous grad (strides
    (C, 1, 1, 1)) from autograd: the same element addresses, so a byte range, no view and no
    multi-tensor copy (torch.profiler sees none); the values equal the reference."""
    from torch.profiler import profile

    from shardamp.optim.kernels import reference

    native = kernels.native_module(torch.device(device))
    if native is None:
        pytest.skip("the kernels did not build")
    params = [torch.zeros(6, 5, 1, 1, device=device).to(memory_format=torch.channels_last),
              torch.zeros(1, 7, device=device).t()]  # strides (1, 7) against a grad's (1, 1)
    grads = [torch.randn(6, 5, 1, 1, device=device), torch.randn(7, 1, device=device)]
    assert all(g.stride() != p.stride() for g, p in zip(grads, params))
    offsets = [0, 31]
    full = torch.zeros(40, device=device)
    expect = torch.zeros(40, device=device)
    with profile() as prof:
        native.land_grads(full, grads, params, offsets, False)
    names = {e.name for e in prof.events()}
    assert not names & {"aten::_foreach_copy_", "aten::as_strided", "aten::copy_"}, names
    reference.land_grads(expect, grads, params, offsets, accumulate=False)
    assert torch.equal(full, expect)


def test_capturable_takes_the_python_hooks() -> None:
    """A native hook holds the grad accumulators (made on the construction stream): a CUDA-graph
    capture on its own stream would wait on that stream, so capturable optimizers hook in Python."""
    _, opt = _model_and_opt(capturable=True)
    assert type(opt._grad_sync.stager).__name__ == "PyStager"


@needs_native
def test_hooks_removed_inside_a_backward_are_disarmed_not_erased() -> None:
    """Removing the native hooks while a backward runs (an older optimizer collected from a
    callback) must not erase from the post-hook list torch is iterating: they are disarmed and
    do nothing from then on; outside a backward they are erased."""
    model, opt = _model_and_opt()
    gs = opt._grad_sync
    calls = []

    def remove_now(_p):
        if not calls:
            gs.remove_hooks()
        calls.append(1)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(remove_now)
    model(torch.randn(3, 6)).sum().backward()
    assert gs.stager.hooks() == 0 and len(calls) == 4
    # the hook of the first param ran after its (user) hook disarmed it: nothing was staged
    assert all(p.grad is not None for p in model.parameters())
