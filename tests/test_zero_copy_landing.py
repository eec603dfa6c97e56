"""The zero-copy landing (one process, CPU): a complete bucket's grads stay where autograd left
them, its flags' pass and the step read them in place, and its flat shard is made only when
something else reads it. Every case trains bit for bit as the copying landing
(``copy_grads=True``) and as torch's AdamW to its tolerance; the kernels over the parts sum
exactly what they sum over the landed shard."""
from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
import torch.nn as nn

from shardamp.optim import DistributedFusedAdam, config, kernels
from shardamp.scaler import ShardedGradScaler

native = pytest.mark.skipif(kernels.backend(torch.device("cpu")) != "native", reason="needs the compiled kernels")
pytestmark = native


@pytest.fixture(autouse=True)
def _copy_grads_default():
    yield
    config.configure(copy_grads=None)


class Net(nn.Module):
    """Odd sizes (the params' slots start mid-vector), a frozen param between trained ones (a
    gap in the bucket that no grad covers), a channels_last conv (a dense grad that is not
    contiguous) and a bias-free layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1).to(memory_format=torch.channels_last)
        self.frozen = nn.Linear(45, 7)
        self.frozen.weight.requires_grad_(False)
        self.fc1 = nn.Linear(45, 29)
        self.fc2 = nn.Linear(29, 13, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.to(memory_format=torch.channels_last)).flatten(1)[:, :45]
        return self.fc2(torch.tanh(self.fc1(h))) + self.frozen(h).sum(1, keepdim=True)


def _batch(step: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(4, 3, 3, 5, generator=torch.Generator().manual_seed(step)).to(dtype)


def _train(copy: bool, *, dtype=torch.float32, groups: int = 2, clip: bool = False, scaled: bool = False,
           bucket_cap_mb: float = 25.0, steps: int = 4, inf_at: int = -1, accumulate: int = 1,
           read_grads: bool = False, set_to_none: "bool | str" = True, torch_ref: bool = False,
           device: str = "cpu", max_grad_norm: "float | None" = None):
    """Train Net ``steps`` steps; returns the params, the per-step held pattern of the buckets
    and the handed-out norms. ``set_to_none``: ``zero_grad``'s, or ``"alternate"`` (True at even
    steps). ``device``: test_cuda_zero_copy.py trains on CUDA. ``max_grad_norm``: shardamp clips
    inside its step (torch: ``clip_grad_norm_`` before it)."""
    config.configure(copy_grads=copy)
    torch.manual_seed(0)
    model = Net().to(device=device, dtype=dtype)
    trained = [p for p in model.parameters() if p.requires_grad]
    if groups == 2:
        params = [{"params": [model.conv.weight, model.conv.bias, model.frozen.weight, model.frozen.bias]},
                  {"params": [model.fc1.weight, model.fc1.bias, model.fc2.weight], "lr": 3e-3, "weight_decay": 0.0}]
    else:
        params = list(model.parameters())
    if torch_ref:
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)
    else:
        opt = DistributedFusedAdam(params, lr=1e-2, weight_decay=0.05, bucket_cap_mb=bucket_cap_mb,
                                   max_grad_norm=max_grad_norm)
    scaler = ShardedGradScaler(device, init_scale=2.0 ** 8) if scaled and not torch_ref else (
        torch.amp.GradScaler(device, init_scale=2.0 ** 8) if scaled else None)
    held: List[List[bool]] = []
    norms: List[float] = []
    grads_seen: List[torch.Tensor] = []
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none if isinstance(set_to_none, bool) else step % 2 == 0)
        for k in range(accumulate):
            loss = model(_batch(10 * step + k, dtype).to(device)).float().pow(2).mean()
            if step == inf_at and k == 0:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if not torch_ref:
            held.append([b.held is not None for b in opt._buffers])
        if read_grads:  # shardamp's values: full_grad (one process: no collective), which reads the shard
            read = (lambda p: p.grad) if torch_ref else opt.full_grad
            grads_seen.append(torch.cat([read(p).flatten().float() for p in trained]))
        if scaler is not None:
            scaler.unscale_(opt)
        if torch_ref and max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trained, max_grad_norm)
        if clip:
            if torch_ref:
                norms.append(float(torch.nn.utils.clip_grad_norm_(trained, 0.5)))
            else:
                norms.append(float(opt.clip_grad_norm(0.5)))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return [p.detach().clone() for p in model.parameters()], held, norms, grads_seen


def _bitwise(a: List[torch.Tensor], b: List[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


LOOPS = ["plain", "clip", "scaler+clip", "max_grad_norm in step"]


def loop_kw(loop: str, **kw):
    """``_train``'s keywords for one of :data:`LOOPS` (plus ``kw``)."""
    return dict(clip=loop in ("clip", "scaler+clip"), scaled="scaler" in loop,
                max_grad_norm=0.5 if loop == "max_grad_norm in step" else None, **kw)


