"""Hyperparameters: validated from ``param_groups`` at every step (skipped while the groups hold
the plain values that validated last time), and kept on the device as the fp64 ``[G, 5]`` table
(lr, beta1, beta2, eps, weight_decay) the step kernels read.

Re-uploaded only when a value changed (from pinned memory, non-blocking: no host sync), so LR
schedulers and edits take effect at the next step. Where only the groups' float lrs changed (an LR
scheduler's every step) the lrs alone are checked and written, as values carried by one fill
launch (two where the groups' lrs differ): no host tensor, no pinned buffer, no copy, much as
torch's fused AdamW hands its kernel a float lr. A tensor lr (capturable) is read every step,
so CUDA graphs that replay the step read its current value: once per step into one device tensor
(``tensor_lrs``), which both the agreement entries and the table take.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor


# torch.optim.Adam(W) group options shardamp does not implement, with the one value each may
# have (torch writes these defaults into every group and state dict it makes)
UNSUPPORTED_OPTIONS = {"amsgrad": (False,), "maximize": (False,), "foreach": (None, False),
                       "fused": (None, False), "differentiable": (False,)}


MAX_NORM_TYPE = 64.0
NO_COPY = (
    "DistributedFusedAdam cannot be copied or pickled: it owns flat buffers that the model's params "
    "are views of, grad hooks and a process group. Save opt.state_dict() (or save_sharded) and load it "
    "into a new DistributedFusedAdam built over the model."
)


def check_norm_type(norm_type: Any) -> float:
    """``norm_type`` as a float; raise naming it unless it is > 0 and at most MAX_NORM_TYPE or inf."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"norm_type={norm_type!r}: expected a number > 0 or inf") from None
    if not p > 0:
        raise ValueError(f"norm_type={norm_type!r}: expected a number > 0 or inf")
    if p > MAX_NORM_TYPE and not math.isinf(p):
        # sum |g|**p overflows float32 for any |g| > 3.4e38**(1/p) (above 1.4 at p = 256), so
        # such a norm would be inf and skip every step: use the inf norm it approaches
        raise ValueError(f"norm_type={norm_type!r}: finite norm types above {MAX_NORM_TYPE:g} overflow "
                         "float32; use norm_type=float('inf') (the max norm, their limit)")
    return p


def check_max_norm(max_norm: Any, has_peers: bool = False) -> "float | Tensor":
    """``max_norm`` of a clip, as torch's ``clip_grad_norm_`` takes it (a number or a one-element
    tensor), >= 0 (negative would ascend) and not NaN (would never clip); inf never clips. A
    tensor off CUDA is read (free); a CUDA tensor is returned as a 0-d float32 view on its device
    and its value checked on the device at step (``clip_invalid``): no host sync. With peers
    (``has_peers``) a CUDA tensor is refused: its value is known after the step's stats, so the
    ranks could not agree on it (an invalid one would skip one rank's shards only)."""
    if isinstance(max_norm, Tensor):
        if max_norm.numel() != 1 or max_norm.is_complex() or max_norm.dtype == torch.bool:
            raise ValueError(f"max_norm: a tensor max_norm must hold one real number, got shape "
                             f"{tuple(max_norm.shape)} {max_norm.dtype}")
        if max_norm.device.type == "cuda":
            if has_peers:
                raise ValueError("max_norm: a CUDA tensor max_norm cannot be checked on every rank without a "
                                 "host sync; with several ranks pass a float (e.g. float(max_norm) once)")
            return max_norm.detach().reshape(()).float()
        max_norm = float(max_norm.detach().reshape(()))
    if isinstance(max_norm, bool) or not (isinstance(max_norm, (int, float)) and max_norm >= 0):
        raise ValueError(f"max_norm={max_norm!r}: expected a float >= 0 (negative would ascend, NaN never clips)")
    return float(max_norm)


def clip_invalid(max_norms: Sequence[Any]) -> Optional[Tensor]:
    """A 0-d float32 device flag, 1.0 if a tensor ``max_norm`` (see ``check_max_norm``) is NaN or
    negative; None when every max_norm is a number (checked on the host already)."""
    flags = [~(m >= 0) for m in max_norms if isinstance(m, Tensor)]  # NaN compares False
    if not flags:
        return None
    return torch.stack(flags).any().float() if len(flags) > 1 else flags[0].float()


