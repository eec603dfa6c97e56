"""The step over blockwise moments (optim/kernels/reference.py over quant.QuantizedShard, through
the dispatcher): shards cut on the block grid give bitwise the same codes, scales and params at
1, 2 and 4 shards (uneven shards, several groups, an untouched param, several buckets), the skip
flag writes nothing, the 4-bit second moment's zero-code rule holds through the step, the result
tracks torch.optim.AdamW, bf16 params with remainders, CUDA tensors without the kernel are refused;
the compiled CPU step is bitwise the reference in every state kind; the buffers allocate codes and
scales per the format declaration and memory_stats counts them exactly."""
from __future__ import annotations

import itertools

import pytest
import torch

import blockwise_cases as bc
from shardamp.optim import kernels, state_formats as sf
from shardamp.optim.kernels import blockwise, quant
from shardamp.optim.layout import ALIGN, build_layout

FORMAT_PAIRS = [(sf.Q8, sf.Q8), (sf.Q4, sf.Q4), (sf.Q8, sf.Q4), (sf.FP32, sf.Q4), (sf.Q8, sf.BF16)]
SIZES = [(300, 0), (7, 1), (33, 1), (129, 0), (1000, 2), (5, 2), (260, 0)]  # (numel, group)
HPARAMS = torch.tensor([[1e-2, 0.9, 0.999, 1e-8, 0.1], [3e-3, 0.8, 0.95, 1e-6, 0.0],
                        [2e-2, 0.9, 0.99, 1e-8, 0.01]], dtype=torch.float64)
UNTOUCHED = 3


def _moment(fmt, signed, n, offset):
    if fmt.blockwise:
        return quant.QuantizedShard.zeros(fmt, signed, n, offset, torch.device("cpu"))
    return torch.zeros(n, dtype=fmt.storage_dtype)


def _run_shards(formats, world, cap, steps_n, grads, found_inf_at=(), adam_w=True):
    """Every rank's shards after ``steps_n`` steps of ``grads[step][param]`` (the same full grads
    at every world size, as an average over ranks gives them), as the optimizer's launches hold them."""
    params = [(torch.randn(n, generator=torch.Generator().manual_seed(i)), g) for i, (n, g) in enumerate(SIZES)]
    grid = sf.MomentFormats(*formats).grid(ALIGN)
    out = []
    for rank in range(world):
        buckets = build_layout(params, cap, world, rank, grid)
        launches = []
        for b in buckets:
            full = torch.zeros(b.numel)
            for s in b.slots:
                full[s.offset:s.offset + s.numel] = params[s.index][0]
            shard = slice(b.shard_start, b.shard_start + b.shard_numel)
            launches.append((b, shard, full[shard].clone(), _moment(formats[0], True, b.shard_numel, b.shard_start),
                             _moment(formats[1], False, b.shard_numel, b.shard_start)))
        out.append(launches)
    steps = [torch.zeros(len(SIZES)) for _ in range(world)]
    touched = torch.ones(len(SIZES))
    touched[UNTOUCHED] = 0
    for k in range(steps_n):
        found = torch.tensor(1.0 if k in found_inf_at else 0.0)
        for rank in range(world):
            steps[rank].add_(touched * (1 - found))
            for b, shard, master, m, v in out[rank]:
                gfull = torch.zeros(b.numel)
                for s in b.slots:
                    gfull[s.offset:s.offset + s.numel] = grads[k][s.index]
                kernels.adam_step(gfull[shard].clone(), master, m, v, None, b.segments, HPARAMS, steps[rank], touched,
                                  torch.tensor(0.5), found, adam_w, True)
    return out, params


def _grads(steps_n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps_n):
        # magnitudes over 6 decades inside every param: blocks with tiny and large second moments
        out.append([torch.randn(n, generator=g) * 10.0 ** (torch.rand(n, generator=g) * 6 - 4) for n, _ in SIZES])
    return out


def _gathered(out, world, key):
    """The bucket-wide codes / scales / masters, each bucket's shards concatenated."""
    per_bucket = []
    for bi in range(len(out[0])):
        parts = []
        for rank in range(world):
            b, shard, master, m, v = out[rank][bi]
            t = {"master": master, "m": m, "v": v}[key[0]]
            parts.append(t if isinstance(t, torch.Tensor) else getattr(t, key[1]))
        per_bucket.append(torch.cat(parts))
    return per_bucket


