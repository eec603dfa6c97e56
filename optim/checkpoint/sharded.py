"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): each rank writes only its
own shard, and a checkpoint loads at any world size and bucket layout.

Format (a plain DCP checkpoint, only public DCP API, tensors only):

* ``shardamp/meta``: uint8 tensor holding JSON: the param shapes, the torch-layout
  ``param_groups`` (as ``optim.state_dict``), the shardamp extras and the scaler's state;
* ``shardamp/steps``: float32 ``[num_params]`` per-param step counts (identical on every rank,
  written once);
* ``shardamp/crc/{rank}``: uint8 JSON ``{piece name: CRC32}`` of the pieces rank ``rank`` wrote
  (the step counts' CRC is in the metadata, the metadata's in the completion marker);
* ``state/{param}/{key}/{offset}``: 1-D, this rank's contiguous piece of param ``param``'s
  ``key`` (``exp_avg``, ``exp_avg_sq``, ``master_param``), elements ``[offset, offset + len)``
  of the param in MEMORY order. A rank's shard holds at most one piece of each param. A
  blockwise moment (``"8bit"`` / ``"4bit"``) is stored as its codes, one uint8 per element (4-bit
  codes too: a piece may start or end mid-byte), and ``state/{param}/{key}_scales/{offset}``, fp32,
  the scales of the blocks that piece's elements fall in (the layout puts shard boundaries on the
  block grid, so a piece never needs another rank's scale); the metadata's ``block_offsets``
  gives each param's first element's position in its block, its extras how the codes read.

The directory is written aside and published with a completion marker (``atomic_publish.py``):
a directory without it is never loaded.

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

from ..checks import agreement
from . import atomic_publish
from . import state_dict as sd_mod
from ..hparams import validate_groups
from ..kernels import quant
from ..state_formats import MOMENTS
from . import quantized as sd_quant

FORMAT = "shardamp.dcp/1"
META_KEY = "shardamp/meta"
STEPS_KEY = "shardamp/steps"
CRC_PREFIX = "shardamp/crc/"  # + writer rank: JSON {piece name: CRC32} of that rank's pieces
PathLike = Union[str, "os.PathLike[str]"]
_UNSIGNED = frozenset(m.key for m in MOMENTS if not m.signed)  # never negative: exp_avg_sq
SCALES = "_scales"  # the key suffix of a blockwise moment's block scales


