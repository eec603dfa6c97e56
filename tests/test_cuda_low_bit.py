"""Blockwise moments ("8bit" / "4bit") on CUDA (csrc/cuda/adam_step_blockwise.cu), needs a GPU:
the kernel against the reference (on the CPU, the spec) in every state kind the CPU kernel takes,
step by step from the same state: at most one code step per element and the params within the
documented fp32 tolerance (csrc/NOTES.md), and bitwise where the arithmetic is the same (it is
written to be); DistributedFusedAdam at world 1 on CUDA against the same optimizer on the CPU
over several steps; a capturable step captured in a CUDA graph and replayed against eager steps;
memory_stats' bytes of codes and scales; blocks too large for the CUDA tile refused at
construction."""
from __future__ import annotations

import itertools

import pytest
import torch

import blockwise_cases as bc
import cases_checkpoint as cc
from shardamp.optim import DistributedFusedAdam, kernels, state_formats as sf
from shardamp.optim.kernels import quant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
# the params' agreement with the reference: the kernel's operations are the reference's, each
# rounded once (no FMA contraction: explicitly rounded intrinsics), so this bound is a margin;
# a moment's code may land one step off where its value sits on a midpoint within that margin
PARAM_RTOL, PARAM_ATOL = 1e-6, 1e-7


@pytest.fixture(scope="module", autouse=True)
def _native_cuda():
    if kernels.backend(CUDA) != "native":
        pytest.fail("the CUDA kernels did not build: python -m shardamp.report --build")
    ext = kernels.native_module(CUDA)
    assert hasattr(ext, "adam_step_blockwise"), "the CUDA module lacks the blockwise step"


def _compare(ref, got, where):
    """ref on the CPU, got on CUDA: codes within one step, scales and float moments close, params
    within the tolerance. Returns whether everything is bitwise equal."""
    got = {k: bc.to(v, CPU) for k, v in got.items()}
    for key in ("m", "v"):
        a, b = ref[key], got[key]
        if isinstance(a, quant.QuantizedShard):
            assert bc.code_steps(a, b) <= 1, (where, key)
            torch.testing.assert_close(b.scales, a.scales, rtol=1e-5, atol=0, msg=f"{where} {key} scales")
        else:
            torch.testing.assert_close(b.float(), a.float(), rtol=1e-5, atol=1e-12, msg=f"{where} {key}")
    torch.testing.assert_close(bc.param_values(got), bc.param_values(ref), rtol=PARAM_RTOL, atol=PARAM_ATOL,
                               msg=f"{where} params")
    return bc.differences(ref, got) == []


@pytest.mark.parametrize("master", bc.MASTERS)
@pytest.mark.parametrize("pair", bc.MOMENT_PAIRS, ids=bc.case_id)
def test_cuda_step_against_the_reference(pair, master):
    """Every moment pair with a blockwise moment, every master kind, fp32 / bf16 / fp16 grads,
    AdamW and Adam, several groups, an untouched param, padding, a partial last block, a nonzero
    block offset; three steps, the second skipped on found-inf; each step from the reference's
    state."""
    bitwise = _BITWISE.setdefault(bc.case_id(pair, master), [])
    for gi, (gdt, adam_w) in enumerate(itertools.product(bc.GRAD_DTYPES, (True, False))):
        state = bc.make_state(pair, master, seed=gi, device=CPU)
        grads = bc.grads(3, gdt, seed=gi, device=CPU)
        for k, g in enumerate(grads):
            found = (0,) if k == 1 else ()
            done = k - (k > 1)  # the skipped step advanced nothing
            ref = bc.run(state, [g], adam_w, native=False, found_inf_at=found, steps_done=done)
            got = bc.run({key: bc.to(v, CUDA) for key, v in state.items()}, [g.to(CUDA)], adam_w, native=True,
                         found_inf_at=found, steps_done=done)
            bitwise.append(_compare(ref, got, (gdt, adam_w, k)))
            if found:
                assert bc.differences(state, {key: bc.to(v, CPU) for key, v in got.items()}) == [], "skip wrote"
            state = ref


_BITWISE = {}  # case -> per step: bitwise the reference


def test_every_step_above_was_bitwise_the_reference():
    """The kernel's arithmetic is the reference's, operation for operation (csrc/NOTES.md): beyond
    the contract above, every step of test_cuda_step_against_the_reference was bitwise."""
    if not _BITWISE:
        pytest.skip("run with test_cuda_step_against_the_reference")
    off = {case: steps.count(False) for case, steps in _BITWISE.items() if not all(steps)}
    assert off == {}, f"steps not bitwise the reference, by case: {off}"


def _exact_loss(model, step):
    """sum(p * c) with c exact dyadic numbers: the grads are c on every device, bit for bit."""
    g = torch.Generator().manual_seed(500 + step)
    loss = 0.0
    for p in model.parameters():
        c = torch.randint(-8, 9, p.shape, generator=g).float() / 16 * 2.0 ** -torch.randint(0, 20, p.shape, generator=g)
        loss = loss + (p.float() * c.to(p.device)).sum()
    return loss