def check_lr_tensor(lr: Tensor, where: str, read_value: bool) -> None:
    """A tensor lr: one floating-point element (torch.optim's rule) and, when ``read_value``
    (construction, load_state_dict: never the step path on CUDA), finite and >= 0. At step the
    value is checked on the device instead (``lr_invalid``)."""
    if lr.numel() != 1 or not lr.is_floating_point():
        raise ValueError(f"{where}lr: a tensor lr must hold one floating-point element, got shape "
                         f"{tuple(lr.shape)} {lr.dtype}")
    if read_value:
        value = float(lr.detach().reshape(()).to("cpu"))
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{where}lr=tensor({value}): expected a finite value >= 0")


def check_group_options(group: dict, where: str) -> None:
    """Raise naming any torch.optim group option set to a value shardamp does not implement."""
    for key, allowed in UNSUPPORTED_OPTIONS.items():
        if key in group and not any(group[key] is a or (a is not None and group[key] == a) for a in allowed):
            raise ValueError(f"{where}{key}={group[key]!r} is not supported by DistributedFusedAdam "
                             f"(remove it or set {key}={allowed[0]!r})")


def check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str, read_lr: bool = True) -> None:
    """Raise a ValueError naming the hyperparameter (prefixed by ``where``) that is invalid."""
    if isinstance(lr, Tensor):
        check_lr_tensor(lr, where, read_lr)
    elif isinstance(lr, bool) or not (isinstance(lr, (int, float)) and lr >= 0 and math.isfinite(lr)):
        raise ValueError(f"{where}lr={lr!r}: expected a finite float >= 0 (or a one-element tensor)")
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"{where}betas={betas!r}: expected a pair of floats in [0, 1)")
    if not (isinstance(eps, (int, float)) and eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"{where}eps={eps!r}: expected a finite float >= 0")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"{where}weight_decay={weight_decay!r}: expected a finite float >= 0")


def validate_groups(param_groups: Sequence[dict], read_lr: bool) -> str:
    """Check every group as ``HparamTable.refresh`` does; return the first problem ('' if none)."""
    try:
        for i, group in enumerate(param_groups):
            where = f"param_groups[{i}]: "
            check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"], where, read_lr=read_lr)
            check_group_options(group, where)
    except (ValueError, KeyError, TypeError) as exc:
        return str(exc)
    return ""


class TensorLrs(NamedTuple):
    """This step's tensor lrs: the groups that have one, and their values (fp64, on the device)."""

    groups: List[int]
    values: Tensor


def tensor_lrs(param_groups: Sequence[dict], device: torch.device) -> Optional[TensorLrs]:
    """Read every tensor lr once: one fp64 device tensor, in group order (None if no group has
    one). A malformed lr (not one element; flagged by the validation) reads as NaN. Host (CPU)
    lrs for CUDA params travel together through pinned memory, non-blocking: no host sync."""
    groups = [i for i, g in enumerate(param_groups) if isinstance(g.get("lr"), Tensor)]
    if not groups:
        return None
    values = []
    for i in groups:
        lr = param_groups[i]["lr"].detach()
        values.append(lr.reshape(()) if lr.numel() == 1 else torch.tensor(math.nan, device=lr.device))
    on_host = [v.device.type == "cpu" for v in values]
    if len(values) == 1 and (device.type == "cpu" or not on_host[0]):  # one launch at most (none for fp64)
        out = values[0].to(device=device, dtype=torch.float64).reshape(1)
    elif device.type == "cpu" or not any(on_host):
        out = torch.stack([v.to(device=device, dtype=torch.float64) for v in values])
    else:  # the host lrs in one pinned, non-blocking copy; lrs already on the device copied there
        host = torch.stack([v.to(torch.float64) if h else torch.zeros((), dtype=torch.float64)
                            for v, h in zip(values, on_host)]).pin_memory()
        out = host.to(device, non_blocking=True)
        for k, (v, h) in enumerate(zip(values, on_host)):
            if not h:
                out[k].copy_(v)
    return TensorLrs(groups, out)


