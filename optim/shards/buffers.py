"""The flat tensors behind each bucket, and the model params as views into them.

Per bucket, on every rank:
  * ``params``: the whole bucket in the model dtype; every model param is an ``as_strided``
    view of it with the param's own strides, so the all-gather writes the model in place;
  * ``sync``: the whole bucket in ``param_sync_dtype``, only when that differs from the model
    dtype (the one case that needs a cast pass after the all-gather);
  * ``grad_shard``: this rank's reduced grads (``grad_sync_dtype``); at world 1 it is the
    bucket buffer backward writes into, released at ``zero_grad`` unless capturable;
  * ``master``: this rank's shard of the master params in the state dtype. When the model
    dtype equals the state dtype (and no lower-precision all-gather rounds the params),
    ``master`` IS this rank's slice of ``params``: no copy exists. With param remainders
    (bf16 model, fp32 master) it is int16: the low 16 bits of each fp32 master, whose high 16
    bits are this rank's slice of ``params`` (``reference.join_remainders``);
  * ``exp_avg``, ``exp_avg_sq``: this rank's shard of the moments, each in its own format
    (``state_formats.py``: the state dtype by default, bf16 on request; a blockwise format is a
    ``quant.QuantizedShard`` of codes and block scales, its blocks on the bucket's grid);
  * ``host``: with ``offload="cpu"``, the bucket's ``host_state.HostShard``; ``master`` and the
    moments are then ITS host tensors (never an alias of ``params``), so every reader of the
    state (state dicts, checkpoints, ``memory_stats``) reads them where they live.
The full-size grad buffer a bucket fills during backward is managed by ``grad_sync.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _compat
from ..checks.misuse import ddp_error, find_ddp
from .. import kernels
from ..layout import Bucket, ParamSlot
from ..kernels.quant import QuantizedShard
from ..kernels.reference import join_remainders, split_remainders
from ..state_formats import Moment, MomentFormats, StateFormat


def param_view(buffer: Tensor, slot: ParamSlot) -> Tensor:
    """``slot``'s param inside a flat bucket buffer, in the param's own memory layout."""
    return buffer.as_strided(slot.shape, slot.stride, buffer.storage_offset() + slot.offset)


def param_alias(buffer: Tensor, slot: ParamSlot) -> Tensor:
    """As :func:`param_view`, but with a storage of its own that aliases the param's bytes of
    ``buffer``. Code that groups tensors by storage (safetensors' ``save_model``/``load_model``,
    transformers' ``save_pretrained``, ``torch.save``) then sees each param alone, as it would
    without the optimizer, instead of refusing (or de-duplicating) params that share a buffer."""
    return _compat.storage_alias(buffer, buffer.storage_offset() + slot.offset, slot.numel, slot.shape, slot.stride)


@dataclass(eq=False)
class HeldGrads:
    """One process: a bucket's grads left where autograd put them (the zero-copy landing,
    sync/merged_landings.py), as the native stager hands them over: ``parts``, its
    ``HeldParts`` (csrc/grad_parts.h: each grad in its param's slot of the shard; no Python
    object per grad). The step reads them in place; whatever else reads the shard makes it first
    (:attr:`BucketBuffers.grad_shard`). ``marker``: an empty tensor of their dtype, what the
    step's launch takes in the shard's place."""

    parts: Any
    marker: Tensor
    numel: int  # the shard's elements


@dataclass
class BucketBuffers:
    params: Tensor
    sync: Optional[Tensor]
    grad_store: Optional[Tensor]  # the grad shard, or None while released (see grad_shard)
    master: Tensor
    exp_avg: Union[Tensor, QuantizedShard]
    exp_avg_sq: Union[Tensor, QuantizedShard]
    shard: slice
    formats: MomentFormats  # what exp_avg and exp_avg_sq are stored as (state_formats.py)
    grad_dtype: torch.dtype = torch.float32
    host: Optional[Any] = None  # the bucket's host_state.HostShard when its state is offloaded
    held: Optional[HeldGrads] = None  # the grads in place of the shard (world 1), until it is made

    @property
    def grad_shard(self) -> Tensor:
        """This rank's reduced grads. A released shard (world 1 between ``zero_grad`` and the
        next backward: no grads exist, as in torch) comes back as zeros when read; held grads
        (:class:`HeldGrads`) are landed in it first. While a backward may still land it (world
        1: the grad hook's landing plan), read it through ``GradSync``, whose entry points adopt
        what the hook landed first (``GradSync.shard``)."""
        if self.grad_store is None:
            if self.held is not None:
                return self.landing_shard()[0]
            n = self.shard.stop - self.shard.start
            self.grad_store = torch.zeros(n, dtype=self.grad_dtype, device=self.params.device)
        return self.grad_store

    def landing_shard(self) -> Tuple[Tensor, bool]:
        """The shard for a landing of grads, and True where it was released and is now allocated
        uninitialized: that landing must zero what it does not write (``land_grads``'
        ``zero_rest``), so a released shard costs no zero fill of its own. Held grads are landed
        in it first (then it is not fresh)."""
        if self.grad_store is not None:
            return self.grad_store, False
        n = self.shard.stop - self.shard.start
        store = torch.empty(n, dtype=self.grad_dtype, device=self.params.device)
        held = self.held
        if held is None:
            self.grad_store = store
            return store, True
        held.parts.land(store)
        self.grad_store, self.held = store, None
        return store, False

    def release_grad_shard(self) -> None:
        self.grad_store = None
        self.held = None

    def hold_grads(self, held: HeldGrads) -> None:
        """A released shard's grads, left where autograd put them (the grad hook's zero-copy
        landing): the step reads them in place, anything else that reads the shard makes it."""
        if not self.released:
            raise RuntimeError("hold_grads: the shard is held already (read directly while a backward could land it: "
                               "read it through GradSync.shard)")
        self.held = held

    def zero_grads(self) -> None:
        """``zero_grad(set_to_none=False)``: the shard as zeros (held grads dropped, not landed; a
        released shard is allocated as zeros, one fill)."""
        self.held = None
        if self.grad_store is None:
            self.grad_store = torch.zeros(self.shard_numel, dtype=self.grad_dtype, device=self.params.device)
        else:
            self.grad_store.zero_()

    def moments(self) -> List[Tuple[Moment, StateFormat, Union[Tensor, QuantizedShard]]]:
        """This rank's shard of each moment with its format, in ``state_formats.MOMENTS``' order."""
        return [(m, f, getattr(self, m.key)) for m, f in self.formats.items()]

    @property
    def shard_numel(self) -> int:
        return self.shard.stop - self.shard.start

    @property
    def released(self) -> bool:
        """The grad shard is released (no grads exist; reading ``grad_shard`` would allocate zeros)."""
        return self.grad_store is None and self.held is None

    def adopt_grad_shard(self, shard: Tensor) -> None:
        """A released shard allocated (and landed in) elsewhere: the grad hook's planned landing."""
        # the fields read here, not through ``released`` and ``shard_numel``: once a bucket at each backward's end
        if (self.grad_store is not None or self.held is not None or shard.numel() != self.shard.stop - self.shard.start
                or shard.dtype != self.grad_dtype):
            raise RuntimeError("adopt_grad_shard: the shard is held already (read directly while a backward could "
                               "land it: read it through GradSync.shard), or the new one does not fit")
        self.grad_store = shard

    @property
    def remainders(self) -> bool:
        """The master is stored as int16 low halves under the bf16 param shard."""
        return self.master.dtype == torch.int16

    def master_values(self) -> Tensor:
        """This rank's master shard at full precision (a new tensor for remainders)."""
        if self.remainders:
            return join_remainders(self.params[self.shard], self.master)
        return self.master

    def set_master(self, dst: slice, values: Tensor) -> None:
        """Write full-precision master values into elements ``dst`` of the shard. With
        remainders this also rewrites those elements of the bf16 param shard (their high
        halves), so the master is restored bit for bit."""
        if self.remainders:
            hi, lo = split_remainders(values.to(device=self.master.device, dtype=torch.float32))
            self.params[self.shard][dst].copy_(hi)
            self.master[dst].copy_(lo)
        else:
            self.master[dst].copy_(values)

    def model_out(self) -> Optional[Tensor]:
        """Where the step writes the model-dtype copy of the updated master shard, if anywhere."""
        if self.sync is not None:
            return self.sync[self.shard]
        if self.master.data_ptr() == self.params[self.shard].data_ptr():
            return None
        return self.params[self.shard]


