"""World-size independent state dicts in ``torch.optim.AdamW``'s own layout.

``gather_state_dict`` all-gathers (or gathers on rank 0) every bucket's sharded state and cuts
it into per-param tensors; ``load_state_dict`` cuts a full per-param state dict into this rank's
shard of the CURRENT layout, so any world size, bucket size or bucket order loads.

The layout is torch's, key for key::

    {"state": {index: {"step": 0-d float32 tensor, "exp_avg": T, "exp_avg_sq": T,
                       "master_param": T  # only where the model dtype differs from the state dtype
                       }},                 # no entry for a param never updated, as torch
     "param_groups": [{lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable,
                       differentiable, fused, decoupled_weight_decay, <user keys>, params}],
     "shardamp": {adam_w_mode, bias_correction, max_grad_norm, dtype}}

``T`` is shaped like its param, in the param's memory format (channels_last stays
channels_last): ``exp_avg`` / ``exp_avg_sq`` as their format carries them
(``state_formats.py``: the storage dtype, fp32 or bf16 with ``exp_avg_dtype`` /
``exp_avg_sq_dtype``), ``master_param`` in the state dtype (with
``store_param_remainders`` the fp32 master reassembled from the bf16 param and its remainder, so
the dict is the same as with a separate master). A blockwise moment (``"8bit"`` / ``"4bit"``)
is kept as its codes and block scales (``quantized.py``: compact and lossless), which
``shardamp.optim.to_torch_state_dict`` turns into torch's fp32 moments. torch's ``Optimizer.load_state_dict`` ignores
the extra top-level ``"shardamp"`` key and the extra ``master_param`` state entry, and casts the
moments to each param's dtype. Loading any dict converts each tensor to this optimizer's storage
format (``StateFormat.load``): torch's fp32 moments into bf16 moments round to nearest even, into
blockwise moments they are quantized; saved codes into fp32 or bf16 moments are dequantized.

The helpers below the two entry points (groups, validation, the shard writer) are shared with
``checkpoint.py`` so both formats validate and write exactly alike. Both reach the optimizer
through its public API and ``opt.shard_view()`` (shard_view.py), not its private fields.
"""
from __future__ import annotations

import functools
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
from torch import Tensor

from .. import _compat
from ..checks import agreement
from ..shards.buffers import param_view
from ..hparams import check_hparams
from ..layout import ParamSlot
from ..kernels.reference import split_remainders
from ..state_formats import MOMENT_KEYS, MOMENTS, of_dtype
from . import quantized

STATE_KEYS = MOMENT_KEYS
MASTER_KEY = "master_param"
EXTRA_KEY = "shardamp"
# torch.optim.Adam(W)'s group keys that shardamp does not keep per group, with the values that
# describe what shardamp does (capturable / decoupled_weight_decay are filled in from the optimizer)
TORCH_ONLY_DEFAULTS: Dict[str, Any] = dict(
    amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
    decoupled_weight_decay=True,
)
_HPARAM_ORDER = ("lr", "betas", "eps", "weight_decay")
_UNSIGNED = frozenset(m.key for m in MOMENTS if not m.signed)  # never negative: exp_avg_sq
_warned = weakref.WeakSet()  # optimizers already warned about what torch cannot load


