"""``clip_grad_norm_``: a drop-in for ``torch.nn.utils.clip_grad_norm_`` that also clips the
params a DistributedFusedAdam manages (their grads live in its shards; ``.grad`` only shows a view).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Union

import torch
from torch import Tensor

from . import norms as norm_math
from .distributed_fused_adam import DistributedFusedAdam
from .grads_view import owners as _owners
from .hparams import check_max_norm, check_norm_type


def clip_grad_norm_(
    parameters: Union[Tensor, Iterable[Tensor]],
    max_norm: Union[float, Tensor],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> Tensor:
    """Clip the grads of ``parameters`` to a global norm of ``max_norm``; return that norm.

    Exactly torch's ``torch.nn.utils.clip_grad_norm_`` on the grads ``param.grad`` shows, also
    over the params a :class:`DistributedFusedAdam` manages: the norm is of the grads as they
    are now (before ``unscale_`` the SCALED grads, so ``max_norm`` is compared with the scaled
    norm: torch's idiom ``clip_grad_norm_(params, max_norm * scaler.get_scale())`` clips as in
    torch; after ``unscale_`` the true grads) and stays that value. Managed params are clipped
    through their optimizer (the coefficient is applied inside its next step, no pass over the
    grads) and must be passed together with every other param of that optimizer: a subset
    raises, since the global norm of a subset cannot be clipped without clipping the rest. All
    other params are clipped in place exactly as torch does. The returned norm covers both kinds
    (``(sum n_i^p)^(1/p)``, or the max for ``inf``). torch's own ``torch.nn.utils.clip_grad_norm_``
    behaves the same over managed params while a DistributedFusedAdam is alive (its helpers are
    wrapped: optim/torch_tools.py); this function does not depend on that wrapping.
    ``opt.clip_grad_norm`` differs before ``unscale_`` only: its ``max_norm`` is the plain one
    (docs/amp-loops.md, loop G).

    A collective over managed params (every rank calls it). Same signature as torch's:
    ``error_if_nonfinite=True`` raises (as torch) when the total norm is NaN or inf, which reads
    it on the host (a sync, as in torch); ``foreach`` is passed to torch for the plain params.
    ``max_norm`` must be a number >= 0 (negative would ascend, NaN would never clip); a
    non-finite norm of a DistributedFusedAdam's params skips its step.

    Raises:
        ValueError: some but not all params of a DistributedFusedAdam, or an invalid ``max_norm``.
        RuntimeError: a non-finite norm with ``error_if_nonfinite=True``, or a read inside
            ``opt.no_sync()``.
    """
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    params = list(parameters)
    norm_type = check_norm_type(norm_type)
    owned: Dict[int, DistributedFusedAdam] = {}
    seen: Dict[int, set] = {}
    plain: List[Tensor] = []
    for p, opt in zip(params, _owners(params)):
        if opt is None:
            if p.grad is not None:
                plain.append(p)
        else:
            owned[id(opt)] = opt
            seen.setdefault(id(opt), set()).add(id(p))
    # a CUDA tensor stays on the device (checked at the step); refused when ranks would have to agree on it
    max_norm = check_max_norm(max_norm, any(opt.world_size > 1 for opt in owned.values()))
    norms: List[Tensor] = []
    for key, opt in owned.items():
        total = sum(len(group["params"]) for group in opt.param_groups)
        missing = total - len(seen[key])
        if missing:
            raise ValueError(
                f"clip_grad_norm_: parameters includes {len(seen[key])} of the {total} params "
                f"of a DistributedFusedAdam ({missing} missing). Its global norm covers all of them: "
                "pass them all (e.g. model.parameters()) or call opt.clip_grad_norm(max_norm)."
            )
        # the norm of the grads param.grad shows now (scaled before unscale_, clipped so far), as torch's
        norms.append(opt._grads_view.total_norm(range(total), norm_type))
    device = norms[0].device if norms else (plain[0].grad.device if plain else torch.device("cpu"))
    if plain:
        grads = [p.grad for p in plain]
        norms.append(torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach).to(device))
    if not norms:
        return torch.tensor(0.0)
    total_norm = norms[0] if len(norms) == 1 else norm_math.combine(norms, norm_type, device)
    if error_if_nonfinite and not bool(torch.isfinite(total_norm)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
            "anyway, set `error_if_nonfinite=False`"
        )
    for opt in owned.values():
        opt._grads_view.clip(range(sum(len(g["params"]) for g in opt.param_groups)), max_norm, total_norm)
    if plain:
        coef = norm_math.torch_clip_coef(max_norm, total_norm)  # no sync
        for p in plain:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    return total_norm