class ShardGrads(Sequence[Tensor]):
    """Every bucket's grad shard (``BucketBuffers.grad_shard``), each made only when read. Where
    a bucket's grads are held in place (:class:`HeldGrads`), the step's native launch reads them
    through :meth:`for_step` instead (``kernels.adam_launch.native_launches``), and no shard is made."""

    def __init__(self, buffers: Sequence[BucketBuffers]) -> None:
        self._buffers = buffers

    def __len__(self) -> int:
        return len(self._buffers)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [b.grad_shard for b in self._buffers[index]]
        return self._buffers[index].grad_shard

    def held(self, index: int) -> Optional[HeldGrads]:
        """Bucket ``index``'s grads where autograd left them, or None (its shard is read)."""
        return self._buffers[index].held

    def for_step(self, order: Sequence[int]) -> List[Tuple[Tensor, Optional[HeldGrads]]]:
        """Per bucket of ``order``: ``(its grad shard, None)``, or where its grads are held in place
        ``(the held grads' marker, the held grads)``: what the step's launch reads, in one call
        (the shard made only where it was released)."""
        out: List[Tuple[Tensor, Optional[HeldGrads]]] = []
        for b in map(self._buffers.__getitem__, order):
            held = b.held
            if held is not None:
                out.append((held.marker, held))
            else:
                store = b.grad_store
                out.append((store if store is not None else b.grad_shard, None))
        return out


