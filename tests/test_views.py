"""The model's params stay views into the optimizer's buffers through what frameworks do to a
model: ``.to()`` onto the device it is on, ``p.data = `` a same-layout tensor, and safetensors'
``save_model``/``load_model`` (which refuse params sharing a storage), with training still equal
to torch.optim.AdamW and ``grad_norm()`` after ``step`` the unscaled norm that step used."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from shardamp.optim import DistributedFusedAdam

safetensors_torch = pytest.importorskip("safetensors.torch")


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _loss(m, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    return nn.functional.mse_loss(m(x.to(m[0].weight.dtype)).float(), y)


def _in_buffers(opt) -> bool:
    """Every param's data is at its slot of its bucket's flat param buffer."""
    for bucket, buf in zip(opt._buckets, opt._buffers):
        base, esize = buf.params.data_ptr(), buf.params.element_size()
        for slot in bucket.slots:
            if opt._params[slot.index].data_ptr() != base + slot.offset * esize:
                return False
    return True


def _train(model, opt, steps, between=None):
    for step in range(steps):
        if between is not None:
            between(step)
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0), "cpu"])
def test_to_the_same_device_keeps_training_like_torch(device) -> None:
    model, ref = _model(), _model()
    opt = DistributedFusedAdam(model.parameters(), lr=0.05, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    _train(model, opt, 3, between=lambda s: model.to(device))  # a Trainer moves the model each call
    _train(ref, ropt, 3)
    assert _in_buffers(opt)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remainders", [False, True])
def test_same_device_copy_of_a_bf16_model_keeps_the_fp32_master(remainders: bool) -> None:
    """bf16 params, fp32 master (separate, or bf16 param + int16 remainder): a same-device copy
    loses nothing (the master keeps its full precision); a value written into the copy is taken
    over, into the master too, as torch's optimizer would go on from the new tensor."""
    def run(move: bool, write: bool):
        model = _model(torch.bfloat16)
        opt = DistributedFusedAdam(model.parameters(), lr=0.05, grad_sync_dtype=torch.float32,
                                   store_param_remainders=remainders)
        _train(model, opt, 2)
        if move:
            model.to("cpu:0")
        if write:
            with torch.no_grad():
                model[2].bias[0] = 4.0
        _train(model, opt, 2)
        assert _in_buffers(opt)
        return model, torch.cat([b.master_values() for b in opt._buffers])

    _, plain = run(False, False)
    _, moved = run(True, False)
    assert torch.equal(plain, moved)
    written, master = run(True, True)
    assert abs(float(written[2].bias[0]) - 4.0) < 0.15  # two steps of lr 0.05 from 4.0
    assert abs(float(master[(master - 4.0).abs().argmin()]) - 4.0) < 0.15  # the master took it over


def test_grad_norm_after_step_is_unscaled_under_torch_grad_scaler() -> None:
    """Loop A (torch.amp.GradScaler hands itself to step): no norm asked for before step, yet
    grad_norm() after it is the true norm, and it is cached (no new stats)."""
    model, ref = _model(), _model()
    opt = DistributedFusedAdam(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.warns(FutureWarning):
        scaler.scale(_loss(model, 0)).backward()
        scaler.step(opt)
    scaler.update()
    _loss(ref, 0).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    norm = opt.grad_norm()
    assert float(norm) == pytest.approx(float(expected), rel=1e-5)
    assert opt.grad_norm() is norm  # cached
    opt.zero_grad()
    assert opt.grad_norm() is norm  # still that step's norm until the next backward
    with pytest.raises(RuntimeError, match="norm_type"):
        opt.grad_norm(float("inf"))  # not computed by that step: would need a collective


def test_safetensors_save_and_load_model_keep_the_views(tmp_path) -> None:
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), lr=0.05)
    _train(model, opt, 2)
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_model(model, path)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, 1)  # move on, then load the saved weights back
    missing, unexpected = safetensors_torch.load_model(model, path)
    assert not missing and not unexpected
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k])
    assert _in_buffers(opt)
    loaded = safetensors_torch.load_file(path)
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    # and the optimizer keeps training the loaded weights, like torch from the same state
    ref = copy.deepcopy(model)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    ropt.load_state_dict(opt.state_dict())
    _train(model, opt, 1)
    _train(ref, ropt, 1)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tied_weights_stay_tied_for_safetensors(tmp_path) -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    DistributedFusedAdam(model.parameters())
    path = str(tmp_path / "tied.safetensors")
    safetensors_torch.save_model(model, path)  # one tensor, two names: safetensors keeps one
    assert len(safetensors_torch.load_file(path)) == 1
    safetensors_torch.load_model(model, path)
    assert model["head"].weight is model["emb"].weight


def test_transformers_save_pretrained_round_trip_keeps_every_weight(tmp_path) -> None:
    """save_pretrained looks for tied weights among tensors sharing memory: it must keep every
    weight of the optimizer's model (and the real tie), and from_pretrained restore them."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=8)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    opt = DistributedFusedAdam(model.parameters(), lr=0.01)
    ids = torch.randint(0, 40, (2, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.save_pretrained(str(tmp_path))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path))
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert set(ours) == set(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert _in_buffers(opt)
