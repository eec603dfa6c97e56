"""Ranks that disagree: checked at construction, at every step, and at every collective call.

* Construction (``agree_on_construction``): every rank describes what it built (param count,
  shapes, dtypes, order, groups, options, moment formats, offload, buckets) as one 32-bit hash per
  field; ONE all-gather of those hashes tells every rank the same thing, and a difference raises on
  every rank naming the field, with the differing values (gathered only then).
* Every step (``StepFingerprint``): what may change between steps (hyperparameters, norm type,
  options, gradient reductions since the last step, tensor lr values) travels INSIDE the one
  stats all-reduce that runs anyway, as a few extra float32 entries. No collective is added and nothing is read on the
  host on CUDA. Each category is a 24-bit hash cut into chunks ``c`` of ``b`` bits; under SUM
  the entries are ``(c, c*c)`` and the ranks agree iff ``W * sum(c*c) == sum(c)**2``
  (Cauchy-Schwarz: equality iff every rank's ``c`` is equal); under MAX (the inf norm) they are
  ``(c, -c)`` and the ranks agree iff ``max(c) == min(c)``. ``b`` is chosen so every sum stays
  an integer below 2**24, exact in float32, for the group's world size.
* Collective calls (``agree_on_call``): ``state_dict``, ``load_state_dict``, ``save_sharded``,
  ``load_sharded`` start with one small all-reduce naming the call and hashing what each rank
  was given; a rank that did not call it, called another one, or was given different input
  makes every rank that did call raise, before anything is read or written, within
  ``SHARDAMP_COLLECTIVE_TIMEOUT`` seconds on gloo and on CUDA (comm/watchdog.py). On gloo
  it travels over a group of its own, so a call on some ranks never pairs with the stats
  all-reduce of the others. ``state_dict`` and ``save_sharded`` also agree there on the last
  step's clips (the last step of a run is compared by no later step).

The per-step checks read the optimizer through a :class:`StepView` (its groups, options, step
cycle and touched pattern) and write nothing into it: the categories they compared are returned.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import sys
import zlib
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.order import TIMEOUT_ENV, collective_timeout  # noqa: F401  (re-exported)
from ..state_formats import MomentFormats

HASH_BITS = 24


def crc(value: Any) -> int:
    """A hash of ``repr(value)`` that is the same in every process (Python's ``hash`` is not)."""
    return zlib.crc32(repr(value).encode())


# ====================================================================== construction
def construction_options(opt: Any) -> Dict[str, Any]:
    """The constructor's options every rank must share, read from the optimizer's public
    attributes (compared at construction)."""
    return dict(
        adam_w_mode=opt.adam_w_mode, bias_correction=opt.bias_correction, max_grad_norm=opt.max_grad_norm,
        average_grad_sync=opt.average_grad_sync, dtype=str(opt.dtype), grad_sync_dtype=str(opt.grad_sync_dtype),
        param_sync_dtype=str(opt.param_sync_dtype), overlap_grad_sync=opt.overlap_grad_sync,
        overlap_param_sync=opt.overlap_param_sync, capturable=opt.capturable,
        skip_grad_norm_above=opt.skip_grad_norm_above, store_param_remainders=opt.store_param_remainders)


def describe(params: Sequence[torch.nn.Parameter], param_groups: Sequence[Dict[str, Any]], options: Dict[str, Any],
             bucket_cap_mb: float, comm: Any, buckets: Sequence[Any], device: torch.device,
             formats: MomentFormats, offload: Dict[str, Any]) -> Dict[str, Any]:
    """What every rank must have built identically, field by field (host values only);
    ``formats``: what the moments are stored as (``state_formats.py``); ``offload``: where the
    state lives (``offload.py``)."""
    groups = []
    for g in param_groups:
        groups.append({k: ("tensor" if isinstance(v, Tensor) else v) for k, v in sorted(g.items()) if k != "params"})
    return {
        "number of params": len(params),
        "param shapes": [tuple(p.shape) for p in params],
        "param dtypes": [str(p.dtype) for p in params],
        "param strides (memory format)": [tuple(p.stride()) for p in params],
        "requires_grad": [bool(p.requires_grad) for p in params],
        "param group sizes": [len(g["params"]) for g in param_groups],
        "param group hyperparameters": groups,
        "options": dict(options),
        "moment formats (exp_avg_dtype, exp_avg_sq_dtype)": formats.names(),
        "offload (offload, offload_fraction)": offload,
        "bucket_cap_mb": bucket_cap_mb,
        "device mesh (replicate x shard)": comm.describe(),
        "buckets": [(b.numel, [s.index for s in b.slots]) for b in buckets],
        "device type": device.type,
    }


def agree_on_construction(comm: Any, device: torch.device, fields: Dict[str, Any]) -> None:
    """Raise ``ValueError`` on every rank if the ranks built different optimizers (``fields``:
    ``describe``'s). A collective over ``comm`` (one all-gather; a second only on a difference)."""
    if not comm.has_peers:
        return
    names = list(fields)
    mine = torch.tensor([crc(fields[n]) for n in names], dtype=torch.int64, device=device)
    everyone = torch.empty(comm.world_size * len(names), dtype=torch.int64, device=device)
    comm.all_gather_span(everyone, mine)
    table = everyone.view(comm.world_size, len(names)).cpu()
    differ = [n for j, n in enumerate(names) if bool((table[:, j] != table[0, j]).any())]
    if not differ:
        return
    values: List[Any] = [None] * comm.world_size  # error path only: every rank saw the same table
    comm.all_gather_object(values, {n: fields[n] for n in differ})
    details = "; ".join(_first_difference(n, [v[n] for v in values]) for n in differ)
    raise ValueError(
        "DistributedFusedAdam: the ranks of the process group built different optimizers, so their "
        f"shards and collectives would not line up. Differs: {details}. Build the same model (same "
        "params in the same order, dtypes and shapes) with the same arguments on every rank."
    )


def _first_difference(name: str, per_rank: List[Any]) -> str:
    if all(isinstance(v, list) for v in per_rank) and len({len(v) for v in per_rank}) == 1:
        for i in range(len(per_rank[0])):
            items = [v[i] for v in per_rank]
            if any(x != items[0] for x in items):
                shown = ", ".join(f"rank {r}: {_short(x)}" for r, x in enumerate(items))
                return f"{name} (item {i}: {shown})"
    shown = ", ".join(f"rank {r}: {_short(x)}" for r, x in enumerate(per_rank))
    return f"{name} ({shown})"


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ====================================================================== every step
def _chunk_bits(world_size: int) -> int:
    # W * (2**b - 1)**2 < 2**24 keeps every SUM an exact float32 integer
    return max(1, min(8, (24 - max(world_size - 1, 1).bit_length()) // 2))


class StepFingerprint:
    """Encodes per-step values into stats entries and checks them after the all-reduce."""

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self.bits = _chunk_bits(world_size)
        self.chunks = -(-HASH_BITS // self.bits)
        self.shifts = torch.arange(self.chunks, dtype=torch.int64, device=device) * self.bits
        self.host_names: List[str] = []

    def host_entries(self, categories: Sequence[Tuple[str, Any]], use_max: bool) -> List[float]:
        """``[invalid=0, encoded chunks of every category]``; ``categories`` are (name, value)."""
        self.host_names = [name for name, _ in categories]
        out: List[float] = [0.0]
        for _name, value in categories:
            h = crc(value) & ((1 << HASH_BITS) - 1)
            cs = [float((h >> (k * self.bits)) & ((1 << self.bits) - 1)) for k in range(self.chunks)]
            out += cs + ([-c for c in cs] if use_max else [c * c for c in cs])
        return out

    def device_entries(self, lrs: Tensor, use_max: bool) -> Tensor:
        """Encoded chunks of the float32 bits of each tensor lr (``lrs``: 1-D, on the device)."""
        bits = lrs.float().view(torch.int32).to(torch.int64) & 0xFFFFFF  # 24 low bits: the mantissa
        high = (lrs.float().view(torch.int32).to(torch.int64) >> 24) & 0xFF  # sign and top exponent
        mixed = bits ^ (high * 0x10101)  # every bit of the value reaches the 24 hashed bits
        cs = ((mixed.unsqueeze(1) >> self.shifts) & ((1 << self.bits) - 1)).float()
        return torch.cat([cs, -cs if use_max else cs * cs], dim=1).reshape(-1)

    def length(self, n_host: int, n_lrs: int) -> int:
        return 1 + 2 * self.chunks * (n_host + n_lrs)

    def check(self, tail: Tensor, use_max: bool) -> Tensor:
        """From the reduced entries: float32 0/1 flags ``[invalid, mismatch per category...]``.
        One rank alone has nothing to disagree with: its flags are ``[invalid]`` (a view of the
        unreduced entry, exactly 0 or 1), no launch."""
        if self.world_size == 1:
            return tail[:1]
        pairs = tail[1:].view(-1, 2, self.chunks).double()  # sums below 2**24: exact
        if use_max:
            diff = pairs[:, 0] + pairs[:, 1]  # max(c) - min(c)
        else:
            diff = torch.addcmul(pairs[:, 1] * self.world_size, pairs[:, 0], pairs[:, 0], value=-1.0)
        return (torch.cat([tail[:1].double(), diff.abs().amax(dim=1)]) > 0.5).float()


def _number(value: Any) -> Any:
    """``value`` as a float where it is one (1 and 1.0 agree), else as is: an invalid value on
    one rank must reach the all-reduce (it is flagged there), not raise here."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return tuple(_number(v) for v in value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


@dataclasses.dataclass(frozen=True)
class StepView:
    """What the per-step agreement reads from one optimizer, and nothing it may write.

    Attributes:
        comm: the optimizer's comm (``has_peers``).
        param_groups: returns the optimizer's param groups as they are now (schedules change
            their values; a wrapper may rebind the list).
        options: returns ``(max_grad_norm, adam_w_mode, bias_correction)`` as they are now.
        cycle: the step cycle (step/cycle.py): ``rounds_since_step`` and ``clips_of_last_step()``.
        local_touched: returns this rank's touched pattern (which params got a grad).
        fingerprint: the per-step entries' encoder.
        patterns: the cached device tails and touched patterns (step/grad_stats.TouchedPatterns).
    """

    comm: Any
    param_groups: Callable[[], Sequence[Dict[str, Any]]]
    options: Callable[[], Tuple[Any, Any, Any]]
    cycle: Any
    local_touched: Callable[[], bytes]
    fingerprint: StepFingerprint
    patterns: Any


def step_view(ref: Callable[[], Any], comm: Any, cycle: Any, device: torch.device, patterns: Any,
              local_touched: Callable[[], bytes]) -> StepView:
    """The :class:`StepView` of the optimizer ``ref()`` (a weak reference: the view the checks
    hold never keeps the optimizer alive): its param groups and options read as they are then."""
    def param_groups() -> Sequence[Dict[str, Any]]:
        opt = ref()
        return [] if opt is None else opt.param_groups

    def options() -> Tuple[Any, Any, Any]:
        opt = ref()
        return (None, None, None) if opt is None else (opt.max_grad_norm, opt.adam_w_mode, opt.bias_correction)
    return StepView(comm=comm, param_groups=param_groups, options=options, cycle=cycle, local_touched=local_touched,
                    fingerprint=StepFingerprint(comm.world_size, device), patterns=patterns)


def host_categories(view: StepView, norm_type: float) -> List[Tuple[str, Any]]:
    groups = [tuple(_number(g.get(k)) for k in ("lr", "betas", "eps", "weight_decay")) for g in view.param_groups()]
    return [
        ("hyperparameters (lr, betas, eps, weight_decay of the param groups)", groups),
        ("norm_type", float(norm_type)),
        ("options (max_grad_norm, adam_w_mode, bias_correction)", view.options()),
        # not the step count: it changes every step, so these entries (cached on the device beside
        # the touched pattern) would be re-uploaded every step, also inside a CUDA-graph capture
        ("gradient reductions since the last step (a rank ran another number of backward passes or "
         "accumulated differently)", view.cycle.rounds_since_step),
        # a clip on some ranks only updates their shards clipped and the others' not: compared at
        # the next step, not in this one's stats, because which call starts the stats may differ
        # legitimately (rank 0 logging grad_norm() before clipping, the others clipping at once)
        ("clip_grad_norm calls of the previous step (max_norms and norm types; called on some ranks only? "
         "that step updated some shards clipped, others not)", view.cycle.clips_of_last_step()),
    ]


def step_entries(
    view: StepView, norm_type: float, problem: str = "", lrs: Optional[Any] = None
) -> Tuple[List[float], Optional[Tuple[Tensor, Optional[Tensor]]], List[str]]:
    """This step's agreement entries: the host part (``[invalid, chunks...]``, cached on the
    device beside the touched pattern), for tensor lrs (``lrs``: hparams.TensorLrs, read once
    this step) the device part ``(invalid flag, chunks)`` (None without; chunks None for one rank
    alone), and the names of the categories in entry order."""
    use_max = math.isinf(norm_type)
    has_peers = view.comm.has_peers
    if lrs is None and not has_peers:
        # one rank alone, float lrs: no other rank to compare with, only the invalid flag
        # (what ``StepFingerprint.check`` reads for one rank): no categories hashed every step
        return [1.0 if problem else 0.0], None, []
    fp = view.fingerprint
    host = fp.host_entries(host_categories(view, norm_type), use_max)
    host[0] = 1.0 if problem else 0.0
    names = list(fp.host_names)
    if lrs is None:
        return host, None, names
    # a malformed lr (flagged in ``problem``) still contributes one entry (NaN): every rank's
    # stats keep the same length
    values = lrs.values
    # finite and >= 0 iff clamping to [0, max float64] changes nothing (NaN stays NaN != NaN)
    bad = values.clamp(0.0, sys.float_info.max).ne(values)
    invalid = (bad if bad.numel() == 1 else bad.any()).float().reshape(1)
    if problem:
        invalid.fill_(1.0)
    if not has_peers:  # no other rank to compare the values with: the flag alone
        return host, (invalid, None), names
    names += [f"the value of the tensor lr of param_groups[{i}]" for i in lrs.groups]
    return host, (invalid, fp.device_entries(values, use_max)), names


class StatsBuffer(NamedTuple):
    """``stats_buffer``'s result."""

    buf: Tensor  # the step's stats tensor (header zeros, touched, health, agreement entries)
    checked: bool  # the agreement entries must be checked after the reduction
    names: List[str]  # the agreement categories, in entry order


class StatsParts(NamedTuple):
    """``stats_parts``' result: the stats tensor's pieces, in order, before their ``cat``."""

    parts: List[Tensor]
    checked: bool
    names: List[str]


def stats_parts(view: StepView, norm_type: float, problem: str, lrs: Optional[Any] = None,
                extra: Sequence[Tensor] = (), header: Optional[Tensor] = None) -> StatsParts:
    """The pieces of :func:`stats_buffer`'s tensor, for a caller that concatenates them itself
    (kernels.fused_step.stats_cat_finish: the concatenation and the finish in one native call)."""
    host, dev, names = step_entries(view, norm_type, problem, lrs)
    patterns = view.patterns
    tail = patterns.get_tail(host)
    parts = [patterns.header if header is None else header, patterns.get(view.local_touched()), *extra]
    if dev is None:
        parts.append(tail)
    else:  # the device's invalid flag replaces the host's (entry 0 of the tail)
        parts += [dev[0].reshape(1), tail[1:]] + ([] if dev[1] is None else [dev[1].reshape(-1)])
    return StatsParts(parts, view.comm.has_peers or dev is not None or bool(problem), names)


def stats_buffer(view: StepView, norm_type: float, problem: str, lrs: Optional[Any] = None,
                 extra: Sequence[Tensor] = (), header: Optional[Tensor] = None) -> StatsBuffer:
    """The step's stats tensor with the touched pattern, ``extra`` (the health entries) and the
    agreement entries filled in, whether the entries must be checked after the reduction (one
    rank alone has nothing to disagree with; a tensor lr's value is still checked), and the
    categories' names. The norm header is ``header`` (float32 ``[2]``) if given, else zeros for
    the caller to fill."""
    parts, checked, names = stats_parts(view, norm_type, problem, lrs, extra, header)
    # one launch: on a GPU host each device-to-device copy_ is a cudaMemcpyAsync (~25 us each)
    return StatsBuffer(torch.cat(parts), checked, names)


def raise_if_disagree(invalid: float, categories: List[float], names: List[str], problem: str = "") -> None:
    """Raise if the reduced flags say a value was invalid on some rank, or the ranks differ."""
    if invalid > 0:
        raise ValueError(
            problem or "DistributedFusedAdam: a hyperparameter is invalid on some rank: a tensor lr holding NaN, "
            "inf or a negative value (checked on the device), or a value named in the error of the rank that "
            "has it; the step was skipped on every rank. Keep every param group's "
            "hyperparameters valid (lr finite and >= 0) on every rank."
        )
    differ = [n for n, flag in zip(names, categories) if flag > 0]
    if differ:
        raise RuntimeError(mismatch_message(differ))


def mismatch_message(names: List[str]) -> str:
    return (
        "DistributedFusedAdam: the ranks disagree on " + "; ".join(names) + ". The step was skipped on "
        "every rank (nothing trained on mismatched values). Every rank must change hyperparameters, "
        "LR schedules, norm_type and options identically and call step() the same number of times."
    )


# ====================================================================== collective calls
def agree_on_call(view: Any, name: str, given: Any = None, problem: str = "", clips: Any = ()) -> None:
    """The first thing a collective entry point does (``view``: the optimizer's
    ``shard_view()``, for its comm and device): one all-reduce of
    ``[call id, -call id, hash of given, -hash, problem flag, clips, -clips]`` (MAX). Raise on
    every rank that took part if the ranks are not all in the same call with the same input, or
    if any rank reported ``problem``; a rank left waiting raises after the timeout, naming the
    call. With ``clips`` (the calls that read the state, ``state_dict`` and ``save_sharded``,
    pass the step cycle's ``clips_of_last_step()``) the ranks also agree on the clips their last step applied: a clip on some ranks only in the
    LAST step of a run (no later step compares it) would otherwise be published, some shards
    clipped and others not."""
    message = problem if problem.startswith(name) else f"{name}: {problem}"
    if not view.comm.has_peers:
        if problem:
            raise ValueError(message)
        return
    call, arg = float(crc(name) & 0xFFFFFF), float(crc(given) & 0xFFFFFF)
    clips = float(crc(clips) & 0xFFFFFF)
    flag = torch.tensor([call, -call, arg, -arg, 1.0 if problem else 0.0, clips, -clips],
                        dtype=torch.float32, device=view.device)
    timeout = collective_timeout()
    try:
        work = view.comm.all_reduce_async(flag, dist.ReduceOp.MAX)
        if timeout is not None and view.device.type == "cpu":
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        else:
            work.wait()
        values = flag.tolist()
        view.comm.check()  # CUDA: a read released by the watchdog's abort returns garbage
    except RuntimeError as exc:
        text = str(exc)
        detail = text if "the sequence of shardamp collectives" in text else _short(text, 300)
        raise RuntimeError(
            f"{name} is a collective: every rank of the optimizer's process group must call it, at the "
            f"same point. This rank called {name}() and the others did not join it ({detail}). "
            "Nothing was read or written."
        ) from exc
    if values[0] + values[1] != 0:
        raise RuntimeError(
            f"{name} is a collective: the ranks called different collectives at this point (this rank: "
            f"{name}). Call state_dict/load_state_dict/save_sharded/load_sharded on every rank, in the same "
            "order. Nothing was read or written."
        )
    if values[4] > 0:
        raise ValueError(message if problem else f"{name}: another rank rejected its input (nothing was written)")
    if values[2] + values[3] != 0:
        raise ValueError(f"{name}: the ranks were given different arguments (e.g. different state dicts or "
                         "paths); every rank must pass the same. Nothing was read or written.")
    if values[5] + values[6] != 0:
        raise RuntimeError(
            f"{name}: the ranks' last step clipped differently (clip_grad_norm called on some ranks only, or with "
            "another max_norm or norm_type), so it updated some shards clipped and others not; the state would mix "
            "them. Call clip_grad_norm identically on every rank. Nothing was read or written.")