def allocate(
    bucket: Bucket,
    params: Sequence[torch.nn.Parameter],
    gathers_params: bool,
    state_dtype: torch.dtype,
    grad_sync_dtype: torch.dtype,
    param_sync_dtype: torch.dtype,
    formats: MomentFormats,
    host: Optional[Any] = None,
) -> BucketBuffers:
    """Allocate ``bucket``'s buffers and turn its params into views of the param buffer.

    ``params`` is indexed by ``ParamSlot.index``. The params' current values are copied in;
    the caller broadcasts the buffer so every rank starts from the same weights. The moments
    are zeros in ``formats``. ``gathers_params`` (``Comm.gathers_params``): params are
    all-gathered after the step, so a ``param_sync_dtype`` other than the bucket's gets a buffer.
    ``host``: the bucket's ``host_state.HostShard`` (offloaded): its host moments are taken, and
    nothing of the state is allocated on the device.
    """
    dev = bucket.device
    flat = torch.zeros(bucket.numel, dtype=bucket.dtype, device=dev)
    for slot in bucket.slots:
        p = params[slot.index]
        view = param_alias(flat, slot)
        view.copy_(p.detach())
        p.data = view
    shard = slice(bucket.shard_start, bucket.shard_start + bucket.shard_numel)
    sync = None
    if param_sync_dtype != bucket.dtype and gathers_params:  # comm.py: the shard is not the bucket
        sync = torch.zeros(bucket.numel, dtype=param_sync_dtype, device=dev)
    n = bucket.shard_numel
    return BucketBuffers(
        params=flat,
        sync=sync,
        grad_store=torch.zeros(n, dtype=grad_sync_dtype, device=dev),
        master=flat[shard] if host is None and _master_is_param(bucket.dtype, state_dtype, sync)
        else torch.empty(0),  # init_master
        **{m.key: moment_zeros(f, m, n, bucket.shard_start, dev) if host is None else getattr(host, m.key)
           for m, f in formats.items()},
        shard=shard,
        formats=formats,
        grad_dtype=grad_sync_dtype,
        host=host,
    )