def save_sharded(opt: Any, path: PathLike, scaler: Optional[Any] = None) -> None:
    """Write ``opt``'s state (and ``scaler``'s, if given) to the DCP checkpoint directory
    ``path``. A collective over ``opt.process_group``: every rank calls it; each writes its shard.
    The model's weights are not included: save them separately (e.g. ``model.state_dict()``).

    Crash-safe: the checkpoint is written aside and replaces ``path`` only once every rank has
    written its shard (``atomic_publish.py``); a checkpoint already at ``path`` stays loadable
    until then. Invalid state (NaN hyperparameters, non-finite or negative moments) or a ``path``
    holding something other than a shardamp checkpoint raise on every rank before anything is
    written."""
    path = os.fspath(path)
    opt.param_sync()
    problem = _save_problem(opt, path)
    agreement.agree_on_call(opt.shard_view(), "save_sharded", given=os.path.abspath(path), problem=problem,
                            clips=opt.shard_view().last_clips())
    steps = opt.shard_view().steps.detach().to("cpu", copy=True)
    slots = sd_mod.slots_by_index(opt)
    blockwise = {m.key: fmt for m, fmt in opt.shard_view().formats.items() if fmt.blockwise}
    meta = {
        "format": FORMAT,
        "shapes": [list(s.shape) for s in slots],
        "param_groups": [_jsonable_group(g, i) for i, g in enumerate(sd_mod.torch_param_groups(opt))],
        sd_mod.EXTRA_KEY: sd_mod.extras(opt),
        "scaler": _jsonable_scaler(scaler),
        "steps_crc": atomic_publish.tensor_crc(steps),
        "block_offsets": {k: [s.offset % fmt.block_size for s in slots] for k, fmt in blockwise.items()},
    }
    blob = json.dumps(meta, sort_keys=True).encode()
    meta_tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    state: Dict[str, Tensor] = {META_KEY: meta_tensor, STEPS_KEY: steps}
    crcs: Dict[str, int] = {}
    for bucket, buf in zip(opt.shard_view().buckets, opt.shard_view().buffers):
        sources = [(moment.key, fmt.state_dict_value(t)) for moment, fmt, t in buf.moments() if not fmt.blockwise]
        quantized = [(moment.key, fmt.block_size, sd_quant.gathered_values(t).to(torch.uint8), t.scales)
                     for moment, fmt, t in buf.moments() if fmt.blockwise]
        if sd_mod.has_master(opt, bucket.dtype):
            sources.append((sd_mod.MASTER_KEY, buf.master_values()))  # fp32, also from remainders
        # replicas (comm.py's replicate dim) hold the same shard: only the first one writes it
        for seg in bucket.segments.segments if opt.shard_view().comm.replicate_rank == 0 else ():
            if steps[seg.param_index] <= 0:  # never updated: no state, as in torch
                continue
            pieces = [(key, src[seg.start : seg.start + seg.length]) for key, src in sources]
            for key, block, codes, scales in quantized:
                first, end = seg.start // block, (seg.start + seg.length + block - 1) // block
                pieces += [(key, codes[seg.start : seg.start + seg.length]), (key + SCALES, scales[first:end])]
            for key, src in pieces:
                # a copy: DCP must not serialise the whole shard behind a view
                piece = src.to("cpu", copy=True)
                name = f"state/{seg.param_index}/{key}/{seg.param_offset}"
                state[name] = piece
                crcs[name] = atomic_publish.tensor_crc(piece)
    state[f"{CRC_PREFIX}{opt.rank}"] = _json_tensor(crcs)
    staged = atomic_publish.staging_dir(path)
    failure = ""
    if opt.rank == 0:
        try:
            atomic_publish.prepare(path)
        except OSError as exc:
            failure = f"cannot create {staged}: {exc}"
    agreement.agree_on_call(opt.shard_view(), "save_sharded (staging)", problem=failure)
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=staged, process_group=_group(opt), no_dist=_no_dist())
    if opt.rank == 0:  # DCP returns on every rank once all shards and its metadata are written
        try:
            atomic_publish.publish(path, {"format": FORMAT, "world_size": opt.world_size,
                                          "meta_crc": atomic_publish.tensor_crc(meta_tensor)})
        except OSError as exc:
            failure = f"could not publish {staged} as {path}: {exc}"
    agreement.agree_on_call(opt.shard_view(), "save_sharded (publish)", problem=failure)


def _save_problem(opt: Any, path: str) -> str:
    problem = atomic_publish.problem_for_save(path)
    if not problem:
        problem = validate_groups(opt.param_groups, read_lr=True)
    if not problem:
        for i, buf in enumerate(opt.shard_view().buffers):
            moments = [(moment, t.scales if fmt.blockwise else fmt.state_dict_value(t))
                       for moment, fmt, t in buf.moments()]
            if not all(bool(torch.isfinite(t).all()) for _, t in moments):
                problem = f"bucket {i}: the moments hold non-finite values"
            else:
                problem = next((f"bucket {i}: {moment.key} holds negative values" for moment, t in moments
                                if not moment.signed and bool((t < 0).any())), "")
            if problem:
                break
    return problem


def _json_tensor(value: Any) -> Tensor:
    return torch.frombuffer(bytearray(json.dumps(value, sort_keys=True).encode()), dtype=torch.uint8)