@pytest.mark.parametrize("formats", FORMAT_PAIRS, ids=lambda f: "-".join(x.name for x in f))
@pytest.mark.parametrize("cap", [100.0, 0.004])  # one bucket; several
def test_states_are_bitwise_the_same_at_world_1_2_4(formats, cap):
    grads = _grads(6)
    ref, _ = _run_shards(formats, 1, cap, 6, grads)
    for world in (2, 4):
        got, _ = _run_shards(formats, world, cap, 6, grads)
        for key in [("master", None), ("m", "codes"), ("m", "scales"), ("v", "codes"), ("v", "scales")]:
            for a, b in zip(_gathered(ref, 1, key), _gathered(got, world, key)):
                n = a.numel()  # beyond world 1's bucket: only padding blocks (zeros) at a larger world
                assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                                   (b[:n].view(torch.uint8) if b.is_floating_point() else b[:n])), (world, key)
                if key[1] != "codes":  # a padding block's codes are the zero code, not 0
                    assert not b[n:].any(), (world, key)


@pytest.mark.parametrize("formats", FORMAT_PAIRS[:3], ids=lambda f: "-".join(x.name for x in f))
def test_skip_flag_writes_nothing(formats):
    grads = _grads(3)
    a, _ = _run_shards(formats, 2, 100.0, 2, grads)
    b, _ = _run_shards(formats, 2, 100.0, 3, grads[:2] + [[g * float("nan") for g in grads[2]]], found_inf_at=(2,))
    for key in [("master", None), ("m", "codes"), ("m", "scales"), ("v", "codes"), ("v", "scales")]:
        for x, y in zip(_gathered(a, 2, key), _gathered(b, 2, key)):
            assert torch.equal(x, y), key


def test_untouched_param_keeps_its_values_and_others_move():
    grads = _grads(4)
    out, params = _run_shards((sf.Q8, sf.Q4), 2, 100.0, 4, grads)
    for rank in range(2):
        for b, shard, master, m, v in out[rank]:
            for s in b.segments.segments:
                got = master[s.start:s.start + s.length]
                init = params[s.param_index][0][s.param_offset:s.param_offset + s.length]
                assert torch.equal(got, init) == (s.param_index == UNTOUCHED)


@pytest.mark.parametrize("fmt", [sf.Q4, sf.Q8], ids=lambda f: f.name)
def test_zero_code_rule_through_the_step(fmt):
    """A block holding one grad 1e6 times its neighbours': their second moments are far below a
    code step of the block's absmax, yet none dequantizes to 0, so no update exceeds lr by more
    than Adam's own bound (here, with bias correction and steady grads, about lr)."""
    n = fmt.block_size * 2
    lr = 1e-3
    master = torch.zeros(n)
    m = quant.QuantizedShard.zeros(fmt, True, n, 0, torch.device("cpu"))
    v = quant.QuantizedShard.zeros(fmt, False, n, 0, torch.device("cpu"))
    table = build_layout([(torch.zeros(n), 0)], 100.0, 1, 0, fmt.block_size)[0].segments
    hp = torch.tensor([[lr, 0.9, 0.999, 1e-8, 0.0]], dtype=torch.float64)
    grad = torch.full((n,), 1e-3)
    grad[0] = grad[fmt.block_size] = 1e3
    steps = torch.zeros(1)
    for _ in range(20):
        before = master.clone()
        steps += 1
        kernels.adam_step(grad, master, m, v, None, table, hp, steps, torch.ones(1), torch.tensor(1.0),
                          torch.tensor(0.0), True, True)
        assert (v.dequantize() > 0).all()
        assert (master - before).abs().max() <= 1.01 * lr
    assert (master < 0).all()  # every element moved against its grad