def moment_zeros(fmt: StateFormat, moment: Moment, numel: int, offset: int,
                 device: torch.device) -> Union[Tensor, QuantizedShard]:
    """A zero shard of ``moment`` in ``fmt``: a tensor of the storage dtype, or for a blockwise
    format its codes and scales (``offset``: the shard's first bucket element, on the grid)."""
    if fmt.blockwise:
        return QuantizedShard.zeros(fmt, moment.signed, numel, offset, device)
    return fmt.zeros(numel, device)


def moment_nbytes(stored: Union[Tensor, QuantizedShard]) -> int:
    """Bytes a moment's shard holds as allocated (codes plus scales for a blockwise one)."""
    if isinstance(stored, QuantizedShard):
        return stored.nbytes
    return stored.numel() * stored.element_size()


def _master_is_param(param_dtype: torch.dtype, state_dtype: torch.dtype, sync: Optional[Tensor]) -> bool:
    """The master shard can BE this rank's slice of the param buffer only when nothing else is
    written there: same dtype, and no lower-precision all-gather whose rounded values every
    rank (this one too) must see, so that all ranks hold the same model."""
    return state_dtype == param_dtype and sync is None


def check_remainders(dtype: torch.dtype, param_sync_dtype: Optional[torch.dtype], params: List[torch.dtype]) -> None:
    """store_param_remainders splits an fp32 master into a bf16 param and an int16 low half:
    only bf16 params under an fp32 master, all-gathered as bf16, can be split that way."""
    fix = "; or pass store_param_remainders=False"
    if dtype != torch.float32:
        raise ValueError(f"store_param_remainders=True needs dtype=torch.float32 (the master), got {dtype}{fix}")
    if param_sync_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"store_param_remainders=True needs param_sync_dtype None or torch.bfloat16 (the params are the "
            f"master's high halves and must be all-gathered as they are), got {param_sync_dtype}{fix}")
    bad = sorted({str(d) for d in params if d not in (torch.bfloat16, torch.float32)})
    if bad or torch.bfloat16 not in params:
        raise ValueError(
            "store_param_remainders=True needs bfloat16 params (float32 params are their own master and are "
            f"left as they are); this model has {bad or 'no bfloat16 params'}{fix}")


def uses_remainders(param_dtype: torch.dtype, state_dtype: torch.dtype, store_param_remainders: bool) -> bool:
    """A bucket keeps int16 remainders instead of an fp32 master: asked for, and a bf16 model
    under an fp32 master (the constructor has checked the all-gather dtype)."""
    return store_param_remainders and param_dtype == torch.bfloat16 and state_dtype == torch.float32


def allocate_all(buckets: Sequence[Bucket], params: Sequence[torch.nn.Parameter], comm: Any, dtype: torch.dtype,
                 grad_sync_dtype: Optional[torch.dtype], param_sync_dtype: Optional[torch.dtype],
                 formats: MomentFormats, store_param_remainders: bool,
                 host: Optional[Sequence[Optional[Any]]] = None) -> List[BucketBuffers]:
    """Every bucket's buffers (``allocate``), the params broadcast from the group's rank 0 (every
    rank starts from rank 0's weights, as DDP does: a collective over ``comm``), and the masters
    initialised from them. ``host[i]``: bucket ``i``'s ``HostShard`` where it is offloaded."""
    out: List[BucketBuffers] = []
    for i, bucket in enumerate(buckets):
        out.append(allocate(bucket, params, comm.gathers_params, dtype, grad_sync_dtype or bucket.dtype,
                            param_sync_dtype or bucket.dtype, formats, None if host is None else host[i]))
    for buf in out:
        comm.broadcast(buf.params)
    for buf in out:
        init_master(buf, dtype, store_param_remainders)
    return out