CONFIGS = {
    "q8": (torch.float32, dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit")),
    "q4": (torch.float32, dict(exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit")),
    "q8_q4_block64": (torch.float32, dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit", quant_block_size=64)),
    "bf16_q4": (torch.float32, dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype="4bit")),
    "remainders_q8": (torch.bfloat16, dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit",
                                           store_param_remainders=True)),
}


def _train(device, name, steps=8, **extra):
    dtype, opts = CONFIGS[name]
    model, opt = cc.build(dtype=dtype, device=device, **opts, **extra)
    for step in range(steps):
        _exact_loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    opt.param_sync()
    return model, opt


@pytest.mark.parametrize("name", list(CONFIGS))
def test_optimizer_on_cuda_tracks_the_cpu_run(name):
    """DistributedFusedAdam at world 1 over 8 steps of exact grads: CUDA (the kernel) against the
    CPU (bitwise the reference). Where the steps are bitwise (test above) so is this; the bounds
    leave room for a code step's difference carried through later steps (a 4-bit second moment's
    step moves an update by a fraction of lr): params within 1e-3 (each moves up to 8 * 2e-2),
    codes within two steps, scales to 1e-3."""
    cuda_model, cuda_opt = _train("cuda", name)
    cpu_model, cpu_opt = _train("cpu", name)
    for a, b in zip(cuda_model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(a.detach().float().cpu(), b.detach().float(), rtol=1e-4, atol=1e-3)
    sd_cuda, sd_cpu = cuda_opt.state_dict(), cpu_opt.state_dict()
    for i, entry in sd_cpu["state"].items():
        for key, value in entry.items():
            other = sd_cuda["state"][i][key]
            if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:  # codes, one per element
                assert int((other.cpu().int() - value.int()).abs().max()) <= 2, (i, key)
            elif isinstance(value, torch.Tensor) and value.is_floating_point():
                rtol = 1e-3 if value.dtype == torch.float32 else 2 ** -7  # bf16 moments: one ulp
                torch.testing.assert_close(other.cpu().float(), value.float(), rtol=rtol, atol=1e-9)


def test_capturable_step_in_a_cuda_graph_matches_eager():
    """capturable=True with 8-bit / 4-bit moments: backward and step captured in one CUDA graph
    and replayed (the kernel reads found-inf, the grad coefficient and the step counts on the
    device), against the same steps run eagerly."""
    def build():  # one group with a tensor lr, as test_cuda_graph.py's capturable optimizer
        model = cc.new_model(device="cuda")
        return model, DistributedFusedAdam(model.parameters(), lr=torch.tensor(1e-2, device="cuda"), weight_decay=0.01,
                                           exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit", capturable=True)

    model, opt = build()
    eager_model, eager_opt = build()
    coefs = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).cuda()
             for i, p in enumerate(model.parameters())]
    scale = torch.ones((), device="cuda")

    def iteration(m, o):
        o.zero_grad(set_to_none=True)
        sum((p * c).sum() for p, c in zip(m.parameters(), coefs)).mul(scale).backward()
        o.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            iteration(model, opt)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iteration(model, opt)
    for _ in range(3):
        iteration(eager_model, eager_opt)
    for step in range(6):
        scale.fill_(1.0 + 0.5 * step)
        graph.replay()
        iteration(eager_model, eager_opt)
        torch.cuda.synchronize()
        for a, b in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"step {step}")
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), cc.new_model(device="cuda").parameters()))


@pytest.mark.parametrize("name", ["q8", "q4", "q8_q4_block64", "bf16_q4"])
def test_memory_stats_count_codes_and_scales_on_cuda(name):
    _, opts = CONFIGS[name]
    model, opt = _train("cuda", name, steps=1)
    shard = sum(b.shard_numel for b in opt._buckets)
    per = 0.0
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        value = opts.get(key)
        fmt = {"8bit": sf.Q8, "4bit": sf.Q4, torch.bfloat16: sf.BF16}[value]
        block = opts.get("quant_block_size") or fmt.block_size
        per += fmt.bits / 8 + (4 / block if fmt.blockwise else 0)
    assert opt.memory_stats()["moments"] == shard * per
    for buf in opt._buffers:  # the codes and scales live on the GPU
        for _, fmt, stored in buf.moments():
            tensors = [stored.codes, stored.scales] if fmt.blockwise else [stored]
            assert all(t.is_cuda for t in tensors)


def test_blocks_larger_than_the_cuda_tile_are_refused_at_construction():
    with pytest.raises(ValueError, match="quant_block_size=4096.*at most 2048"):
        DistributedFusedAdam(cc.new_model(device="cuda").parameters(), exp_avg_dtype="8bit",
                             quant_block_size=4096)
