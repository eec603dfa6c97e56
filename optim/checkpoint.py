"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): each rank writes only its
own shard, and a checkpoint loads at any world size and bucket layout.

Format (a plain DCP checkpoint, only public DCP API, tensors only):

* ``shardamp/meta``: uint8 tensor holding JSON: the param shapes, the torch-layout
  ``param_groups`` (as ``optim.state_dict``), the shardamp extras and the scaler's state;
* ``shardamp/steps``: float32 ``[num_params]`` per-param step counts (identical on every rank,
  written once);
* ``state/{param}/{key}/{offset}``: 1-D, this rank's contiguous piece of param ``param``'s
  ``key`` (``exp_avg``, ``exp_avg_sq``, ``master_param``), elements ``[offset, offset + len)``
  of the param in MEMORY order. A rank's shard holds at most one piece of each param.

Why pieces instead of ShardedTensor/DTensor: our shards have arbitrary element offsets (DTensor's
Shard(0) cannot express them) and ``torch.distributed._shard`` is deprecated; plain keys work the
same on torch 2.11 and 2.13, and ``read_metadata`` lists them, so loading reads exactly the pieces
that overlap the new shard. Metadata is a tensor rather than a pickled object because DCP reads
objects with ``torch.load(weights_only=False)``.
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor

from . import _compat
from . import state_dict as sd_mod

FORMAT = "shardamp.dcp/1"
META_KEY = "shardamp/meta"
STEPS_KEY = "shardamp/steps"
PathLike = Union[str, "os.PathLike[str]"]


def save_sharded(opt: Any, path: PathLike, scaler: Optional[Any] = None) -> None:
    """Write ``opt``'s state (and ``scaler``'s, if given) to the DCP checkpoint directory
    ``path``. A collective over ``opt.process_group``: every rank calls it; each writes its shard.
    The model's weights are not included: save them separately (e.g. ``model.state_dict()``)."""
    opt.param_sync()
    steps = opt._steps.detach().to("cpu", copy=True)
    slots = sd_mod.slots_by_index(opt)
    meta = {
        "format": FORMAT,
        "shapes": [list(s.shape) for s in slots],
        "param_groups": [_jsonable_group(g, i) for i, g in enumerate(sd_mod.torch_param_groups(opt))],
        sd_mod.EXTRA_KEY: sd_mod.extras(opt),
        "scaler": _jsonable_scaler(scaler),
    }
    blob = json.dumps(meta, sort_keys=True).encode()
    state: Dict[str, Tensor] = {META_KEY: torch.frombuffer(bytearray(blob), dtype=torch.uint8), STEPS_KEY: steps}
    for bucket, buf in zip(opt._buckets, opt._buffers):
        sources = [("exp_avg", buf.exp_avg), ("exp_avg_sq", buf.exp_avg_sq)]
        if sd_mod.has_master(opt, bucket.dtype):
            sources.append((sd_mod.MASTER_KEY, buf.master_values()))  # fp32, also from remainders
        for seg in bucket.segments.segments:
            if steps[seg.param_index] <= 0:  # never updated: no state, as in torch
                continue
            for key, src in sources:
                # a copy: DCP must not serialise the whole shard behind a view
                piece = src[seg.start : seg.start + seg.length].to("cpu", copy=True)
                state[f"state/{seg.param_index}/{key}/{seg.param_offset}"] = piece
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=os.fspath(path), process_group=_group(opt), no_dist=_no_dist())