def adam_launches(buffers: Sequence[BucketBuffers], buckets: Sequence[Bucket], record_offsets: Sequence[int],
                  steps: Tensor, coef: Tensor, adam_w_mode: bool, bias_correction: bool,
                  current: Optional[List["kernels.AdamLaunch"]] = None) -> List["kernels.AdamLaunch"]:
    """Each bucket's step launch over its persistent state (a param re-attached after a broken
    view keeps it), the step counts and the grad coefficient (device tensors written in place
    every step). The grad shard (None here: none is held between steps), the hyperparameter
    table, the records, the touched pattern and the skip flag are the step's:
    ``kernels.launch_adam_all`` takes them each step (until then the step counts stand in for
    them). ``adam_w_mode`` and ``bias_correction`` are fixed here: ``current`` (the launches built
    before) is returned as it is unless a loaded state dict changed them."""
    if current and (current[0].adam_w_mode, current[0].bias_correction) == (adam_w_mode, bias_correction):
        return current
    return [kernels.AdamLaunch(None, buf.master, buf.exp_avg, buf.exp_avg_sq, buf.model_out(),
                               bucket.segments, steps, steps, steps, coef, steps, adam_w_mode, bias_correction, None,
                               record_offsets[i])
            for i, (buf, bucket) in enumerate(zip(buffers, buckets))]


def init_master(buffers: BucketBuffers, state_dtype: torch.dtype, store_param_remainders: bool = False) -> None:
    """(Re)create the master shard from the (broadcast) model params."""
    local = buffers.params[buffers.shard]
    if buffers.host is not None:  # offloaded: the host master, a copy (the host never aliases the params)
        buffers.master = buffers.host.master
        buffers.master.copy_(local)
    elif uses_remainders(buffers.params.dtype, state_dtype, store_param_remainders):
        # the master starts as the bf16 weight itself: high half = the param, low half = 0
        buffers.master = torch.zeros(local.numel(), dtype=torch.int16, device=local.device)
    elif _master_is_param(buffers.params.dtype, state_dtype, buffers.sync):
        buffers.master = local
    else:
        buffers.master = local.to(state_dtype, copy=True)  # never an alias of the params
    if buffers.sync is not None:
        buffers.sync.copy_(buffers.params)


def check_views(params: Sequence[Tensor], refs: List[Tensor], reattach: Callable[[int], bool],
                native: Optional[Any] = None) -> None:
    """Raise if a model param no longer lives in its bucket (``module.to(dtype)``, ``p.data = ...``).

    Called every step, so the common case is one native pass (``refs``: detached copies of the
    params' views taken at construction) over data pointers, dtypes, shapes and strides (a
    same-address view of another shape would also be a break); only a failing or unavailable
    native check walks the params here, to name the one that broke. ``reattach(i)`` is asked
    first to put param ``i`` back into its bucket when that loses nothing (a ``.to()`` onto the
    device it already lives on made a copy); it returns success. ``native``: the
    ``kernels.view_check(refs)`` that makes the common case one native pass (``params`` then a
    list), or None."""
    if native is not None and native.intact(params):
        return
    for i, (p, ref) in enumerate(zip(params, refs)):
        grad = _compat.raw_grad(p)  # autograd's own field: p.grad shows the optimizer's grads (torch_tools.py)
        if grad is not None:
            ddp = find_ddp(params)
            if ddp is not None:
                raise ddp_error(ddp)
        # a zero-element param has no storage to compare (its data_ptr is 0): shape and dtype only
        moved = p.data_ptr() != ref.data_ptr() and p.numel() > 0
        # checked before the stray grad: a new dtype or device also gives the param a new grad
        # accumulator, without the optimizer's hook, so its grad stays in .grad
        if moved or p.dtype != ref.dtype or p.shape != ref.shape or p.stride() != ref.stride():
            if grad is None and reattach(i):
                continue
            raise RuntimeError(
                f"DistributedFusedAdam: parameter {i} (shape {tuple(p.shape)}, dtype "
                f"{p.dtype}) no longer lives in the optimizer's flat buffer, so updates would be "
                "lost. Something replaced its storage (module.to(dtype/device), p.data = ..., "
                "load_state_dict(assign=True)). Move and cast the model BEFORE building the "
                "optimizer, and load weights with load_state_dict(assign=False)."
            )
        if grad is not None:
            raise RuntimeError(
                f"DistributedFusedAdam: parameter {i} (shape {tuple(p.shape)}) has a .grad the "
                "optimizer never received, so it would not be trained. Its grad hook exists only "
                "if it required grad when the optimizer was built: build the optimizer with every "
                "param that will ever train requiring grad (freeze by zeroing its lr in its param "
                "group instead), and do not assign param.grad by hand."
            )


