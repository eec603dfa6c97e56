"""Checkpoints that survive a crash, in one process (world 1): a save killed midway or between its
two renames, a directory without the completion marker, a flipped byte, bad state refused before
anything is written (save_sharded, load_state_dict). Degenerate values: test_faults.py."""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from shardamp.optim import DistributedFusedAdam, load_sharded, save_sharded
from shardamp.optim.checkpoint import sharded as checkpoint
from shardamp.optim.checkpoint import atomic_publish
from test_faults import _backward, _model  # the same small model and grads


def _trained(steps, lr=0.1):
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), lr=lr)
    for s in range(steps):
        opt.zero_grad()
        _backward(model, seed=s)
        opt.step()
    return model, opt


def _step_count(opt):
    return float(opt._steps.max())


def test_save_killed_midway_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    model, opt = _trained(2)
    save_sharded(opt, path)
    for s in range(3):
        opt.zero_grad()
        _backward(model, seed=10 + s)
        opt.step()
    real_save = checkpoint.dcp.save

    def killed(state, checkpoint_id, **kw):  # writes its files, then dies before returning
        real_save(state, checkpoint_id=checkpoint_id, **kw)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(checkpoint.dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        save_sharded(opt, path)
    monkeypatch.undo()
    _, fresh = _trained(0)
    load_sharded(fresh, path)
    assert _step_count(fresh) == 2.0  # checkpoint A, not the torn step-5 save
    staged = atomic_publish.staging_dir(path)
    assert os.path.isdir(staged)
    with pytest.raises(ValueError, match="torn or incomplete.*shardamp-complete.json"):
        load_sharded(fresh, staged)
    save_sharded(opt, path)  # the next save clears the leftovers and publishes
    load_sharded(fresh, path)
    assert _step_count(fresh) == 5.0 and not os.path.exists(staged)


def test_a_directory_without_the_marker_is_never_loaded(tmp_path):
    path = str(tmp_path / "ckpt")
    _, opt = _trained(1)
    save_sharded(opt, path)
    os.remove(os.path.join(path, atomic_publish.MARKER))
    _, fresh = _trained(0)
    before = [b.exp_avg.clone() for b in fresh._buffers]
    with pytest.raises(ValueError, match="torn or incomplete"):
        load_sharded(fresh, path)
    assert all(torch.equal(a, b.exp_avg) for a, b in zip(before, fresh._buffers))
    with pytest.raises(ValueError, match="no checkpoint at"):
        load_sharded(fresh, str(tmp_path / "missing"))


def test_crash_between_the_two_renames_is_named(tmp_path):
    path = str(tmp_path / "ckpt")
    _, opt = _trained(1)
    save_sharded(opt, path)
    os.rename(path, atomic_publish.old_dir(path))
    save_sharded(opt, atomic_publish.staging_dir(path))  # a complete new one, not yet published
    with pytest.raises(ValueError, match="interrupted while publishing"):
        load_sharded(opt, path)


def test_a_flipped_byte_is_detected(tmp_path):
    path = str(tmp_path / "ckpt")
    _, opt = _trained(2)
    save_sharded(opt, path)
    seg = max(opt._buckets[0].segments.segments, key=lambda s: s.length)
    piece = opt._buffers[0].exp_avg_sq[seg.start : seg.start + seg.length]
    needle = piece.contiguous().view(torch.uint8).numpy().tobytes()
    for name in os.listdir(path):
        full = os.path.join(path, name)
        data = bytearray(open(full, "rb").read())
        at = data.find(needle)
        if name.endswith(".distcp") and at >= 0:
            data[at + 1] ^= 0x10
            open(full, "wb").write(bytes(data))
            break
    else:
        raise AssertionError("piece not found in the checkpoint files")
    _, fresh = _trained(0)
    with pytest.raises(ValueError, match="does not match its checksum"):
        load_sharded(fresh, path)
    assert _step_count(fresh) == 0.0


@pytest.mark.parametrize("damage, match", [
    (lambda opt: opt._buffers[0].exp_avg_sq.__setitem__(0, -1.0), "exp_avg_sq holds negative"),
    (lambda opt: opt._buffers[0].exp_avg.__setitem__(0, float("nan")), "non-finite"),
    (lambda opt: opt.param_groups[0].__setitem__("lr", float("nan")), "lr=nan"),
])
def test_save_rejects_bad_state_before_writing_anything(tmp_path, damage, match):
    path = str(tmp_path / "ckpt")
    _, opt = _trained(1)
    damage(opt)
    with pytest.raises(ValueError, match=match):
        save_sharded(opt, path)
    assert not os.path.exists(path) and not os.path.exists(atomic_publish.staging_dir(path))


def test_save_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "weights"
    path.mkdir()
    (path / "model.pt").write_bytes(b"precious")
    _, opt = _trained(1)
    with pytest.raises(ValueError, match="holds no complete shardamp checkpoint"):
        save_sharded(opt, path)
    assert (path / "model.pt").read_bytes() == b"precious"


@pytest.mark.parametrize("edit, match", [
    (lambda sd: sd["state"][0].__setitem__("exp_avg_sq", -sd["state"][0]["exp_avg_sq"] - 1), "negative"),
    (lambda sd: sd["state"][0].__setitem__("exp_avg", torch.empty(6, 4, device="meta")), "meta device"),
    (lambda sd: sd["state"][0].__setitem__("step", torch.empty((), device="meta")), "meta device"),
    (lambda sd: sd["param_groups"][0].__setitem__("lr", float("nan")), "lr=nan"),
])
def test_load_state_dict_rejects_bad_state_before_writing(edit, match):
    _, opt = _trained(2)
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    edit(bad)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for i in sd["state"]:
        assert torch.equal(sd["state"][i]["exp_avg_sq"], after["state"][i]["exp_avg_sq"])
    assert not math.isnan(after["param_groups"][0]["lr"])