# ====================================================================== entry points
def gather_state_dict(opt: Any, *, rank0_only: bool = False, cpu_offload: bool = True) -> Optional[Dict[str, Any]]:
    """``opt.state_dict()``: a collective, every rank of ``opt.process_group`` must call it.

    Returns the full state dict on every rank, or with ``rank0_only=True`` on the group's rank 0
    only (the others return ``None`` and never hold more than one bucket's gather buffer). With
    ``cpu_offload=True`` (default) the tensors are on the CPU, otherwise on the params' device.
    """
    agreement.agree_on_call(opt.shard_view(), "state_dict", given=(rank0_only, cpu_offload),
                            clips=opt.shard_view().last_clips())
    opt.param_sync()  # a pending all-gather may still be writing an aliased master shard
    _warn_what_torch_drops(opt)
    steps = opt.shard_view().steps.detach().to("cpu", copy=True)
    out_device = torch.device("cpu") if cpu_offload else opt.shard_view().device
    receives = not rank0_only or opt.rank == 0
    state: Dict[int, Dict[str, Tensor]] = {}
    for bucket, buf in zip(opt.shard_view().buckets, opt.shard_view().buffers):
        live = [s for s in bucket.slots if steps[s.index] > 0]
        if not live:  # steps are identical on every rank, so every rank skips the same buckets
            continue
        keys = list(STATE_KEYS) + ([MASTER_KEY] if has_master(opt, bucket.dtype) else [])
        # a blockwise moment's codes, one per element (as fp32: exact), and its scales apart
        blockwise = {m.key: fmt for m, fmt, _ in buf.moments() if fmt.blockwise}
        tensors = [quantized.gathered_values(t) if fmt.blockwise else fmt.state_dict_value(t)
                   for _, fmt, t in buf.moments()]
        tensors += [buf.master_values()] if MASTER_KEY in keys else []
        scales = {m.key: _gather(opt, t.scales.reshape(1, -1).to(buf.params.device), rank0_only)
                  for m, fmt, t in buf.moments() if fmt.blockwise}
        # one gather per bucket, in the widest dtype of its states (bf16 -> fp32 -> bf16 is exact)
        wide = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
        # on the params' device: an offloaded bucket's state lives on the host (shards/host_state.py)
        full = _gather(opt, torch.stack([t.to(buf.params.device, wide) for t in tensors]), rank0_only)
        if full is None:
            continue
        per_key = {k: full[:, j, :].reshape(-1).to(t.dtype) for j, (k, t) in enumerate(zip(keys, tensors))}
        for slot in live:
            entry: Dict[str, Any] = {"step": steps[slot.index].clone()}
            for k in keys:
                if k in blockwise:
                    moment = next(m for m in MOMENTS if m.key == k)
                    codes = quantized.param_entry(moment, blockwise[k], per_key[k], scales[k].reshape(-1), slot)
                    entry.update({n: v.to(out_device) if isinstance(v, Tensor) else v for n, v in codes.items()})
                    continue
                view = param_view(per_key[k], slot)  # param's shape AND strides
                entry[k] = view.to(out_device, copy=True) if view.device != out_device else view.clone()
            if blockwise:
                entry[quantized.LAYOUT_KEY] = quantized.layout_of(slot)
            state[slot.index] = entry
    if not receives:
        return None
    return {
        "state": {i: state[i] for i in sorted(state)},
        "param_groups": torch_param_groups(opt),
        EXTRA_KEY: extras(opt),
    }


def load_state_dict(opt: Any, state_dict: Mapping[str, Any]) -> None:
    """``opt.load_state_dict(sd)``: load a full state dict (ours, or torch.optim.AdamW / Adam's
    over the same params) into this rank's shard. A collective: every rank calls it with the same
    full dict (one small all-reduce checks both). Everything is validated, on every rank, before
    anything is written; a problem on any rank raises ``ValueError`` on every rank naming it and
    leaves every rank's optimizer untouched.

    Master params come from ``master_param`` entries when present, otherwise from the model's
    current params (so load the model's weights first). Params without a state entry restart
    from step 0 with zero moments, as in torch.
    """
    try:
        entries, steps, plan = _validated(opt, state_dict)
        problem = ""
    except (ValueError, TypeError, KeyError) as exc:  # raised on every rank below, not here alone
        entries, steps, plan, problem = {}, None, None, str(exc)
    given = None if problem else _summary(state_dict, steps)
    agreement.agree_on_call(opt.shard_view(), "load_state_dict", given=given, problem=problem)
    slots = slots_by_index(opt)

    def source(index: int, key: str, lo: int, hi: int) -> Optional[Tensor]:
        entry = entries.get(index)
        if entry is None or key not in entry:
            return None
        return memory_flat(entry[key], slots[index])[lo:hi]

    write_state(opt, source, steps)
    # every rank holds the full dict, so each writes the masters' high halves for ALL elements
    # (write_state wrote its own shard): the ranks' bf16 params agree before the next all-gather
    for bucket, buf in zip(opt.shard_view().buckets, opt.shard_view().buffers):
        if buf.remainders:
            for slot in bucket.slots:
                full = source(slot.index, MASTER_KEY, 0, slot.numel)
                if full is not None:
                    flat = memory_flat(param_view(buf.params, slot), slot)
                    flat.copy_(split_remainders(full.to(device=flat.device, dtype=torch.float32))[0])
    apply_hparams(opt, plan)


