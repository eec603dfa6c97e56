"""The optimizer state in host memory (``offload="cpu"``) and the offloaded step.

A :class:`HostState` holds, per offloaded bucket, a :class:`HostShard`: this rank's fp32 master
and moments in their formats (``state_formats.py``: host state is one more place a format lives),
the host copy of the reduced grad shard and, where the device's model-dtype shard is not the
master's dtype, the return buffer the CPU kernel writes the new params into. On a CUDA device
they are pinned and the copies run on one side stream; on a CPU device the same code runs with
separate host tensors and plain host-to-host copies (no stream), so CPU ranks test the offloaded
path itself.

Which buckets (:func:`choose_buckets`): ``offload_fraction`` of the state bytes, counted over the
buckets' full sizes (every rank shares them), rounded UP to whole buckets, taken in the order
their grads land in backward (bucket 0 first: the model's last layers), so their copies to the
host have the most of backward left to hide under.

The optimizer reaches this module through one object, built at construction and handed to
``GradSync`` (the landing: :meth:`HostState.landed`, :meth:`HostState.dropped`) and used by
``step`` (:meth:`HostState.launch_step`, ``fused_step.launch_step``'s signature; without
offloaded buckets it IS that function). The host state is allocated before any device state and
before the params are broadcast, after every rank has agreed that the host has the memory, and
a failed pinned allocation is agreed on too, so every rank raises the same error.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _compat, config, kernels, offload
from ..checks import agreement
from ..kernels import fused_step
from ..kernels.quant import QuantizedShard
from ..layout import Bucket, SegmentTable
from ..offload import OffloadOptions
from ..state_formats import MomentFormats
from .buffers import moment_zeros

CAPTURE_ERROR = (
    "DistributedFusedAdam.step: the optimizer offloads its state to the host (offload='cpu'), and an offloaded "
    "step reads its grad coefficient on the host and updates the state on the CPU, which a CUDA graph cannot "
    "capture; step outside the captured region, or build the optimizer with offload=None to capture the step")


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> Tensor:
    """An uninitialized host tensor, page-locked where ``pin`` (the one allocation of host state)."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)


def choose_buckets(buckets: Sequence[Bucket], bytes_per_element: float, fraction: float) -> List[int]:
    """The buckets whose state goes to the host: from bucket 0 (its grads land first) on, the
    first run whose state bytes (full bucket sizes, the same on every rank) reach ``fraction`` of
    all buckets' (rounded up to whole buckets); none for 0, all for 1."""
    sizes = [b.numel * bytes_per_element for b in buckets]
    target = fraction * sum(sizes)
    chosen: List[int] = []
    held = 0.0
    for b, size in zip(buckets, sizes):
        if held >= target:
            break
        chosen.append(b.index)
        held += size
    return chosen


@dataclass(eq=False)
class HostShard:
    """One offloaded bucket's host tensors (this rank's shard)."""

    index: int  # the bucket
    master: Tensor  # the state dtype (fp32): never an alias of the params
    exp_avg: Union[Tensor, QuantizedShard]
    exp_avg_sq: Union[Tensor, QuantizedShard]
    grad: Tensor  # the reduced grad shard's host copy (grad_sync_dtype)
    out: Optional[Tensor]  # the new params in the device shard's dtype; None: the master is copied back
    segments: SegmentTable  # the bucket's segments with a host-side table (the CPU kernels read it)
    copied: Optional[Tuple[Tensor, int]] = None  # the device shard last copied in, and its version then
    launch: Optional[kernels.AdamLaunch] = None  # the CPU step over these tensors, made at the first step
    launch_of: Optional[kernels.AdamLaunch] = None  # the device launch it was made for

    def copies_nbytes(self) -> int:
        """Bytes of the copy buffers (grad in, params out)."""
        out = 0 if self.out is None else self.out.numel() * self.out.element_size()
        return self.grad.numel() * self.grad.element_size() + out

    def current(self, shard: Tensor) -> bool:
        """The host copy holds ``shard``'s values: copied from this tensor, no in-place op since."""
        c = self.copied
        return c is not None and c[0] is shard and c[1] == _compat.tensor_version(shard)