_PLAIN = (float, int)  # exact types: a bool is refused by the checks, so it never matches a key
_ABSENT = object()  # an option a group does not set
# plain_key runs every step: its per-value work is C-level iteration (map), no Python frame per value
_PLAIN_TYPES = frozenset(_PLAIN)
_OPTION_NAMES = tuple(UNSUPPORTED_OPTIONS)
_OPTION_ABSENT = (_ABSENT,) * len(_OPTION_NAMES)
NO_KEY = object()  # a caller that has not computed plain_key (None is a key: "not cacheable")
_lr_of = operator.itemgetter(0)  # a plain key's group entry: (lr, beta1, beta2, eps, wd, *options)
_rest_of = operator.itemgetter(slice(1, None))


def plain_key(param_groups: Sequence[dict]) -> Optional[tuple]:
    """The groups' hyperparameters and options as one hashable key, where every value is a plain
    float or int and the betas a pair: equal keys validate alike and fill the same table rows.
    None (no caching) for anything else: a tensor lr, a NaN (never equal to itself anyway)."""
    key = []
    for group in param_groups:
        lr, betas, eps, wd = group.get("lr"), group.get("betas"), group.get("eps"), group.get("weight_decay")
        if type(betas) not in (tuple, list) or len(betas) != 2:
            return None
        values = (lr, betas[0], betas[1], eps, wd)
        if not _PLAIN_TYPES.issuperset(map(type, values)):
            return None
        key.append(values + tuple(map(group.get, _OPTION_NAMES, _OPTION_ABSENT)))
    return tuple(key)


def lrs_only_changed(key: Optional[tuple], last: Optional[tuple]) -> bool:
    """Whether plain keys ``key`` and ``last`` (same groups) differ at most in the groups' lrs,
    and every lr of ``key`` is valid (finite, >= 0): what an LR scheduler's step changes. False
    (check everything) otherwise, also where an lr is invalid (the full check names it)."""
    if key is None or last is None or len(key) != len(last):
        return False
    if list(map(_rest_of, key)) != list(map(_rest_of, last)):
        return False
    lrs = list(map(_lr_of, key))
    # NaN fails min's comparison or the sum; inf the sum (a sum overflowing from finite lrs only
    # sends them to the full check, which accepts them)
    return min(lrs) >= 0 and math.isfinite(sum(lrs))