def _summary(state_dict: Mapping[str, Any], steps: Tensor) -> tuple:
    """What two ranks' state dicts must share to be 'the same' (cheap: sums, not bytes)."""
    sums = []
    for key in sorted(state_dict["state"], key=repr):
        entry = state_dict["state"][key]
        sums.append(tuple(float(entry[k].detach().double().sum()) for k in sorted(entry)
                          if isinstance(entry[k], Tensor) and entry[k].is_floating_point()))
    groups = [{k: (float(v) if isinstance(v, Tensor) else v) for k, v in g.items()} for g in state_dict["param_groups"]]
    return repr(groups), steps.tolist(), sums


def _validated(opt: Any, state_dict: Any):
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups' (an optimizer state dict)")
    saved_groups = state_dict["param_groups"]
    plan = plan_hparams(opt, saved_groups, state_dict.get(EXTRA_KEY))
    index_of: Dict[Any, int] = {}
    for group in saved_groups:
        for saved_id in group["params"]:
            index_of[saved_id] = len(index_of)
    slots = slots_by_index(opt)
    raw_state = state_dict["state"]
    if not isinstance(raw_state, Mapping):
        raise ValueError("load_state_dict: 'state' must be a dict keyed by param index")
    entries: Dict[int, Dict[str, Any]] = {}
    for key, entry in raw_state.items():
        if key not in index_of:
            raise ValueError(f"load_state_dict: state entry {key!r} belongs to no param listed in param_groups")
        slot, index = slots[index_of[key]], index_of[key]
        where = f"load_state_dict: state[{index}] (param {index}, shape {slot.shape})"
        if isinstance(entry, Mapping):  # blockwise moments: fp32 values, quantized again by write_state
            entry = quantized.dequantized_entry(entry, state_dict.get(EXTRA_KEY), slot.shape, where)
        entries[index] = _checked_entry(entry, slot, index)
    steps = torch.zeros(len(slots), dtype=torch.float32)
    for i, entry in entries.items():
        steps[i] = entry["step"]
    return entries, steps, plan


# ====================================================================== shared helpers
def has_master(opt: Any, model_dtype: torch.dtype) -> bool:
    """A separate master copy exists (and is saved) where the model dtype is not the state
    dtype, or where a lower-precision param all-gather rounds the model (buffers.py)."""
    rounded_sync = opt.param_sync_dtype not in (None, model_dtype) and opt.shard_view().comm.gathers_params
    return model_dtype != opt.dtype or rounded_sync


def slots_by_index(opt: Any) -> List[ParamSlot]:
    slots: List[Optional[ParamSlot]] = [None] * len(opt.shard_view().params)
    for bucket in opt.shard_view().buckets:
        for slot in bucket.slots:
            slots[slot.index] = slot
    return slots  # type: ignore[return-value]


def memory_flat(t: Tensor, slot: ParamSlot) -> Tensor:
    """``t`` (shaped like ``slot``'s param, any strides) as 1-D, in the param's MEMORY order."""
    t = t.detach()
    if tuple(t.stride()) != slot.stride or not _compat.is_dense_non_overlapping(t):
        same = torch.empty_strided(slot.shape, slot.stride, dtype=t.dtype, device=t.device)
        same.copy_(t)
        t = same
    return t.as_strided((slot.numel,), (1,), t.storage_offset())


def torch_param_groups(opt: Any) -> List[Dict[str, Any]]:
    """``param_groups`` as torch.optim.AdamW writes them: every hyperparameter under torch's keys
    (in torch's order), then any user keys, then ``params`` as indices in param_groups order."""
    groups, start = [], 0
    torch_only = dict(TORCH_ONLY_DEFAULTS, capturable=opt.capturable, decoupled_weight_decay=opt.adam_w_mode)
    for group in opt.param_groups:
        out: Dict[str, Any] = {}
        for k in _HPARAM_ORDER:
            out[k] = group[k]
        out.update(torch_only)
        for k, v in group.items():
            if k not in out and k != "params":
                out[k] = v
        out["lr"] = out["lr"].clone() if isinstance(out["lr"], Tensor) else out["lr"]
        out["betas"] = tuple(out["betas"])
        n = len(group["params"])
        out["params"] = list(range(start, start + n))
        start += n
        groups.append(out)
    return groups