@pytest.mark.parametrize("formats,tol", [((sf.Q8, sf.Q8), 0.03), ((sf.Q4, sf.Q4), 0.3)], ids=["8bit", "4bit"])
def test_tracks_torch_adamw(formats, tol):
    """Against torch.optim.AdamW over the same grads: the params' update stays within the
    formats' measured update error (docs/low-bit-states.md) of the fp32 one."""
    torch.manual_seed(0)
    n = 4096
    p0 = torch.randn(n)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    master = p0.clone()
    m = quant.QuantizedShard.zeros(formats[0], True, n, 0, torch.device("cpu"))
    v = quant.QuantizedShard.zeros(formats[1], False, n, 0, torch.device("cpu"))
    table = build_layout([(torch.zeros(n), 0)], 100.0, 1, 0, 256)[0].segments
    hp = torch.tensor([[1e-2, 0.9, 0.99, 1e-8, 0.0]], dtype=torch.float64)
    steps = torch.zeros(1)
    for _ in range(10):
        g = torch.randn(n) * 0.1 + 0.05
        ref.grad = g.clone()
        opt.step()
        steps += 1
        kernels.adam_step(g, master, m, v, None, table, hp, steps, torch.ones(1), torch.tensor(1.0),
                          torch.tensor(0.0), True, True)
    moved_ref, moved = ref.detach() - p0, master - p0
    err = (moved - moved_ref).norm() / moved_ref.norm()
    assert err < tol, float(err)
    state = opt.state[ref]
    assert (m.dequantize() - state["exp_avg"]).norm() / state["exp_avg"].norm() < tol


def test_bf16_params_with_remainders():
    """int16 remainders under bf16 params, quantized moments: the same as an fp32 master whose
    bf16 copy is rounded half away from zero, bit for bit."""
    n = 512
    g = torch.Generator().manual_seed(1)
    p = torch.randn(n, generator=g).bfloat16()
    table = build_layout([(torch.zeros(n), 0)], 100.0, 1, 0, 256)[0].segments
    hp = torch.tensor([[1e-2, 0.9, 0.999, 1e-8, 0.1]], dtype=torch.float64)
    states = []
    for remainders in (True, False):
        m = quant.QuantizedShard.zeros(sf.Q8, True, n, 0, torch.device("cpu"))
        v = quant.QuantizedShard.zeros(sf.Q4, False, n, 0, torch.device("cpu"))
        out = p.clone()
        master = torch.zeros(n, dtype=torch.int16) if remainders else p.float()
        steps = torch.zeros(1)
        for k in range(3):
            steps += 1
            grad = torch.randn(n, generator=torch.Generator().manual_seed(k)).bfloat16()
            kernels.adam_step(grad, master, m, v, out if remainders else None, table, hp, steps, torch.ones(1),
                              torch.tensor(1.0), torch.tensor(0.0), True, True)
        full = kernels.reference.join_remainders(out, master) if remainders else master
        states.append((full, m.codes, m.scales, v.codes, v.scales))
    for a, b in zip(*states):
        assert torch.equal(a, b)


def test_cuda_tensors_without_the_kernel_are_refused_naming_the_fix():
    """A CUDA step over blockwise moments needs the compiled kernel: without it, a clear error
    naming the fixes (the reference math on the GPU only where SHARDAMP_KERNELS=reference asks)."""
    with pytest.raises(NotImplementedError, match="the step over blockwise moments.*adam_step_blockwise.*no CUDA "
                                                  "kernels.*torch.bfloat16.*SHARDAMP_KERNELS=reference"):
        blockwise.require_kernel(None, torch.device("cuda", 0), "the step over blockwise moments")
    blockwise.require_kernel(None, torch.device("cpu"), "CPU: the reference runs")  # no error


def _native_cpu():
    if kernels.backend(torch.device("cpu")) != "native":
        pytest.skip("the CPU kernels did not build here (SHARDAMP_KERNELS=reference or no compiler)")


@pytest.mark.parametrize("master", bc.MASTERS)
@pytest.mark.parametrize("pair", bc.MOMENT_PAIRS, ids=bc.case_id)
def test_native_cpu_step_is_bitwise_the_reference(pair, master):
    """The compiled CPU step over blockwise moments against reference.adam_step, bit for bit: every
    moment pair (fp32 / bf16 / 8-bit / 4-bit, at least one blockwise), every master kind, fp32 /
    bf16 / fp16 grads, AdamW and Adam, a grad coefficient, several groups with their own
    hyperparameters, an untouched param, padding, a partial last block, a nonzero block offset and a
    found-inf step in the middle."""
    _native_cpu()
    for gi, (gdt, adam_w) in enumerate(itertools.product(bc.GRAD_DTYPES, (True, False))):
        state = bc.make_state(pair, master, seed=gi, device=torch.device("cpu"))
        grads = bc.grads(3, gdt, seed=gi, device=torch.device("cpu"))
        want = bc.run(state, grads, adam_w, native=False)
        got = bc.run(state, grads, adam_w, native=True)
        assert bc.differences(want, got) == [], (gdt, adam_w)
        assert bc.differences(state, got) != [], "the step moved nothing"