class HparamTable:
    """The step kernels' fp64 ``[G, 5]`` table on the device, and the step's validation of the
    groups: both skipped while the groups hold the values last validated and uploaded (the
    checks cost tens of microseconds of host time per step on a GPU host)."""

    def __init__(self, num_groups: int, device: torch.device) -> None:
        self.device = device
        self.table = torch.zeros(num_groups, 5, dtype=torch.float64, device=device)
        self._lr_column = self.table[:, 0]  # views made once: a view op costs a step microseconds
        self._lr_cells = list(self._lr_column.unbind())
        self._host: Optional[List[Tuple]] = None
        self._valid_key: Optional[tuple] = None  # the last plain_key that validated
        self._table_key: Optional[tuple] = None  # the plain_key the table holds

    def invalidate(self) -> None:
        """Force a re-upload at the next refresh (after param_groups were replaced wholesale)."""
        self._host = None
        self._valid_key = self._table_key = None

    def validate(self, param_groups: Sequence[dict], key: Any = NO_KEY) -> str:
        """``validate_groups`` (the first problem, '' if none), skipped while the groups hold the
        values that validated last time. ``key``: ``plain_key(param_groups)`` if the caller has it."""
        key = plain_key(param_groups) if key is NO_KEY else key
        if key is not None and (key == self._valid_key or lrs_only_changed(key, self._valid_key)):
            self._valid_key = key
            return ""
        problem = validate_groups(param_groups, read_lr=self.device.type != "cuda")
        self._valid_key = None if problem else key
        return problem

    def refresh(self, param_groups: Sequence[dict], lrs: Optional[TensorLrs] = None, key: Any = NO_KEY) -> Tensor:
        """Validate ``param_groups`` and bring the device table up to date; return it. ``lrs``:
        this step's tensor lrs as already read (``tensor_lrs``); read here if not given.
        ``key``: ``plain_key(param_groups)`` if the caller has it (the groups unchanged since)."""
        key = plain_key(param_groups) if key is NO_KEY else key
        if key is not None and key == self._table_key:  # float lrs only: no tensor lr to copy either
            return self.table
        if lrs_only_changed(key, self._table_key):  # a scheduler's step: the lrs alone, no upload
            self._write_lrs(list(map(_lr_of, key)))
            self._host = None  # the rows a full refresh compares with are stale: it uploads
            self._table_key = self._valid_key = key
            return self.table
        host = []
        for i, group in enumerate(param_groups):
            check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"], f"param_groups[{i}]: ",
                          read_lr=self.device.type != "cuda")
            check_group_options(group, f"param_groups[{i}]: ")
            lr = group["lr"]
            lr_key = ("tensor", id(lr)) if isinstance(lr, Tensor) else float(lr)
            host.append((lr_key, float(group["betas"][0]), float(group["betas"][1]), float(group["eps"]),
                         float(group["weight_decay"])))
        if host != self._host:
            rows = [[0.0 if isinstance(h[0], tuple) else h[0], *h[1:]] for h in host]
            table = torch.tensor(rows, dtype=torch.float64)
            if self.device.type == "cuda":
                table = table.pin_memory()
            self.table.copy_(table, non_blocking=True)
            self._host = host
        self._table_key = self._valid_key = key
        if lrs is None:
            lrs = tensor_lrs(param_groups, self.device)
        if lrs is not None:  # capturable: copied on the device, every step
            first, n = lrs.groups[0], len(lrs.groups)
            if lrs.groups == list(range(first, first + n)):
                self.table[first:first + n, 0].copy_(lrs.values)
            else:
                for k, i in enumerate(lrs.groups):
                    self.table[i, 0].copy_(lrs.values[k])
        return self.table

    def _write_lrs(self, lrs: List[float]) -> None:
        """Write the groups' float ``lrs`` into the table's lr column on its stream, each value a
        launch argument: one fill where all are equal (a scheduler scales groups alike, and their
        base lrs are mostly one), else a zero and an add over the column's cells (exact: 0 + lr)."""
        first = lrs[0]
        if lrs.count(first) == len(lrs):
            self._lr_column.fill_(first)
        else:
            torch._foreach_zero_(self._lr_cells)
            torch._foreach_add_(self._lr_cells, lrs)


_SYNC_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_options(flags: dict, max_grad_norm, dtype, grad_sync_dtype, param_sync_dtype, bucket_cap_mb) -> None:
    """The constructor's options other than the hyperparameters: ValueError naming the argument."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: expected True or False")
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0 and math.isfinite(max_grad_norm)
    ):
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: expected None or a finite float > 0")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype={dtype!r}: the master-param/state dtype must be torch.float32 or torch.float64")
    for name, value in (("grad_sync_dtype", grad_sync_dtype), ("param_sync_dtype", param_sync_dtype)):
        if value is not None and value not in _SYNC_DTYPES:
            raise ValueError(f"{name}={value!r}: expected None or one of float32, bfloat16, float16, float64")
    if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0 and math.isfinite(bucket_cap_mb)):
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}: expected a finite number of megabytes > 0")


def check_new_group(group: Dict[str, Any], index: int) -> None:
    """Validate param group ``index`` as torch's ``add_param_group`` filled it in: its
    hyperparameters, its options, ``Parameter`` leaves, no param given twice.

    Raises:
        ValueError: naming the group, the param and the fix.
    """
    where = f"param_groups[{index}]: "
    check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"], where)
    check_group_options(group, where)
    seen: Dict[int, int] = {}
    for i, p in enumerate(group["params"]):
        if not isinstance(p, torch.nn.Parameter):
            raise ValueError("params: DistributedFusedAdam needs torch.nn.Parameter leaves (got a plain tensor)")
        if id(p) in seen:  # torch only warns, then updates it twice per step
            raise ValueError(f"{where}params: parameter {i} (shape {tuple(p.shape)}) is parameter {seen[id(p)]} "
                             "given again; pass each parameter once")
        seen[id(p)] = i