def extras(opt: Any) -> Dict[str, Any]:
    """What torch's layout has no key for, so a shardamp -> shardamp round trip is exact."""
    name = lambda d: str(d).replace("torch.", "")  # noqa: E731
    out = dict(
        adam_w_mode=opt.adam_w_mode, bias_correction=opt.bias_correction,
        max_grad_norm=opt.max_grad_norm, dtype=name(opt.dtype),
    )
    # storage options, recorded only where they differ from the default layout (a load converts
    # everything to the loading optimizer's own storage, so they are informational)
    for moment, fmt in opt.shard_view().formats.items():
        if fmt is not of_dtype(opt.dtype):
            out[moment.option] = fmt.name
        if fmt.blockwise:  # how the saved codes read (quantized.py)
            out[moment.key + quantized.QUANT] = quantized.quant_info(fmt, moment)
    if opt.store_param_remainders:
        out["store_param_remainders"] = True
    return out


@dataclass
class HparamPlan:
    """Validated hyperparameters, ready to be applied (after the state has been written)."""

    groups: List[Dict[str, Any]]
    options: Dict[str, Any] = field(default_factory=dict)  # optimizer attributes to set


def plan_hparams(opt: Any, saved_groups: Any, saved_extras: Optional[Mapping[str, Any]]) -> HparamPlan:
    """Check group count and sizes and every hyperparameter; raise ``ValueError`` naming the
    mismatch. Nothing is modified."""

    if not isinstance(saved_groups, (list, tuple)):
        raise ValueError("load_state_dict: 'param_groups' must be a list of dicts")
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"load_state_dict: the state dict has {len(saved_groups)} param groups, the optimizer has "
            f"{len(opt.param_groups)}"
        )
    total_saved = sum(len(g.get("params", ())) for g in saved_groups)
    if total_saved != len(opt.shard_view().params):
        raise ValueError(
            f"load_state_dict: the state dict covers {total_saved} params, the optimizer has "
            f"{len(opt.shard_view().params)}"
        )
    new_groups, decoupled = [], set()
    for g, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        where = f"load_state_dict: param_groups[{g}]"
        if not isinstance(saved, Mapping) or "params" not in saved:
            raise ValueError(f"{where}: expected a dict with 'params'")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"{where} has {len(saved['params'])} params, the optimizer's group {g} has {len(group['params'])}"
            )
        names = saved.get("param_names")
        if names is not None and (not isinstance(names, (list, tuple)) or len(names) != len(group["params"])):
            raise ValueError(f"{where}: 'param_names' must list one name per param of the group "
                             f"({len(group['params'])}), got {names!r:.200}")
        missing = [k for k in _HPARAM_ORDER if k not in saved]
        if missing:
            raise ValueError(f"{where}: missing hyperparameter(s) {missing}")
        for k in ("amsgrad", "maximize", "differentiable"):
            if saved.get(k):
                raise ValueError(f"{where}: {k}=True is not supported by DistributedFusedAdam")
        if "decoupled_weight_decay" in saved:
            decoupled.add(bool(saved["decoupled_weight_decay"]))
        new = {k: v for k, v in saved.items() if k not in TORCH_ONLY_DEFAULTS and k != "params"}
        new["betas"] = tuple(new["betas"]) if isinstance(new["betas"], (list, tuple)) else new["betas"]
        if isinstance(new["lr"], Tensor):
            new["lr"] = new["lr"].detach().to(opt.shard_view().device, copy=True)
        check_hparams(new["lr"], new["betas"], new["eps"], new["weight_decay"], f"{where}: ")
        new_groups.append(new)
    if len(decoupled) > 1:
        raise ValueError(
            "load_state_dict: the param groups disagree on decoupled_weight_decay; DistributedFusedAdam "
            "applies one weight-decay mode (adam_w_mode) to every group"
        )
    options: Dict[str, Any] = {}
    if decoupled:
        options["adam_w_mode"] = decoupled.pop()
    if saved_extras is not None:
        if not isinstance(saved_extras, Mapping):
            raise ValueError(f"load_state_dict: '{EXTRA_KEY}' must be a dict")
        for k in ("adam_w_mode", "bias_correction"):
            if k in saved_extras:
                if not isinstance(saved_extras[k], bool):
                    raise ValueError(f"load_state_dict: {EXTRA_KEY}.{k}={saved_extras[k]!r}: expected a bool")
                options[k] = saved_extras[k]
        if "max_grad_norm" in saved_extras:
            m = saved_extras["max_grad_norm"]
            if m is not None and not (isinstance(m, (int, float)) and m > 0 and math.isfinite(m)):
                raise ValueError(f"load_state_dict: {EXTRA_KEY}.max_grad_norm={m!r}: expected None or a float > 0")
            options["max_grad_norm"] = m
    if options.get("adam_w_mode", opt.adam_w_mode) != opt.adam_w_mode and saved_extras is None:
        warnings.warn(
            f"load_state_dict: the state dict sets decoupled_weight_decay={options['adam_w_mode']}; the "
            f"optimizer switches to adam_w_mode={options['adam_w_mode']}, as torch.optim would",
            UserWarning, stacklevel=4,
        )
    return HparamPlan(new_groups, options)