def load_sharded(opt: Any, path: PathLike, scaler: Optional[Any] = None) -> None:
    """Load a checkpoint written by :func:`save_sharded` (at any world size and bucket layout)
    into ``opt`` (and ``scaler``). A collective over ``opt.process_group``. Load the model's
    weights first: master params not in the checkpoint come from them. Everything is validated
    (on every rank alike) before anything is written; a mismatch raises ``ValueError``."""
    path = os.fspath(path)
    problem = atomic_publish.problem_for_load(path)
    if not problem:
        pieces, dtypes, sizes = _index(path)
        problem = next((f"{path} is not a shardamp checkpoint (no '{key}')"
                        for key in (META_KEY, STEPS_KEY) if key not in sizes), "")
    agreement.agree_on_call(opt.shard_view(), "load_sharded", given=os.path.abspath(path), problem=problem)
    crc_keys = [k for k in sizes if k.startswith(CRC_PREFIX)]
    head = {META_KEY: torch.empty(sizes[META_KEY], dtype=torch.uint8),
            STEPS_KEY: torch.empty(sizes[STEPS_KEY], dtype=torch.float32)}
    head.update({k: torch.empty(sizes[k], dtype=torch.uint8) for k in crc_keys})
    with _single_process_quiet():
        dcp.load(head, checkpoint_id=path, process_group=_group(opt), no_dist=_no_dist())
    if atomic_publish.tensor_crc(head[META_KEY]) != atomic_publish.read_marker(path).get("meta_crc"):
        raise ValueError(f"load_sharded: {path}: the checkpoint's metadata does not match its checksum (corrupted)")
    meta = json.loads(bytes(head[META_KEY].tolist()).decode())
    steps = head[STEPS_KEY]
    if atomic_publish.tensor_crc(steps) != meta.get("steps_crc"):
        raise ValueError(f"load_sharded: {path}: the step counts do not match their checksum (corrupted)")
    crcs: Dict[str, int] = {}
    for k in crc_keys:
        crcs.update(json.loads(bytes(head[k].tolist()).decode()))
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
    for bucket in opt.shard_view().buckets:
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
                        scales = name.replace(f"/{key}/", f"/{key}{SCALES}/")
                        if scales in sizes:  # codes of a blockwise moment: their scales too
                            needed[scales] = torch.empty(sizes[scales], dtype=dtypes[scales])
                elif not problem:
                    problem = f"incomplete checkpoint: param {i} '{key}' elements [{lo}, {hi}) are missing"
    agreement.agree_on_call(opt.shard_view(), "load_sharded (plan)", problem=problem)

    # ---- read (into temporaries: a failure here leaves the optimizer untouched), check, then write
    with _single_process_quiet():
        dcp.load(needed, checkpoint_id=path, process_group=_group(opt), no_dist=_no_dist())
    for name in sorted(needed):
        problem = problem or atomic_publish.check_crc(name, needed[name], crcs) or ""
        if not problem and not bool(torch.isfinite(needed[name]).all()):
            problem = f"'{name}' holds non-finite values"
        if not problem and name.split("/")[2] in _UNSIGNED and bool((needed[name] < 0).any()):
            problem = f"'{name}' holds negative values (a second moment is >= 0)"
        if not problem and name.split("/")[2].endswith(SCALES) and bool((needed[name] < 0).any()):
            problem = f"'{name}' holds negative block scales"
    if not problem:
        try:  # blockwise codes read as fp32 values, quantized again by write_state
            _dequantize_pieces(needed, meta, sizes)
        except ValueError as exc:
            problem = str(exc)
    agreement.agree_on_call(opt.shard_view(), "load_sharded (read)", problem=f"{path}: {problem}" if problem else "")
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
def _dequantize_pieces(needed: Dict[str, Tensor], meta: Dict[str, Any], sizes: Dict[str, Tuple[int, ...]]) -> None:
    """Replace each blockwise moment's codes piece in ``needed`` by its fp32 values (its scales
    piece and the metadata's block offsets and extras read it)."""
    extras = meta.get(sd_mod.EXTRA_KEY) or {}
    for name in sorted(needed):
        _, i, key, off = name.split("/")
        scales_name = f"state/{i}/{key}{SCALES}/{off}"
        if key.endswith(SCALES) or scales_name not in needed:
            continue
        info = extras.get(key + sd_quant.QUANT) or {}
        moment = next((m for m in MOMENTS if m.key == key), None)
        offsets = (meta.get("block_offsets") or {}).get(key)
        if moment is None or not info or offsets is None or int(i) >= len(offsets):
            raise ValueError(f"'{name}' holds codes, but the metadata does not say how they read")
        qmap, block = quant.code_map(info["map"], info["bits"], moment.signed), info["block_size"]
        codes, scales = needed[name], needed[scales_name]
        start = (offsets[int(i)] + int(off)) % block
        if (int(codes.max()) if codes.numel() else 0) >= qmap.numel() or scales.numel() * block < start + codes.numel():
            raise ValueError(f"'{name}': codes or scales out of range (a corrupted checkpoint)")
        needed[name] = qmap[codes.long()] * scales.repeat_interleave(block)[start:start + codes.numel()]


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
    return None if _no_dist() else opt.shard_view().comm.group


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