def check_held_as_the_copy(buckets: str, **kw) -> None:
    """Every bucket of every step held in place, training bit for bit (params and norms) as the
    copying landing, whose buckets all land in their shards. ``buckets``: "one" or "several"."""
    kw["bucket_cap_mb"] = 25.0 if buckets == "one" else 0.002
    params, held, norms, _ = _train(False, **kw)
    copied, held_copy, norms_copy, _ = _train(True, **kw)
    _bitwise(params, copied)
    assert norms == norms_copy
    assert all(all(h) for h in held), held
    assert (len(held[0]) == 1) == (buckets == "one")
    assert not any(any(h) for h in held_copy)


def check_held_as_torch(**kw) -> None:
    """Every bucket held, training as torch's AdamW (and its clip) to the fp32 tolerance."""
    params, held, norms, _ = _train(False, **kw)
    ref, _, ref_norms, _ = _train(False, torch_ref=True, **kw)
    assert all(all(h) for h in held)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)


def check_inf_step(**kw) -> List[List[bool]]:
    """Step ``inf_at`` with an inf in its grads: bit for bit the copying landing, and with a scaler
    torch's (its GradScaler skips the step too; without one torch's AdamW would step on NaN).
    Returns the held pattern."""
    params, held, _, _ = _train(False, **kw)
    copied, _, _, _ = _train(True, **kw)
    _bitwise(params, copied)
    if kw.get("scaled"):
        ref, _, _, _ = _train(False, torch_ref=True, **kw)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    return held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("buckets", ["one", "several"])
def test_held_grads_train_bitwise_as_the_copy(dtype, loop, buckets):
    check_held_as_the_copy(buckets, **loop_kw(loop, dtype=dtype))


@pytest.mark.parametrize("loop", LOOPS)
def test_held_grads_train_as_torch_adamw(loop):
    check_held_as_torch(**loop_kw(loop, steps=5))


@pytest.mark.parametrize("loop", ["plain", "scaler+clip"])
def test_an_inf_bucket_lands_in_its_shard_and_the_step_is_skipped(loop):
    held = check_inf_step(**loop_kw(loop, inf_at=2, steps=5))
    assert not any(held[2]) and all(held[1]) and all(held[3])  # the inf step copied, the others held


def test_reading_param_grad_makes_the_shard_and_trains_the_same():
    params, held, _, seen = _train(False, read_grads=True, clip=True)
    copied, _, _, seen_copy = _train(True, read_grads=True, clip=True)
    ref, _, _, seen_ref = _train(False, read_grads=True, clip=True, torch_ref=True)
    _bitwise(params, copied)
    for a, b, r in zip(seen, seen_copy, seen_ref):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    assert all(all(h) for h in held)  # held until param.grad was read, after the held pattern was taken


def test_accumulated_backwards_and_zeroing_to_zeros_train_the_same():
    """Three backwards a step (the first held, the next two land it: added to its grads), and
    ``zero_grad(set_to_none=False)`` every other step (the held grads dropped, the shard made as
    zeros, that step's grads landed in it): bitwise the copying landing, and torch's AdamW."""
    for kw, held_at in ((dict(accumulate=3, clip=True), lambda s: False),
                        (dict(set_to_none="alternate", scaled=True, clip=True, steps=6), lambda s: s % 2 == 0)):
        params, held, norms, _ = _train(False, **kw)
        copied, _, norms_copy, _ = _train(True, **kw)
        ref, _, ref_norms, _ = _train(False, torch_ref=True, **kw)
        _bitwise(params, copied)
        assert norms == norms_copy
        assert [all(h) for h in held] == [held_at(s) for s in range(len(held))], held
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)


def test_held_grads_make_no_shard_and_zero_grad_drops_them():
    config.configure(copy_grads=False)
    model = Net()
    opt = DistributedFusedAdam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    opt.zero_grad()
    model(_batch(0, torch.float32)).pow(2).mean().backward()
    opt.clip_grad_norm(1.0)
    opt.step()
    buf = opt._buffers[0]
    assert buf.held is not None and buf.grad_store is None  # the step read the grads in place
    opt.zero_grad()
    assert buf.held is None and buf.grad_store is None and buf.released