def apply_hparams(opt: Any, plan: HparamPlan) -> None:
    """Replace every group's hyperparameters in place (the group dicts keep their identity, so
    LR schedulers holding them keep working) and set the optimizer-wide options."""
    for group, new in zip(opt.param_groups, plan.groups):
        params = group["params"]
        old_lr = group.get("lr")
        names = group.get("param_names")
        group.clear()
        group.update(new)
        group["params"] = params
        if names is not None and "param_names" not in new:
            group["param_names"] = names  # as torch.optim: a dict without names keeps the optimizer's
        if isinstance(old_lr, torch.Tensor) and "lr" in new:
            # a device lr (capturable, CUDA graphs) stays the same tensor, now holding the
            # loaded value: captured graphs and LR schedulers keep reading it
            old_lr.copy_(torch.as_tensor(new["lr"]).detach().reshape(old_lr.shape))
            group["lr"] = old_lr
    for k, v in plan.options.items():
        setattr(opt, k, v)
    opt.shard_view().hparams.invalidate()  # re-upload the hyperparameter table at the next step


def write_state(opt: Any, source: Callable[[int, str, int, int], Optional[Tensor]], steps: Tensor) -> None:
    """Fill this rank's shard of every bucket from ``source(param_index, key, lo, hi)``, which
    returns elements ``[lo, hi)`` of that param's state ``key`` in memory order, or None: zeros
    for the moments, the model's current weights for the master. Call only after validation."""
    opt.param_sync()
    for bucket, buf in zip(opt.shard_view().buckets, opt.shard_view().buffers):
        separate = buf.master.data_ptr() != buf.params[buf.shard].data_ptr()
        local_params = buf.params[buf.shard]
        # a blockwise moment is written whole: its fp32 values (zeros where no param has state,
        # padding included) quantized block by block once every segment is in, where its codes
        # live (an offloaded bucket's on the host)
        staged = {m.key: torch.zeros(buf.shard_numel, device=t.codes.device)
                  for m, fmt, t in buf.moments() if fmt.blockwise}
        for seg in bucket.segments.segments:
            dst = slice(seg.start, seg.start + seg.length)
            lo, hi = seg.param_offset, seg.param_offset + seg.length
            for moment, fmt, target in buf.moments():
                src = source(seg.param_index, moment.key, lo, hi)
                if moment.key in staged:
                    if src is not None:
                        staged[moment.key][dst] = src.to(device=staged[moment.key].device, dtype=torch.float32)
                elif src is None:
                    target[dst].zero_()
                else:
                    fmt.load(target[dst], src)
            if separate:  # an aliased master IS the model param: it was loaded with the model
                src = source(seg.param_index, MASTER_KEY, lo, hi)
                buf.set_master(dst, local_params[dst] if src is None else src)
        for moment, _fmt, target in buf.moments():
            if moment.key in staged:
                target.store(staged[moment.key])
    opt.shard_view().steps.copy_(steps.to(opt.shard_view().steps.device, opt.shard_view().steps.dtype))


def resync_remainder_params(opt: Any) -> None:
    """After a sharded load: with remainders, each rank rewrote the bf16 params of its own shard
    (the loaded masters' high halves); all-gather them so every rank holds the same model. A
    collective (load_sharded is one); nothing happens without remainders."""
    if not any(buf.remainders for buf in opt.shard_view().buffers):
        return
    for buf in opt.shard_view().buffers:
        opt.shard_view().comm.all_gather_shard_sync(buf.params, buf.params[buf.shard].clone())