class HostState:
    """Where an optimizer's offloaded state lives, and its step (the module docstring).

    Args:
        options: the validated ``offload`` options.
        buckets: the layout (this rank's shards).
        device: the params' device (where a bucket's state stays unless offloaded).
        formats: the moments' formats.
        state_dtype: the masters' dtype.
        grad_sync_dtype: the constructor's (None: each bucket's dtype).
        param_sync_dtype: the constructor's (None: each bucket's dtype).
        comm: the optimizer's collectives (where params are all-gathered, the step writes the new
            params into the all-gather's buffer, in ``param_sync_dtype``).
        n_params: the optimizer's param count (the step counts' length).
    """

    def __init__(self, options: OffloadOptions, buckets: Sequence[Bucket], device: torch.device,
                 formats: MomentFormats, state_dtype: torch.dtype, grad_sync_dtype: Optional[torch.dtype],
                 param_sync_dtype: Optional[torch.dtype], comm: Any, n_params: int) -> None:
        self.options = options
        self.device = device
        grad_dtypes = [grad_sync_dtype or b.dtype for b in buckets]
        out_dtypes = [param_sync_dtype if param_sync_dtype and comm.gathers_params else b.dtype for b in buckets]
        self.pin = device.type == "cuda"
        self.stream: Optional[torch.cuda.Stream] = None  # the copies' side stream (CUDA), made at allocate()
        self._event: Optional[torch.cuda.Event] = None
        self._plan = []  # (bucket, grad dtype, out dtype or None) per offloaded bucket
        self.shards: Dict[int, HostShard] = {}
        self.verdict = "fits"
        self.n_buckets = len(buckets)
        if not options.enabled:
            return
        per_element = state_dtype.itemsize + sum(
            f.nbytes(1 << 20) / (1 << 20) for _, f in formats.items())
        chosen = set(choose_buckets(buckets, per_element, options.fraction))
        needed = 0
        for b in buckets:
            if b.index not in chosen:
                continue
            out = None if out_dtypes[b.index] == state_dtype else out_dtypes[b.index]
            self._plan.append((b, grad_dtypes[b.index], out))
            n = b.shard_numel
            needed += n * state_dtype.itemsize + sum(f.nbytes(n) for _, f in formats.items())
            needed += n * grad_dtypes[b.index].itemsize + (0 if out is None else n * out.itemsize)
        self.needed = needed
        self.ranks = offload.local_ranks()
        available, source = offload.host_memory_available()
        self.available, self.source = available, source
        self.verdict = offload.memory_verdict(needed, self.ranks, available, source)
        self._formats, self._state_dtype = formats, state_dtype
        self._n_params = n_params
        threads = config.settings().offload_threads
        self.threads = threads if threads > 0 else max(1, offload.host_cores() // self.ranks)

    @property
    def active(self) -> bool:
        """Whether any bucket's state is on the host (else the step is the device's alone)."""
        return bool(self._plan)

    def state_devices(self) -> List[torch.device]:
        """Where each bucket's master and moments live (decided at construction, before anything is
        allocated): the host for an offloaded bucket (the CPU kernels step it), else the params'
        device. What the construction's format check asks (``kernels.check_formats``: blockwise
        moments need the CUDA kernel only for a bucket whose state stays on a GPU)."""
        offloaded = {b.index for b, _, _ in self._plan}
        return [torch.device("cpu") if i in offloaded else self.device for i in range(self.n_buckets)]

    # ------------------------------------------------------------------ construction
    def agreed(self) -> Dict[str, Any]:
        """The construction agreement's ``offload`` field: the options and, with offload, whether
        the host has the memory (every rank must see it fit)."""
        if not self.options.enabled:
            return self.options.agreed()
        return {"host memory": self.verdict, **self.options.agreed()}

    def allocate(self, comm: Any) -> None:
        """Allocate the host state (pinned on CUDA), after the agreement, before any device state.

        A collective where there are peers and buckets to offload: one all-gather of the
        allocation's outcome (the construction agreement's), so a failed pin raises on every rank.

        Raises:
            RuntimeError: too little host memory for the ranks on this host (naming the bytes
                needed and available, and where that number comes from), or pinning failed.
        """
        if self.verdict != "fits":
            raise RuntimeError(
                f"DistributedFusedAdam(offload='cpu'): too little host memory: the offloaded state (fp32 master, "
                f"moments, the grad and param copies) needs {self.needed} B per rank, {self.needed * self.ranks} B "
                f"for the {self.ranks} rank(s) on this host (LOCAL_WORLD_SIZE), and {self.available} B are "
                f"available ({self.source}); pass a smaller offload_fraction, run fewer ranks per host, or free "
                "host memory. Nothing was allocated.")
        if not self._plan:
            return
        if self.pin:
            self.stream, self._event = torch.cuda.Stream(self.device), torch.cuda.Event()
        outcome = "allocated"
        try:
            for bucket, grad_dtype, out_dtype in self._plan:
                self.shards[bucket.index] = self._allocate(bucket, grad_dtype, out_dtype)
            n = self._n_params
            self._steps_h = host_empty(n, torch.float32, self.pin)
            self._touched_h = host_empty(n, torch.float32, self.pin)
            self._coef_h = torch.empty((), dtype=torch.float32, pin_memory=self.pin)
            self._skip_h = torch.empty((), dtype=torch.float32, pin_memory=self.pin)
        except RuntimeError as exc:
            self.shards.clear()
            outcome = (f"allocating {self.needed} B of {'pinned ' if self.pin else ''}host memory failed: "
                       f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        if comm.has_peers:
            agreement.agree_on_construction(comm, self.device, {"offloaded state allocated on the host": outcome})
        if outcome != "allocated":
            raise RuntimeError(
                f"DistributedFusedAdam(offload='cpu'): {outcome}. Page-locked memory is capped by the container's "
                "locked-memory limit (ulimit -l, docker --ulimit memlock) besides the host's memory; raise it, or "
                "pass a smaller offload_fraction. Nothing was allocated on the device.")
        self._hp_h: Optional[Tensor] = None

    def _allocate(self, bucket: Bucket, grad_dtype: torch.dtype, out_dtype: Optional[torch.dtype]) -> HostShard:
        n = bucket.shard_numel
        moments: Dict[str, Any] = {}
        for m, f in self._formats.items():
            if f.blockwise:  # codes and scales: only the CPU kernels read them, never copied (not pinned)
                moments[m.key] = moment_zeros(f, m, n, bucket.shard_start, torch.device("cpu"))
            else:
                moments[m.key] = host_empty(n, f.storage_dtype, self.pin).zero_()
        return HostShard(bucket.index, host_empty(n, self._state_dtype, self.pin), moments["exp_avg"],
                         moments["exp_avg_sq"], host_empty(n, grad_dtype, self.pin).zero_(),
                         None if out_dtype is None else host_empty(n, out_dtype, self.pin).zero_(),
                         SegmentTable.build(bucket.segments.segments, torch.device("cpu")))

    def by_bucket(self) -> List[Optional[HostShard]]:
        """Each bucket's host shard, or None where its state stays on the device."""
        return [self.shards.get(i) for i in range(self.n_buckets)]

    # ------------------------------------------------------------------ backward (GradSync's)
    def landed(self, index: int, shard: Tensor) -> None:
        """Bucket ``index``'s reduced grad shard has landed (queued on the current stream): copy it to
        its host buffer, on the side stream after what is queued so far (CUDA), else at once."""
        hs = self.shards.get(index)
        if hs is not None:
            self._copy_in(hs, shard)

    def dropped(self) -> None:
        """``zero_grad``: no host copy is current any more (and none holds a device shard)."""
        for hs in self.shards.values():
            hs.copied = None

    def _copy_in(self, hs: HostShard, shard: Tensor) -> None:
        if self.stream is None:
            hs.grad.copy_(shard)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                hs.grad.copy_(shard, non_blocking=True)
            shard.record_stream(self.stream)  # a shard released meanwhile is reused only after the copy
        hs.copied = (shard, _compat.tensor_version(shard))

    # ------------------------------------------------------------------ the step
    def launch_step(self, coef_out: Tensor, coef_parts: Tuple[Tensor, float, Optional[Tensor], float],
                    found_inf: Tensor, steps: Tensor, touched: Tensor, health: Dict[str, Any],
                    launches: Sequence[kernels.AdamLaunch], order: Sequence[int], grads: Sequence[Tensor],
                    hparams: Tensor, prepare: kernels.StepRecords, bias_correction: bool,
                    after_bucket: Optional[Callable[[int], None]] = None) -> None:
        """The step's launches (``fused_step.launch_step``'s contract). Without offloaded buckets,
        that function. With them: the scalar launch; the step's scalars queued for the host behind
        the grad copies (side stream); the device buckets' kernels, each followed by its
        all-gather; then ONE host wait for those scalars (the one host sync of an offloaded
        step); unless the step is skipped, each
        offloaded bucket in ``order`` stepped by the CPU kernels, its new params copied back
        (side stream) and its all-gather after the copy. A skipped step runs no CPU kernel and
        copies nothing back: the host state is untouched. No collective beyond the all-gathers.

        Raises:
            RuntimeError: called while a CUDA graph is being captured.
        """
        if not self.shards:
            fused_step.launch_step(coef_out, coef_parts, found_inf, steps, touched, health, launches, order, grads,
                                   hparams, prepare, bias_correction, after_bucket)
            return
        self.refuse_capture()
        base, scale, norm, max_norm = coef_parts
        kernels.step_scalars(coef_out, base, scale, norm, max_norm, found_inf, steps, touched, health)
        skip = health.get("skip_out")
        skip = found_inf if skip is None else skip
        on_host = [i for i in order if i in self.shards]
        for i in on_host:  # a shard changed since its landing (a fold, a zero fill) or never copied
            if not self.shards[i].current(grads[i]):
                self._copy_in(self.shards[i], grads[i])
        self._copy_scalars(coef_out, skip, steps, touched, hparams)  # behind the scalar launch, not the kernels
        on_device = [i for i in order if i not in self.shards]
        if on_device:  # on the GPU while the host waits for the scalars and steps its buckets
            records = prepare.compute(hparams, steps, touched, coef_out, skip, bias_correction)
            for i in on_device:
                kernels.launch_adam_all(launches, (i,), grads, hparams, touched, skip, records)
                if after_bucket is not None:
                    after_bucket(i)
        if self._event is not None:
            self._event.synchronize()  # THE host sync of an offloaded step: the scalars and every grad copy
        skipped = self._skip_h.item() != 0  # a host tensor: no sync
        touched_h = self._touched_h.tolist()
        with self._threads():
            for i in on_host:
                if not skipped:
                    self._step_bucket(self.shards[i], launches[i], touched_h)
                if after_bucket is not None:
                    after_bucket(i)

    def refuse_capture(self) -> None:
        """Raise where a CUDA graph is capturing a step of an optimizer with offloaded buckets
        (called first thing in ``step``, before anything is queued). Local; no host sync.

        Raises:
            RuntimeError: the current stream is capturing.
        """
        if self.shards and self.pin and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(CAPTURE_ERROR)

    def _copy_scalars(self, coef: Tensor, skip: Tensor, steps: Tensor, touched: Tensor, hparams: Tensor) -> None:
        """The step's scalars to the host (CUDA: queued on the side stream behind every grad copy
        and the scalar launch, an event recorded after them; ``launch_step`` waits for it: the
        one host read of an offloaded step)."""
        if self._hp_h is None or self._hp_h.shape != hparams.shape or self._hp_h.dtype != hparams.dtype:
            self._hp_h = torch.empty(hparams.shape, dtype=hparams.dtype, pin_memory=self.pin)
        pairs = ((self._coef_h, coef), (self._skip_h, skip), (self._steps_h, steps), (self._touched_h, touched),
                 (self._hp_h, hparams))
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src.reshape(dst.shape))
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src.reshape(dst.shape), non_blocking=True)
            self._event.record(self.stream)

    def _step_bucket(self, hs: HostShard, device_launch: kernels.AdamLaunch, touched: List[float]) -> None:
        """The CPU kernel over ``hs``, then its touched params copied back into the device shard."""
        if hs.launch_of is not device_launch:  # made again where the optimizer rebuilt its launches
            hs.launch = kernels.AdamLaunch(
                None, hs.master, hs.exp_avg, hs.exp_avg_sq, hs.out, hs.segments, self._hp_h, self._steps_h,
                self._touched_h, self._coef_h, self._skip_h, device_launch.adam_w_mode,
                device_launch.bias_correction)
            hs.launch_of = device_launch
        kernels.launch_adam_all([hs.launch], (0,), [hs.grad], self._hp_h, self._touched_h, self._skip_h)
        target = device_launch.model_out  # the device shard the params live in (or the all-gather's buffer)
        source = hs.master if hs.out is None else hs.out
        ranges = _touched_ranges(hs.segments, touched)
        if self.stream is None:
            for a, b in ranges:
                target[a:b].copy_(source[a:b])
            return
        # the side stream waited for the compute stream at the scalars' copy: backward's last read of
        # these params is behind it, and the device buckets' kernels since touch other buffers
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            for a, b in ranges:
                target[a:b].copy_(source[a:b], non_blocking=True)
        current.wait_stream(self.stream)  # the all-gather (and any read) after the copy

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """The CPU kernels' threads for the step (``SHARDAMP_OFFLOAD_THREADS``), restored after."""
        before = torch.get_num_threads()
        if before != self.threads:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            if before != self.threads:
                torch.set_num_threads(before)


def _touched_ranges(segments: SegmentTable, touched: List[float]) -> List[Tuple[int, int]]:
    """The shard's element ranges the step may have written (the touched params' segments, adjacent
    ones merged): only those are copied back, so an untouched param keeps its device values as it
    does without offload."""
    ranges: List[Tuple[int, int]] = []
    for s in segments.segments:
        if touched[s.param_index] == 0:
            continue
        if ranges and ranges[-1][1] == s.start:
            ranges[-1] = (ranges[-1][0], s.start + s.length)
        else:
            ranges.append((s.start, s.start + s.length))
    return ranges