def test_native_cpu_skip_writes_nothing():
    _native_cpu()
    state = bc.make_state((sf.Q8, sf.Q4), "remainders", seed=3, device=torch.device("cpu"))
    got = bc.run(state, bc.grads(2, torch.bfloat16, 3, torch.device("cpu")), True, native=True, found_inf_at=(0, 1))
    assert bc.differences(state, got) == []


def test_native_cpu_path_is_the_one_taken(monkeypatch):
    """The dispatcher runs the compiled kernel for blockwise moments where it is built (the
    reference is not called)."""
    _native_cpu()
    calls = []
    monkeypatch.setattr(kernels.reference, "adam_step", lambda *a, **k: calls.append(a))
    state = bc.make_state((sf.Q8, sf.Q8), "fp32", seed=0, device=torch.device("cpu"))
    got = bc.run(state, bc.grads(1, torch.float32, 0, torch.device("cpu")), True, native=True, found_inf_at=())
    assert calls == [] and bc.differences(state, got) != []


def test_zero_shard_is_zero_and_whole_blocks():
    for fmt, signed in [(sf.Q8, True), (sf.Q8, False), (sf.Q4, True), (sf.Q4, False)]:
        s = quant.QuantizedShard.zeros(fmt, signed, 2 * fmt.block_size, fmt.block_size, torch.device("cpu"))
        assert torch.equal(s.dequantize(), torch.zeros(2 * fmt.block_size))
        assert s.nbytes == fmt.nbytes(2 * fmt.block_size)
        with pytest.raises(ValueError, match="whole blocks"):
            quant.QuantizedShard.zeros(fmt, signed, fmt.block_size + 16, 0, torch.device("cpu"))
        with pytest.raises(ValueError, match="block grid"):
            quant.QuantizedShard.zeros(fmt, signed, fmt.block_size, 16, torch.device("cpu"))


@pytest.mark.parametrize("formats", FORMAT_PAIRS, ids=lambda f: "-".join(x.name for x in f))
def test_buffers_allocate_codes_and_scales_and_count_them_exactly(formats):
    from shardamp.optim.shards import buffers as shard_buffers

    mf = sf.MomentFormats(*formats)
    params = [torch.nn.Parameter(torch.randn(n)) for n, _ in SIZES]
    world, rank = 3, 1
    buckets = build_layout([(p, g) for p, (_, g) in zip(params, SIZES)], 100.0, world, rank, mf.grid(ALIGN))
    buf = shard_buffers.allocate(buckets[0], params, True, torch.float32, torch.float32, torch.float32, mf)
    n = buckets[0].shard_numel
    expected = 0
    for moment, fmt, stored in buf.moments():
        expected += fmt.nbytes(n)
        if fmt.blockwise:
            assert isinstance(stored, quant.QuantizedShard) and stored.signed == moment.signed
            assert stored.offset == buckets[0].shard_start and stored.numel == n
            assert stored.codes.dtype == torch.uint8 and stored.codes.numel() == n * fmt.bits // 8
            assert stored.scales.dtype == torch.float32 and stored.scales.numel() == n // fmt.block_size
            assert torch.equal(stored.dequantize(), torch.zeros(n))
        else:
            assert stored.dtype == fmt.storage_dtype and stored.numel() == n
    assert shard_buffers.memory_stats([buf], [])["moments"] == expected
    # 8-bit codes + scales: 1 + 4/256 B per element; 4-bit: 0.5 + 4/128
    per = {"8bit": 1 + 4 / 256, "4bit": 0.5 + 4 / 128, "float32": 4, "bfloat16": 2}
    assert expected == n * sum(per[f.name] for f in formats)