def reattach_param(buffers: BucketBuffers, slot: ParamSlot, p: Tensor, device: torch.device) -> bool:
    """Put ``p`` back into its bucket if its storage was replaced by a same-device, same-layout
    copy (``module.to("cpu:0")`` on CPU params copies): its current values are taken over, also
    into this rank's master shard where that is separate (only the elements whose model value
    changed, so unchanged ones keep the master's full precision). False if it cannot be."""
    if p.device != device or p.dtype != buffers.params.dtype or tuple(p.shape) != slot.shape \
            or tuple(p.stride()) != slot.stride:
        return False
    lo = max(slot.offset, buffers.shard.start)
    hi = min(slot.offset + slot.numel, buffers.shard.stop)
    before = buffers.params[lo:hi].clone() if buffers.remainders and lo < hi else None
    alias = param_alias(buffers.params, slot)
    alias.copy_(p.detach())
    p.data = alias
    if before is not None:
        # the bf16 param IS the master's high half: where the value changed, the new bf16 value is
        # the whole master (remainder 0); unchanged elements keep their low bits
        remainder = buffers.master[lo - buffers.shard.start:hi - buffers.shard.start]
        remainder.masked_fill_(buffers.params[lo:hi] != before, 0)
    elif buffers.master.data_ptr() != buffers.params[buffers.shard].data_ptr():
        if lo < hi:
            master = buffers.master[lo - buffers.shard.start:hi - buffers.shard.start]
            model = buffers.params[lo:hi].to(master.device)  # an offloaded master lives on the host
            sync_dtype = buffers.sync.dtype if buffers.sync is not None else model.dtype
            shown = master.to(sync_dtype).to(model.dtype)  # what the model holds for this master
            master.copy_(torch.where(model != shown, model.to(master.dtype), master))
    return True


def memory_stats(buffers: List[BucketBuffers], alive_full: List[Tensor]) -> dict:
    """Bytes by kind for ``DistributedFusedAdam.memory_stats`` (its docstring says what each is):
    the device's kinds and their ``total``, then the offloaded buckets' host kinds and their
    ``host_total``."""
    def nbytes(t: Optional[Tensor]) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    stats = {"master": 0, "moments": 0, "grad_shards": 0, "grad_buckets": 0, "param_sync": 0}
    host = {"host_master": 0, "host_moments": 0, "host_copies": 0}
    for buf in buffers:
        moments = sum(moment_nbytes(t) for _, _, t in buf.moments())
        if buf.host is not None:
            host["host_master"] += nbytes(buf.master)
            host["host_moments"] += moments
            host["host_copies"] += buf.host.copies_nbytes()
        else:
            aliased = buf.master.data_ptr() == buf.params[buf.shard].data_ptr()
            stats["master"] += 0 if aliased else nbytes(buf.master)
            stats["moments"] += moments
        stats["grad_shards"] += nbytes(buf.grad_store) + (buf.held.parts.nbytes if buf.held else 0)
        stats["param_sync"] += nbytes(buf.sync)
    stats["grad_buckets"] = sum(nbytes(t) for t in alive_full)
    stats["total"] = sum(stats.values())
    stats.update(host, host_total=sum(host.values()))
    return stats