def load_sharded(opt: Any, path: PathLike, scaler: Optional[Any] = None) -> None:
    """Load a checkpoint written by :func:`save_sharded` (at any world size and bucket layout)
    into ``opt`` (and ``scaler``). A collective over ``opt.process_group``. Load the model's
    weights first: master params not in the checkpoint come from them. Everything is validated
    (on every rank alike) before anything is written; a mismatch raises ``ValueError``."""
    path = os.fspath(path)
    pieces, dtypes, sizes = _index(path)
    for key in (META_KEY, STEPS_KEY):
        if key not in sizes:
            raise ValueError(f"load_sharded: {path} is not a shardamp checkpoint (no '{key}')")
    head = {META_KEY: torch.empty(sizes[META_KEY], dtype=torch.uint8),
            STEPS_KEY: torch.empty(sizes[STEPS_KEY], dtype=torch.float32)}
    with _single_process_quiet():
        dcp.load(head, checkpoint_id=path, process_group=_group(opt), no_dist=_no_dist())
    meta = json.loads(bytes(head[META_KEY].tolist()).decode())
    steps = head[STEPS_KEY]
    slots = sd_mod.slots_by_index(opt)

    # ---- validate (identical on every rank: everyone read the same metadata)
    if meta.get("format") != FORMAT:
        raise ValueError(f"load_sharded: unknown checkpoint format {meta.get('format')!r}")
    shapes = [tuple(s) for s in meta["shapes"]]
    plan = sd_mod.plan_hparams(opt, meta["param_groups"], meta.get(sd_mod.EXTRA_KEY))
    for i, (saved, slot) in enumerate(zip(shapes, slots)):
        if saved != slot.shape:
            raise ValueError(f"load_sharded: param {i} has shape {saved} in the checkpoint, {slot.shape} in the optimizer")
    if not bool(torch.isfinite(steps).all()) or bool((steps < 0).any()):
        raise ValueError("load_sharded: the checkpoint's step counts are not finite numbers >= 0")

    # ---- which saved pieces overlap this rank's new shard
    wanted: Dict[Tuple[int, str, int, int], List[Tuple[str, int, int]]] = {}
    needed: Dict[str, Tensor] = {}
    problem = ""
    for bucket in opt._buckets:
        keys = list(sd_mod.STATE_KEYS) + ([sd_mod.MASTER_KEY] if sd_mod.has_master(opt, bucket.dtype) else [])
        for seg in bucket.segments.segments:
            i = seg.param_index
            if steps[i] <= 0:
                continue
            lo, hi = seg.param_offset, seg.param_offset + seg.length
            for key in keys:
                have = pieces.get((i, key))
                if have is None and key == sd_mod.MASTER_KEY:
                    continue  # master then comes from the model params
                cover = [(name, off, n) for name, off, n in have or () if off < hi and off + n > lo]
                if _covered(cover, lo, hi):
                    wanted[(i, key, lo, hi)] = cover
                    for name, _off, n in cover:
                        needed[name] = torch.empty(n, dtype=dtypes[name])
                elif not problem:
                    problem = f"param {i} '{key}' elements [{lo}, {hi}) are missing from the checkpoint"
    _agree_or_raise(opt, problem)

    # ---- read (into temporaries: a failure here leaves the optimizer untouched), then write
    with _single_process_quiet():
        dcp.load(needed, checkpoint_id=path, process_group=_group(opt), no_dist=_no_dist())
    scaler_state = meta.get("scaler")

    def source(index: int, key: str, lo: int, hi: int) -> Optional[Tensor]:
        cover = wanted.get((index, key, lo, hi))
        if cover is None:
            return None
        out = torch.empty(hi - lo, dtype=needed[cover[0][0]].dtype)
        for name, off, n in cover:
            a, b = max(lo, off), min(hi, off + n)
            out[a - lo : b - lo] = needed[name][a - off : b - off]
        return out

    sd_mod.write_state(opt, source, steps)
    sd_mod.resync_remainder_params(opt)
    sd_mod.apply_hparams(opt, plan)
    if scaler is not None and scaler_state:
        scaler.load_state_dict(scaler_state)


# ====================================================================== internals
@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it 'assumes' a single process even when told so (no_dist=True)."""
    with warnings.catch_warnings():
        if _no_dist():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _no_dist() -> bool:
    """A single process without torch.distributed: say so (DCP would warn and assume it)."""
    return not (dist.is_available() and dist.is_initialized())


def _group(opt: Any) -> Optional[Any]:
    return None if _no_dist() else opt.process_group


def _index(path: str) -> Tuple[Dict[Tuple[int, str], List[Tuple[str, int, int]]], Dict[str, torch.dtype], Dict[str, Tuple[int, ...]]]:
    """List the checkpoint's entries: pieces by (param, key) sorted by offset, dtypes, sizes."""
    md = dcp.FileSystemReader(path).read_metadata()
    pieces: Dict[Tuple[int, str], List[Tuple[str, int, int]]] = {}
    dtypes: Dict[str, torch.dtype] = {}
    sizes: Dict[str, Tuple[int, ...]] = {}
    for name, entry in md.state_dict_metadata.items():
        if not hasattr(entry, "size"):
            continue
        sizes[name] = tuple(entry.size)
        dtypes[name] = entry.properties.dtype
        parts = name.split("/")
        if len(parts) == 4 and parts[0] == "state":
            i, key, off = int(parts[1]), parts[2], int(parts[3])
            pieces.setdefault((i, key), []).append((name, off, int(entry.size[0])))
    for v in pieces.values():
        v.sort(key=lambda p: p[1])
    return pieces, dtypes, sizes


def _covered(cover: List[Tuple[str, int, int]], lo: int, hi: int) -> bool:
    pos = lo
    for _name, off, n in cover:
        if off > pos:
            return False
        pos = max(pos, off + n)
    return pos >= hi


def _agree_or_raise(opt: Any, problem: str) -> None:
    """Raise on EVERY rank if any rank found a problem, so no rank is left waiting in a
    collective the others skipped."""
    flag = torch.tensor([1.0 if problem else 0.0], device=opt._device)
    if opt.world_size > 1:
        _compat.all_reduce(flag, dist.ReduceOp.MAX, opt.process_group)
    if flag.item() > 0:
        raise ValueError(f"load_sharded: incomplete checkpoint: {problem or 'another rank is missing state'}")


def _jsonable_group(group: Dict[str, Any], index: int) -> Dict[str, Any]:
    out = {}
    for k, v in group.items():
        if isinstance(v, Tensor) and v.numel() == 1:
            v = v.item()  # a tensor lr (capturable) is stored as its value
        elif isinstance(v, tuple):
            v = list(v)
        try:
            json.dumps(v)
        except TypeError:
            raise TypeError(
                f"save_sharded: param_groups[{index}][{k!r}] = {v!r} cannot be stored in a sharded "
                "checkpoint (only JSON-serialisable group values are supported)"
            ) from None
        out[k] = v
    return out


def _jsonable_scaler(scaler: Optional[Any]) -> Optional[Dict[str, Any]]:
    if scaler is None:
        return None
    state = scaler.state_dict()
    return {k: (v.item() if isinstance(v, Tensor) else v) for k, v in state.items()}