def test_hold_is_per_bucket_and_a_bucket_not_held_is_copied():
    """The stager holds per bucket (on CUDA a bucket past ``HELD_SEGMENTS`` is not held, the
    others are): with holding off for one bucket, that one lands in its shard, the others stay
    held, and training is bitwise the copying landing's."""
    def run(copy: bool, hold=None):
        config.configure(copy_grads=copy)
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(4096)) for _ in range(4)]  # 16 KB each
        opt = DistributedFusedAdam(params, lr=1e-2, bucket_cap_mb=0.02)
        n = len(opt._buffers)
        assert n >= 2
        if hold is not None:
            opt._grad_sync.stager.set_hold([b != hold for b in range(n)])
        seen = []
        for step in range(3):
            opt.zero_grad()
            sum((p * p).sum() * (step + 1) for p in params).backward()
            seen.append([b.held is not None for b in opt._buffers])
            opt.step()
        return [p.detach().clone() for p in params], seen, n

    params, seen, n = run(False, hold=1)
    copied, seen_copy, _ = run(True)
    _bitwise(params, copied)
    assert seen == [[b != 1 for b in range(n)]] * 3, seen
    assert not any(map(any, seen_copy))
    with pytest.raises((RuntimeError, ValueError), match="one flag per bucket"):
        DistributedFusedAdam([nn.Parameter(torch.randn(4))], lr=1e-2)._grad_sync.stager.set_hold([True, True])


def test_the_hold_gate_and_bound_per_bucket_from_the_extension(monkeypatch):
    """``holds_grads`` answers per bucket against the extension's ``HELD_SEGMENTS`` on CUDA (none
    on the CPU), and ``held_bucket_params`` hands that bound to the layout (a stand-in
    extension: the gate's arithmetic, not the kernels)."""
    from shardamp.optim.kernels import dispatch

    class FakeCuda:
        HELD_SEGMENTS = 2

        def bucket_stats_parts(self, *args):
            raise AssertionError("not called")

    real = dispatch._native
    monkeypatch.setattr(dispatch, "_native", lambda d: FakeCuda() if d.type == "cuda" else real(d))
    cuda = torch.device("cuda")
    assert kernels.holds_grads(cuda, [1, 2, 3, 0]) == [True, True, False, True]
    assert kernels.held_bucket_params(cuda) == 2
    assert kernels.holds_grads(torch.device("cpu"), [1, 500]) == [True, True]
    assert kernels.held_bucket_params(torch.device("cpu")) is None
    monkeypatch.setattr(dispatch, "_native", lambda d: None)
    assert kernels.holds_grads(cuda, [1, 2]) == [False, False] and kernels.held_bucket_params(cuda) is None


def test_a_step_that_raises_before_its_launches_lets_go_of_the_held_grads(monkeypatch):
    """The step's native call is handed the held grads before it checks its arguments: one that
    raises there must drop them, or a later step that lands that bucket in its shard would read
    the grads of the step that raised. Here the step after it lands the shard (``full_grad``
    makes it) from other grads, and trains bitwise as the same steps without the raise."""
    from shardamp.optim.kernels import fused_step

    def run(fail: bool):
        config.configure(copy_grads=False)
        torch.manual_seed(0)
        model = Net()
        opt = DistributedFusedAdam([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.05)
        opt.zero_grad()
        model(_batch(0, torch.float32)).pow(2).mean().backward()
        if fail:
            real = fused_step.stats_step

            def bad_views(parts, end, norm_type, views, view_of, *rest):
                return real(parts, end, norm_type, views, dict(view_of, touched=len(views)), *rest)

            with monkeypatch.context() as m:
                m.setattr(fused_step, "stats_step", bad_views)
                with pytest.raises(RuntimeError, match="touched_view"):
                    opt.step()
            assert opt._buffers[0].held is not None  # the raise came after the grads were handed over
        opt.zero_grad()
        model(_batch(1, torch.float32)).pow(2).mean().backward()
        assert opt._buffers[0].held is not None
        opt.full_grad(model.fc1.weight)  # makes the shard: the step reads it, not held grads
        assert opt._buffers[0].held is None
        opt.step()
        return [p.detach().clone() for p in model.parameters()]

    _bitwise(run(True), run(False))


# ------------------------------------------------------------------ the kernels over parts
def _layout(seed: int, numel: int) -> Tuple[List[int], List[int]]:
    """Random parts of a ``numel`` shard: their offsets and sizes, with gaps (no grad) between."""
    g = torch.Generator().manual_seed(seed)
    offsets, sizes, at = [], [], 0
    while at < numel:
        at += int(torch.randint(0, 40, (1,), generator=g))  # a gap, often 0
        size = min(int(torch.randint(1, 70_000 if seed % 2 else 300, (1,), generator=g)), numel - at)
        if size <= 0:
            break
        offsets.append(at)
        sizes.append(size)
        at += size
    return offsets, sizes


def _landed(grads, offsets, numel, dtype) -> torch.Tensor:
    full = torch.zeros(numel, dtype=dtype)
    for g, o in zip(grads, offsets):
        full[o:o + g.numel()] = g.flatten()
    return full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(6))