# ====================================================================== internals
def _gather(opt: Any, local: Tensor, rank0_only: bool) -> Optional[Tensor]:
    """Every shard's ``local`` ([k, n]) stacked to [shard_size, k, n] (over the shard dim:
    replicas hold the same state); on the shard dim's rank 0 only if asked."""
    return opt.shard_view().comm.gather_shards(local, rank0_only)


def _checked_entry(entry: Any, slot: ParamSlot, index: int) -> Dict[str, Any]:
    where = f"load_state_dict: state[{index}] (param {index}, shape {slot.shape})"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}: expected a dict")
    if "max_exp_avg_sq" in entry:
        raise ValueError(f"{where}: has 'max_exp_avg_sq' (amsgrad), which DistributedFusedAdam does not support")
    for k in ("step",) + STATE_KEYS:
        if k not in entry:
            raise ValueError(f"{where}: missing '{k}'")
    step = entry["step"]
    if isinstance(step, Tensor):
        if step.is_meta:
            raise ValueError(f"{where}: 'step' is on the meta device (it holds no value)")
        if step.numel() != 1:
            raise ValueError(f"{where}: 'step' must hold one number, got shape {tuple(step.shape)}")
        step = float(step.detach().reshape(()).to("cpu"))
    if not (isinstance(step, (int, float)) and math.isfinite(step) and step >= 0):
        raise ValueError(f"{where}: step={step!r}: expected a finite number >= 0")
    out: Dict[str, Any] = {"step": float(step)}
    for k in STATE_KEYS + (MASTER_KEY,):
        if k not in entry:
            continue
        t = entry[k]
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"{where}: '{k}' must be a floating-point tensor")
        if t.is_meta:
            raise ValueError(f"{where}: '{k}' is on the meta device (it holds no values); load a materialised "
                             "state dict")
        if tuple(t.shape) != slot.shape:
            raise ValueError(f"{where}: '{k}' has shape {tuple(t.shape)}, the param has shape {slot.shape}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: '{k}' holds non-finite values")
        if k in _UNSIGNED and bool((t < 0).any()):
            raise ValueError(f"{where}: '{k}' holds negative values (a second moment is >= 0: a corrupted "
                             "or mismatched state dict)")
        out[k] = t
    return out


def _warn_what_torch_drops(opt: Any) -> None:
    if opt in _warned:
        return
    lost = []
    if any(has_master(opt, b.dtype) for b in opt.shard_view().buckets):
        lost.append(
            f"the {opt.dtype} master weights of the lower-precision params (torch keeps only the "
            "model params; 'master_param' is ignored and the moments are cast to the param dtype)"
        )
    low: Dict[str, List[str]] = {}  # format name -> the moments stored below torch's fp32
    for moment, fmt in opt.shard_view().formats.items():
        if fmt.below_fp32:
            low.setdefault(fmt.name, []).append(moment.key)
    for fmt_name, keys in low.items():
        if any(f.blockwise and f.name == fmt_name for _, f in opt.shard_view().formats.items()):
            lost.append(
                f"the {fmt_name} codes and block scales of {' and '.join(keys)} as they are (torch.optim cannot "
                "read them: pass the state dict through shardamp.optim.to_torch_state_dict first, which "
                "dequantizes them to fp32)")
            continue
        lost.append(
            f"the {fmt_name} storage of {' and '.join(keys)} (torch casts them to each param's dtype and "
            "continues at that precision, so its steps differ from this optimizer's rounded ones)"
        )
    if not opt.bias_correction:
        lost.append("bias_correction=False (torch.optim always bias-corrects)")
    if opt.max_grad_norm is not None:
        lost.append(f"max_grad_norm={opt.max_grad_norm} (torch.optim does not clip)")
    if lost:
        _warned.add(opt)
        warnings.warn(
            "DistributedFusedAdam.state_dict(): loading this state dict into torch.optim.AdamW/Adam "
            "cannot carry over " + "; ".join(lost) + ". Loading it back into DistributedFusedAdam is exact.",
            UserWarning, stacklevel=3,
        )