def test_bucket_stats_over_parts_is_bitwise_the_landed_shards(dtype, seed):
    ext = kernels.native_module(torch.device("cpu"))
    numel = 150_001 if seed % 2 else 3_001
    offsets, sizes = _layout(seed, numel)
    g = torch.Generator().manual_seed(100 + seed)
    grads = [(torch.randn(s, generator=g) * 3).to(dtype) for s in sizes]
    full = _landed(grads, offsets, numel, dtype)
    for assign in (True, False):
        want = torch.tensor([0.25, 0.0])
        got = want.clone()
        rows = torch.zeros(0, 3, dtype=torch.int64)
        flags = torch.zeros(1)
        kernels.bucket_stats(full, rows, flags, want, assign)
        assert ext.bucket_stats_parts(grads, offsets, numel, got, assign)
        assert torch.equal(got, want), (got, want)
    # an inf anywhere: nothing written, False (the caller lands the shard and flags it there)
    bad = [x.clone() for x in grads]
    bad[len(bad) // 2][-1] = float("inf")
    out = torch.tensor([1.5, 0.0])
    assert not ext.bucket_stats_parts(bad, offsets, numel, out, True)
    assert torch.equal(out, torch.tensor([1.5, 0.0]))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_partials_over_parts_is_bitwise_the_landed_shards(norm_type, dtype):
    ext = kernels.native_module(torch.device("cpu"))
    numel = 140_000
    offsets, sizes = _layout(1, numel)
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(s, generator=g).to(dtype) for s in sizes]
    # segments: each part's span, plus a gap-only segment (no grad there: its partial is 0)
    rows = [[o, s, i, i % 3] for i, (o, s) in enumerate(zip(offsets, sizes))]
    gap = next((o - (po + ps) for (po, ps), o in zip(zip(offsets, sizes), offsets[1:]) if o > po + ps), 0)
    if gap:
        k = next(i for i in range(len(offsets) - 1) if offsets[i + 1] > offsets[i] + sizes[i])
        rows.append([offsets[k] + sizes[k], gap, len(rows), 1])
    seg = torch.tensor(rows, dtype=torch.int64)
    full = _landed(grads, offsets, numel, dtype)
    want, got = torch.full((3,), 0.5), torch.full((3,), 0.5)
    ext.group_partials(full, seg, want, norm_type, None)
    ext.group_partials_parts(grads, offsets, numel, seg, got, norm_type)
    assert torch.equal(got, want), (got, want)


@pytest.mark.native_raises
def test_parts_that_overlap_or_do_not_fit_are_refused():
    ext = kernels.native_module(torch.device("cpu"))
    out = torch.zeros(2)
    with pytest.raises(RuntimeError, match="overlap"):
        ext.bucket_stats_parts([torch.ones(4), torch.ones(4)], [0, 2], 8, out, True)
    with pytest.raises(RuntimeError, match="does not fit"):
        ext.bucket_stats_parts([torch.ones(4)], [6], 8, out, True)
    with pytest.raises(RuntimeError, match="dense CPU tensor"):
        ext.bucket_stats_parts([torch.ones(4, 2)[:, 0]], [0], 8, out, True)


def _train_subsets(copy: bool, steps: int = 24, torch_ref: bool = False,
                   device: str = "cpu") -> Tuple[List[torch.Tensor], List[bool]]:
    """Eight independent params; every third step's loss reaches all of them (its bucket is
    complete: held), the others' a random subset (incomplete: landed at the end of backward)."""
    config.configure(copy_grads=copy)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(11 + 3 * i).to(device)) for i in range(8)]
    opt = (torch.optim.AdamW if torch_ref else DistributedFusedAdam)(params, lr=1e-2, weight_decay=0.05)
    gen = torch.Generator().manual_seed(5)
    held = []
    for step in range(steps):
        opt.zero_grad()
        chosen = params if step % 3 == 0 else [p for p in params if torch.rand((), generator=gen) < 0.5] or params[:1]
        sum((p * p).sum() * (1 + step % 4) for p in chosen).backward()
        held.append(not torch_ref and opt._buffers[0].held is not None)
        opt.step()
    return [p.detach().clone() for p in params], held


def test_held_and_landed_steps_mixed_train_as_the_copy_and_torch():
    """Steps whose grads complete the bucket (held) between steps whose grads reach a subset of
    the params (landed, the gaps zero): bitwise the copying landing throughout, and torch's AdamW
    (which, as shardamp, leaves a param without a grad untouched)."""
    held_params, held = _train_subsets(copy=False)
    copy_params, copied = _train_subsets(copy=True)
    ref_params, _ = _train_subsets(copy=False, torch_ref=True)
    assert held == [step % 3 == 0 for step in range(24)], held
    assert not any(copied)
    for a, b, r in zip(held_params, copy_params, ref_params):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
